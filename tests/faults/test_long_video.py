"""Fault: a long video in a dataset row.

Every frame used to be decoded into a PIL image before the frames were
subsampled, so a long video held all its frames in memory at once. Now only
the sampled frames become images; the sampled frames are the same ones.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np

from vlmrl.data.media import decode_video_file


def write_video(path, frames: int, fps: int, size: tuple[int, int]) -> str:
    """An mpeg4 video whose frame i has brightness (7 i) mod 256, so every frame differs from its neighbours."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            pixels = np.full((size[1], size[0], 3), (7 * i) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def _all_then_subsample(path, fps):
    """What the loader did before: every frame as an image, then the same picks."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate)
        frames = [f.to_image() for f in container.decode(stream)]
    wanted = min(max(2, round(len(frames) / rate * fps)), len(frames))
    return [frames[i] for i in np.linspace(0, len(frames) - 1, wanted).round().astype(int)]


def test_the_sampled_frames_are_the_ones_decoding_everything_gave(tmp_path):
    path = write_video(tmp_path / "v.mp4", frames=37, fps=8, size=(64, 48))
    (got, rate), expected = decode_video_file(tmp_path / "v.mp4", 2.0), _all_then_subsample(path, 2.0)
    assert len(got) == len(expected) == 9 and rate == 2.0  # 37 frames at 8 fps = 4.6 s, sampled at 2 fps
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, expected))


_PEAK = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    from vlmrl.data.media import decode_video_file
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    frames, _ = decode_video_file(Path(sys.argv[1]), 1.0)
    print(len(frames), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """
)


def test_a_long_video_costs_the_memory_of_its_sampled_frames_only(tmp_path):
    # 300 frames of 640 x 480 at 30 fps: 276 MB as RGB images; sampled at 1 fps, 10 frames (9 MB).
    write_video(tmp_path / "long.mp4", frames=300, fps=30, size=(640, 480))
    proc = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path / "long.mp4")], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    count, grown_mb = map(int, proc.stdout.split())
    assert count == 10
    assert grown_mb < 120, f"decoding grew the process by {grown_mb} MB"
