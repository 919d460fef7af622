"""RLHFDataset on the rows users bring: sources, videos, mixed media, and every kind of bad row.

Runs the tiny Qwen2.5-VL processor on files written to tmp_path. Each bad row
must give one error naming the file, the row and the key, or with
``on_bad_sample=skip`` be left out and counted, never reach the model.
"""

from __future__ import annotations

import logging

import datasets
import pytest
import torch
from helpers.media import png, write_jsonl, write_parquet, write_video
from PIL import Image
from transformers import AutoProcessor

from vlmrl.data.dataset import DataError, RLHFDataset
from vlmrl.data.loader import make_loader
from vlmrl.config import BadSamplePolicy

MIN_PIXELS, MAX_PIXELS = 3136, 12544  # 4..16 merged tokens per image or frame


@pytest.fixture(scope="module")
def processor(tiny_assets):
    return AutoProcessor.from_pretrained(tiny_assets.model_dir)


@pytest.fixture(scope="module")
def token(processor):
    return processor.tokenizer.convert_tokens_to_ids


def dataset(files: str, processor, **overrides) -> RLHFDataset:
    kwargs = {
        "prompt_key": "problem",
        "answer_key": "answer",
        "image_key": "images",
        "image_dir": None,
        "max_prompt_length": 1024,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "video_fps": 2.0,
    }
    kwargs.update(overrides)
    return RLHFDataset(files, processor, **kwargs)


# --------------------------------------------------------------------------- sources


def test_directories_arrow_saved_datasets_and_comma_lists(tmp_path, processor):
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "b.jsonl", [{"problem": "b", "answer": "1"}])
    write_parquet(folder / "sub" / "c.parquet", [{"problem": "c", "answer": "2"}])
    (folder / "notes.txt").write_text("not data")  # other files in a directory are not sources
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"problem": "d", "answer": "3"}, {"problem": "e", "answer": "4"}]).save_to_disk(saved)
    # An .arrow file as `datasets` writes it (a cache file of a table).
    arrow = tmp_path / "f.arrow"
    table = datasets.Dataset.from_list([{"problem": "f", "answer": "5"}])
    table.map(lambda r: r, cache_file_name=str(arrow))

    ds = dataset(f"{folder},{saved}, {arrow}", processor)
    assert [s.ground_truth for s in ds] == ["1", "2", "3", "4", "5"]
    # Each sample's id names the file it came from and its row there; it does not move with shuffling.
    assert [s.uid for s in ds] == [
        f"{folder / 'b.jsonl'}:0",
        f"{folder / 'sub' / 'c.parquet'}:0",
        f"{saved}:0",
        f"{saved}:1",
        f"{arrow}:0",
    ]


def test_unknown_extension_missing_path_and_empty_directory_are_named(tmp_path, processor):
    csv = tmp_path / "d.csv"
    csv.write_text("problem,answer\nq,a\n")
    with pytest.raises(DataError, match=r"d\.csv: unsupported data file type 'csv'"):
        dataset(str(csv), processor)
    with pytest.raises(DataError, match=r"nope\.parquet: no such file or directory"):
        dataset(str(tmp_path / "nope.parquet"), processor)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="a directory with no .parquet"):
        dataset(str(tmp_path / "empty"), processor)


def test_a_line_that_is_not_json_is_named_by_file_line_and_its_start(tmp_path, processor):
    jsonl = tmp_path / "train.jsonl"
    good = '{"problem": "q", "answer": "a"}'
    jsonl.write_text(f"{good}\n{good}\nproblem: what is 2 + 2? answer: 4, written as a line of plain text\n{good}\n")
    with pytest.raises(DataError) as info:
        dataset(str(jsonl), processor)
    assert str(info.value) == (
        f"{jsonl} line 3: not JSON (Expecting value, column 1): "
        "'problem: what is 2 + 2? answer: 4, written as a line of plai...'; each line must hold one JSON object"
    )
    # A line cut short, and a line that is JSON but not an object, are named the same way.
    jsonl.write_text(f'{good}\n{{"problem": "q", "answer": "a"\n')
    with pytest.raises(DataError, match=rf"^{jsonl} line 2: not JSON \(Expecting ',' delimiter, column 31\): "):
        dataset(str(jsonl), processor)
    jsonl.write_text(f"{good}\n\n[1, 2]\n")
    with pytest.raises(DataError, match=rf"^{jsonl} line 3: a JSON list, not an object: '\[1, 2\]'"):
        dataset(str(jsonl), processor)
    # A .json file holding one document: the decoder's line, in the document.
    document = tmp_path / "train.json"
    document.write_text('[\n  {"problem": "q", "answer": "a"},\n  {"problem": "q" "answer": "a"}\n]\n')
    with pytest.raises(DataError, match=rf"^{document} line 3: not JSON \(Expecting ',' delimiter, column 19\): "):
        dataset(str(document), processor)


