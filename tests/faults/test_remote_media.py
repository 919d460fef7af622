"""Fault: a data file that names media by URL, to make the training host fetch it.

A parquet file with a ``datasets`` ``Image`` column whose entry is
``{"bytes": None, "path": "http://..."}`` was fetched by ``datasets`` as the row
was read. Media columns are now read undecoded and every media path with a
scheme is refused, in each form a row can hold it: a string, a dict, an HF
``Image`` column, a video file, a video's frame list. Each is a bad row named by
file, row and key, and nothing is fetched: a local HTTP server counts the
requests it gets.
"""

from __future__ import annotations

import http.server
import threading

import datasets
import pyarrow.parquet as pq
import pytest
from helpers.media import png, write_jsonl
from transformers import AutoProcessor

from vlmrl.data.dataset import DataError, RLHFDataset
from vlmrl.data.media import MediaError, load_video, open_image
from vlmrl.models.qwen_vision import QwenMediaSizes

FEATURES = datasets.Features(
    {"problem": datasets.Value("string"), "answer": datasets.Value("string"), "images": [datasets.Image()]}
)


@pytest.fixture(scope="module")
def server():
    """A local HTTP server that answers every GET with a PNG and counts the requests."""
    body = png(56, 56)
    requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            requests.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", requests
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def processor(tiny_assets):
    return AutoProcessor.from_pretrained(tiny_assets.model_dir)


def _dataset(files: str, processor, **overrides) -> RLHFDataset:
    kwargs = dict(prompt_key="problem", answer_key="answer", image_key="images", image_dir=None,
                  max_prompt_length=1024, min_pixels=3136, max_pixels=12544, video_fps=2.0)  # fmt: skip
    kwargs.update(overrides)
    return RLHFDataset(files, processor, **kwargs)


def test_an_hf_image_column_with_a_url_path_is_a_bad_row_and_fetches_nothing(tmp_path, server, processor):
    url, requests = server
    good = {"bytes": png(56, 56), "path": None}
    table = datasets.Dataset.from_dict(
        {
            "problem": ["<image>a", "<image>b", "<image>c"],
            "answer": ["1", "2", "3"],
            "images": [[good], [{"bytes": None, "path": f"{url}/fetched.png"}], [good]],
        },
        features=FEATURES,
    )
    # As a downloaded file holds it: pyarrow writes the column as is, where datasets' writers would fetch the URL
    # to embed it.
    pq.write_table(table.data.table, tmp_path / "d.parquet")
    table.save_to_disk(tmp_path / "saved")
    requests.clear()
    for files, name in ((tmp_path / "d.parquet", "d.parquet"), (tmp_path / "saved", "saved")):
        with pytest.raises(DataError, match=rf"{name} row 1, key 'images': image 0: remote path '{url}/fetched\.png'"):
            _dataset(str(files), processor)
        ds = _dataset(str(files), processor, on_bad_sample="skip")
        assert [s.ground_truth for s in ds] == ["1", "3"] and list(ds.skipped) == [1]
    assert requests == [], "a data file made the host fetch a URL"


@pytest.mark.parametrize(
    "path",
    [
        "http://127.0.0.1:9/x.png",
        "https://example.invalid/x.png",
        "ftp://example.invalid/x.png",
        "s3://bucket/x.png",
        "gs://bucket/x.png",
        "hf://datasets/owner/name/x.png",
        "file:///etc/hostname",
        "zip://x.png::http://example.invalid/a.zip",
    ],
)
def test_every_scheme_is_refused_in_every_form(tmp_path, path):
    for item in (path, {"bytes": None, "path": path}):
        with pytest.raises(MediaError, match="remote path .* refused: media are read from local files only"):
            open_image(item, None)
        with pytest.raises(MediaError, match="remote path .* refused"):
            open_image(item, tmp_path, allow_outside=True)  # the opt-in is about local paths only
    video = dict(image_dir=None, fps=2.0, sizes=QwenMediaSizes(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=12544))
    for item in (path, {"bytes": None, "path": path}, [path, path]):
        with pytest.raises(MediaError, match="remote path .* refused"):
            load_video(item, **video)


def test_jsonl_urls_in_images_and_videos_are_bad_rows_named_by_key(tmp_path, server, processor):
    url, requests = server
    requests.clear()
    (tmp_path / "ok.png").write_bytes(png(56, 56))
    cases = [  # one file each: a JSON column holds one kind of value
        ({"problem": "<image>a", "images": [f"{url}/a.png"]}, "images"),
        ({"problem": "<image>b", "images": [{"bytes": None, "path": f"{url}/b.png"}]}, "images"),
        ({"problem": "<video>c", "videos": [f"{url}/c.mp4"]}, "videos"),
        ({"problem": "<video>d", "videos": [[f"{url}/d.png", "ok.png"]]}, "videos"),
    ]
    for n, (row, key) in enumerate(cases):
        files = write_jsonl(tmp_path / f"d{n}.jsonl", [{"answer": "1", **row}])
        with pytest.raises(DataError, match=rf"d{n}\.jsonl row 0, key '{key}': (image|video) 0: remote path"):
            _dataset(files, processor, image_dir=str(tmp_path))
    assert requests == []
