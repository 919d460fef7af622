"""Where media paths may point (data/media.py): inside data.image_dir when it is set, as written when it is not.

With data.image_dir set, an absolute path or one whose ``..`` climbs out of it
was read; now it is refused, naming the path and the fix, unless
data.allow_paths_outside_image_dir is true. Video frame counts are capped and
each frame is resized as it is read.
"""

from __future__ import annotations

import pytest
from helpers.media import png, write_video
from PIL import Image

from vlmrl.data.media import MAX_VIDEO_FRAMES, MediaError, load_video, open_image
from vlmrl.models.qwen_vision import QwenMediaSizes

VIDEO = dict(fps=2.0, sizes=QwenMediaSizes(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=12544))


@pytest.fixture
def dirs(tmp_path):
    inside, outside = tmp_path / "images", tmp_path / "elsewhere"
    (inside / "sub").mkdir(parents=True), outside.mkdir()
    (inside / "in.png").write_bytes(png(56, 56))
    (outside / "out.png").write_bytes(png(56, 56))
    return inside, outside


def test_paths_leaving_image_dir_are_refused_with_the_fix(dirs):
    inside, outside = dirs
    assert open_image("in.png", inside).size == (56, 56)
    assert open_image("sub/../in.png", inside).size == (56, 56)  # .. that stays inside is fine
    for item in ("../elsewhere/out.png", {"bytes": None, "path": "../elsewhere/out.png"}):
        with pytest.raises(MediaError, match=r"leaves data\.image_dir.*data\.allow_paths_outside_image_dir=true"):
            open_image(item, inside)
    with pytest.raises(MediaError, match=r"absolute path .* refused.*allow_paths_outside_image_dir=true"):
        open_image(str(outside / "out.png"), inside)
    with pytest.raises(MediaError, match="leaves data.image_dir"):
        load_video(["in.png", "../elsewhere/out.png"], inside, **VIDEO)
    with pytest.raises(MediaError, match="absolute path"):
        load_video(str(outside / "v.mp4"), inside, **VIDEO)


def test_the_opt_in_and_a_null_image_dir_read_paths_as_written(dirs, monkeypatch):
    inside, outside = dirs
    assert open_image("../elsewhere/out.png", inside, allow_outside=True).size == (56, 56)
    assert open_image(str(outside / "out.png"), inside, allow_outside=True).size == (56, 56)
    monkeypatch.chdir(inside)
    assert open_image("../elsewhere/out.png", None).size == (56, 56)  # relative to the current directory
    assert open_image(str(outside / "out.png"), None).size == (56, 56)


def test_the_frame_cap_is_qwen_vl_utils_one():
    from qwen_vl_utils.vision_process import FPS_MAX_FRAMES

    assert MAX_VIDEO_FRAMES == FPS_MAX_FRAMES


def test_a_long_frame_list_is_sampled_down_to_the_cap_and_its_rate_lowered(tmp_path):
    frames = [Image.new("RGB", (56, 56), (i * 10, 0, 0)) for i in range(20)]
    video = load_video(frames, None, **VIDEO, max_frames=4)
    assert video.frames.shape[0] == 4 and video.fps == pytest.approx(2.0 * 4 / 20)
    # Frames 0, 6, 13, 19 of the list: evenly spread over it.
    assert [round(float(v)) for v in video.frames[:, 0, 10, 10]] == [0, 60, 130, 190]


def test_a_long_video_file_is_capped_too(tmp_path):
    write_video(tmp_path / "v.mp4", frames=8, fps=1, size=(64, 64))  # 8 s: 16 frames at 2 fps, 8 there are
    video = load_video("v.mp4", tmp_path, **VIDEO, max_frames=4)
    assert video.frames.shape[0] == 4 and video.fps == pytest.approx(2.0 * 4 / 8)


def test_frames_are_resized_as_they_are_read(tmp_path, monkeypatch):
    import qwen_vl_utils

    seen = []
    real = qwen_vl_utils.fetch_video
    monkeypatch.setattr(qwen_vl_utils, "fetch_video", lambda ele, **kw: (seen.extend(ele["video"]), real(ele, **kw))[1])
    load_video([Image.new("RGB", (1000, 800))] * 3, None, **VIDEO)
    write_video(tmp_path / "v.mp4", frames=4, fps=2, size=(640, 480))
    load_video("v.mp4", tmp_path, **VIDEO)
    assert seen and all(f.width * f.height <= VIDEO["sizes"].max_pixels for f in seen), [f.size for f in seen]