def test_a_hub_name_goes_to_the_hub_loader(tmp_path, processor, monkeypatch):
    calls = []

    def fake_load(name, split=None, **kwargs):
        calls.append((name, split))
        return datasets.Dataset.from_list([{"problem": "q", "answer": "a"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert dataset("hiyouga/geometry3k@test", processor)[0].uid == "hiyouga/geometry3k@test:0"
    dataset("owner/name", processor)
    assert calls == [("hiyouga/geometry3k", "test"), ("owner/name", "train")]


# --------------------------------------------------------------------------- rows


def test_multi_image_video_and_text_rows_side_by_side(tmp_path, processor, token):
    video = write_video(tmp_path / "v.mp4", frames=8, fps=4)  # 2 s; sampled at 2 fps: 4 frames
    short = write_video(tmp_path / "short.mp4", frames=3, fps=2)  # 1.5 s at 2 fps: 3 frames, padded to 4
    rows = [
        {
            "problem": "Compare <image> and <image>.",
            "answer": "a",
            "images": [png(56, 56), png(84, 56)],
            "videos": None,
        },
        {"problem": "What happens in <video>?", "answer": "b", "images": None, "videos": [video]},
        {"problem": "Clip then a picture.", "answer": "c", "images": [png(56, 56)], "videos": [short]},
        {"problem": "Plain text.", "answer": "d", "images": None, "videos": None},
    ]
    ds = dataset(write_parquet(tmp_path / "d.parquet", rows), processor)
    multi, clip, both, text = (ds[i] for i in range(4))

    assert multi.mm_inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    assert set(multi.mm_inputs) == {"pixel_values", "image_grid_thw"}

    # 8 frames at 4 fps sampled at 2 fps: 4 frames, 64 px resized to 56, two temporal patches.
    assert clip.videos[0].frames.shape == (4, 3, 56, 56)
    assert clip.mm_inputs["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert set(clip.mm_inputs) == {"pixel_values_videos", "video_grid_thw"}
    assert clip.raw_prompt_ids.count(token("<|video_pad|>")) == 1
    assert clip.input_ids.count(token("<|video_pad|>")) == 2 * 4 * 4 // 4
    assert "What happens in <|vision_start|><|video_pad|><|vision_end|>?" in clip.prompt_text
    frames_np, meta = clip.multi_modal_data["video"][0]
    assert frames_np.shape == (4, 56, 56, 3) and frames_np.dtype.name == "uint8"
    assert meta["fps"] == 2.0 and meta["do_sample_frames"] is False

    # No placeholders: images first, then videos, then the text.
    assert "<|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>Clip then" in both.prompt_text
    assert both.videos[0].frames.shape[0] == 4  # 3 frames padded to an even count
    assert set(both.mm_inputs) == {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"}

    assert text.mm_inputs == {} and text.multi_modal_data == {} and text.videos == []
    for s in (multi, clip, both, text):
        assert s.position_ids.shape == (3, len(s.input_ids))
        assert s.attention_mask == [1] * len(s.input_ids)

    # One loader batch holds all four kinds; the collate keeps samples as they are.
    (batch,) = make_loader(ds, batch_size=4, shuffle=False, seed=0, drop_last=True)
    assert [s.ground_truth for s in batch] == ["a", "b", "c", "d"]


def test_video_positions_follow_the_original_qwen_layout(tmp_path, processor, token):
    # 4 frames at 2 fps -> second_per_grid_ts = 2 / 2 = 1 s; Qwen2.5-VL scales the temporal
    # index by tokens_per_second (2) * 1 s: temporal patches at +0 and +2.
    ds = dataset(
        write_parquet(tmp_path / "d.parquet", [{"problem": "<video>", "answer": "a", "videos": [[png(56, 56)] * 4]}]),
        processor,
    )
    s = ds[0]
    ids = torch.tensor(s.input_ids)
    video = (ids == token("<|video_pad|>")).nonzero().flatten()
    start = int(video[0])
    pos = s.position_ids
    assert pos[0, video].tolist() == [start] * 4 + [start + 2] * 4
    assert pos[1, video].tolist() == [start + h for h in (0, 0, 1, 1)] * 2
    assert pos[2, video].tolist() == [start + w for w in (0, 1, 0, 1)] * 2
    # The text after the video resumes one past the largest position used (start + 2), as vLLM does.
    after = int(video[-1]) + 1
    assert pos[:, after].tolist() == [start + 3] * 3


# --------------------------------------------------------------------------- bad rows

# Images are paths under image_dir (tmp_path), so that every row fits in JSON.
GOOD = {"problem": "<image>fine", "answer": "ok", "images": ["good.png"], "videos": None}


@pytest.fixture(autouse=True)
def media_files(tmp_path):
    (tmp_path / "good.png").write_bytes(png(56, 56))
    (tmp_path / "corrupt.png").write_bytes(b"not a png at all")
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")


def bad_rows(tmp_path) -> list[tuple[str, dict, str, str]]:
    """(case, row, key named, words in the message)."""
    return [
        ("corrupt-image", {**GOOD, "images": ["corrupt.png"]}, "images", "unreadable image"),
        ("missing-image-file", {**GOOD, "images": ["gone.png"]}, "images", "missing image file"),
        ("placeholder-count", {**GOOD, "problem": "<image> vs <image>"}, "images", "2 <image> placeholders"),
        ("video-placeholder-count", {**GOOD, "problem": "<image><video>"}, "videos", "1 <video> placeholders"),
        ("empty-prompt", {**GOOD, "problem": "  "}, "problem", "the prompt is empty"),
        ("non-string-prompt", {**GOOD, "problem": None}, "problem", "not a string"),
        ("missing-answer", {**GOOD, "answer": None}, "answer", "no answer"),
        (
            "unreadable-video",
            {**GOOD, "problem": "x", "images": None, "videos": "broken.mp4"},
            "videos",
            "unreadable video",
        ),
        (
            "missing-video",
            {**GOOD, "problem": "x", "images": None, "videos": "nowhere.mp4"},
            "videos",
            "missing video file",
        ),
        ("vision-token-in-text", {**GOOD, "problem": "<image> and <|image_pad|>"}, "problem", "vision tokens"),
    ]


def test_every_bad_row_is_named_by_file_row_and_key(tmp_path, processor):
    for case, row, key, words in bad_rows(tmp_path):
        files = write_jsonl(tmp_path / f"{case}.jsonl", [GOOD, GOOD, row])
        with pytest.raises(DataError) as info:
            dataset(files, processor, image_dir=str(tmp_path))
        message = str(info.value)
        assert f"{files} row 2, key {key!r}" in message, (case, message)
        assert words in message, (case, message)
        assert "on_bad_sample=skip" in message


def test_skip_leaves_bad_rows_out_counts_and_logs_them(tmp_path, processor, caplog):
    cases = bad_rows(tmp_path)
    rows = [GOOD] + [row for _, row, _, _ in cases] + [GOOD]
    files = write_jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="vlmrl.data.dataset"):
        ds = dataset(files, processor, image_dir=str(tmp_path), on_bad_sample="skip")
    assert [s.index for s in ds] == [0, len(rows) - 1]
    assert sorted(ds.skipped) == list(range(1, len(rows) - 1))
    assert f"skipped {len(rows) - 2} bad rows of {len(rows)}" in caplog.text
    assert f"{files} row 1, key 'images'" in caplog.text


def test_bad_rows_found_on_read_stop_or_are_left_out_at_start_up(tmp_path, processor, caplog):
    files = write_jsonl(tmp_path / "d.jsonl", [GOOD, {**GOOD, "answer": None}, {**GOOD, "answer": "last"}])
    strict = dataset(files, processor, filter_overlong_prompts=False, image_dir=str(tmp_path))
    assert strict[0].ground_truth == "ok"
    with pytest.raises(DataError, match=r"d\.jsonl row 1, key 'answer': no answer"):
        strict[1]
    # With skip, the rows are checked at start-up even without length filtering: the bad row is left out
    # of the index, so no row stands in for it and appears twice in an epoch.
    lenient = dataset(
        files, processor, filter_overlong_prompts=False, on_bad_sample=BadSamplePolicy.skip, image_dir=str(tmp_path)
    )
    assert [s.index for s in lenient] == [0, 2] and list(lenient.skipped) == [1]


def test_a_row_that_turns_bad_after_the_check_gives_way_and_says_it_duplicates(tmp_path, processor, caplog):
    (tmp_path / "later.png").write_bytes(png(56, 56))
    rows = [GOOD, {**GOOD, "images": ["later.png"]}, {**GOOD, "answer": "last"}]
    ds = dataset(write_jsonl(tmp_path / "d.jsonl", rows), processor, on_bad_sample="skip", image_dir=str(tmp_path))
    assert len(ds) == 3
    (tmp_path / "later.png").unlink()  # the source changes after the start-up check
    with caplog.at_level(logging.WARNING, logger="vlmrl.data.dataset"):
        assert ds[1].ground_truth == "last"
    assert list(ds.skipped) == [1]
    assert "passed the start-up check" in caplog.text and "appears twice this epoch" in caplog.text


@pytest.mark.timeout(120)
def test_a_row_check_process_that_is_killed_fails_the_check_instead_of_hanging(tmp_path, processor, monkeypatch):
    import os
    import signal

    check_rows = RLHFDataset.check_rows

    def dies_on_row_3(self, row_ids):
        if 3 in row_ids:
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would, in the forked checker
        return check_rows(self, row_ids)

    monkeypatch.setattr(RLHFDataset, "check_rows", dies_on_row_3)
    files = write_jsonl(tmp_path / "d.jsonl", [{"problem": f"q{i}", "answer": str(i)} for i in range(8)])
    with pytest.raises(DataError, match="a row-check process died .* lower data.filter_overlong_prompts_workers"):
        dataset(files, processor, filter_overlong_prompts_workers=2)


def test_a_media_token_count_that_does_not_match_the_grid_is_caught_before_the_model(tmp_path, processor):
    ds = dataset(write_jsonl(tmp_path / "d.jsonl", [GOOD]), processor, image_dir=str(tmp_path))
    sample = ds[0]
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    short = [t for i, t in enumerate(sample.input_ids) if not (t == pad and i == sample.input_ids.index(pad))]
    with pytest.raises(ValueError, match="a run of 3 image tokens where the image's grid gives 4"):
        ds.rotary.positions(short, sample.mm_inputs)


# --------------------------------------------------------------------------- filtering


def test_overlong_rows_are_dropped_in_worker_processes_and_counted(tmp_path, processor, caplog):
    rows = [{"problem": f"q{i}" + (" long" * 100 if i % 3 == 0 else ""), "answer": str(i)} for i in range(9)]
    files = write_jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="vlmrl.data.dataset"):
        ds = dataset(files, processor, max_prompt_length=64, filter_overlong_prompts_workers=2)
    assert [s.index for s in ds] == [1, 2, 4, 5, 7, 8]
    assert ds.overlong == [0, 3, 6]
    assert "dropped 3 of 9 rows longer than data.max_prompt_length=64" in caplog.text


def test_without_filtering_an_overlong_row_stops_the_run_with_the_fix(tmp_path, processor):
    files = write_jsonl(tmp_path / "d.jsonl", [{"problem": "long " * 100, "answer": "a"}])
    ds = dataset(files, processor, max_prompt_length=64, filter_overlong_prompts=False)
    with pytest.raises(DataError) as info:
        ds[0]
    message = str(info.value)
    assert f"{files} row 0" in message and "data.max_prompt_length=64" in message
    assert "data.max_pixels" in message and "filter_overlong_prompts" in message


def test_a_dataset_left_empty_names_the_counts_and_the_settings(tmp_path, processor):
    files = write_jsonl(tmp_path / "d.jsonl", [{"problem": "long " * 100, "answer": "a"}, {**GOOD, "answer": None}])
    with pytest.raises(DataError) as info:
        dataset(files, processor, max_prompt_length=64, on_bad_sample="skip", image_dir=str(tmp_path))
    message = str(info.value)
    assert "no usable rows left: 2 rows, 1 longer than data.max_prompt_length=64" in message and "1 bad" in message


# --------------------------------------------------------------------------- image column forms


def test_a_datasets_image_column_decodes_to_pil(tmp_path, processor):
    table = datasets.Dataset.from_dict(
        {"problem": ["<image>"], "answer": ["a"], "images": [[Image.new("RGB", (56, 56), (0, 200, 0))]]},
        features=datasets.Features(
            {"problem": datasets.Value("string"), "answer": datasets.Value("string"), "images": [datasets.Image()]}
        ),
    )
    table.to_parquet(tmp_path / "d.parquet")
    sample = dataset(str(tmp_path / "d.parquet"), processor)[0]
    assert sample.images[0].getpixel((10, 10)) == (0, 200, 0)
