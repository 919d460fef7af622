"""Images and videos of a row: read, resized once to the processor's grid, and described for vLLM.

The resizing is the model family's (``vlmrl.models.MediaSizes``); what is
here reads media, samples a video's frames and guards what may be read.

Both the actor's processor (called with ``do_resize=False``) and vLLM get the
pixels made here, so the two see the same grid and expand a placeholder into
the same number of tokens.

Video files are decoded with PyAV (a dependency of qwen-vl-utils) and sampled
at ``video_fps``; the frames then go through the family's video resizing (for
the Qwen-VL families qwen-vl-utils' ``fetch_video``, which resizes them to the
grid and pads the count to an even number). The qwen-vl-utils readers for
files need decord or torchcodec, or torchvision's ``read_video``, which
torchvision 0.29 no longer has; decoding here works with what is installed.

Where media may come from: local files and bytes only. A path with a scheme
(``http://``, ``s3://``, ``hf://``, any ``NAME://``) is refused in every form
(a string, a ``{"bytes", "path"}`` dict, a video's frame list), so that a data
file cannot make the training host fetch anything. With ``data.image_dir``
set, a relative path must stay inside it (``..`` may not climb out; the check
is on the path as written, so symbolic links placed inside image_dir are
followed) and an absolute path is refused, unless
``data.allow_paths_outside_image_dir`` is true. Without ``data.image_dir``,
paths are used as written, relative ones from the current directory.

Every image form goes through ``open_image``: a decompression bomb, or a
broken file, is a ``MediaError`` that the dataset turns into a bad row. A
video contributes at most ``MAX_VIDEO_FRAMES`` frames, whether it is a file or
a frame list, and each frame is resized to the grid as it is read, so that
full-size frames never pile up.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlmrl.models import MediaSizes
from vlmrl.user_code import resolved_from


class MediaError(ValueError):
    """An image or video that cannot be read or used; the dataset adds the file and row."""


MAX_VIDEO_FRAMES = 768
"""The most frames one video contributes: qwen-vl-utils' cap for video files (``FPS_MAX_FRAMES``), applied
here to files and frame lists alike. A longer video is sampled evenly down to this many frames."""

_REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
"""A path with a scheme: http, https, ftp, s3, gs, hf, file, or any other ``NAME://``."""


def local_path(item: str, image_dir: Path | None, allow_outside: bool = False) -> Path:
    """The local file a media path names: refused if remote, or outside ``image_dir`` when that is set.

    Relative paths join ``image_dir`` (or, when it is None, the current directory). The containment check is
    lexical (``..`` is resolved on the path as written), so links the user placed inside image_dir work.
    """
    if _REMOTE.match(item):
        raise MediaError(
            f"remote path {item!r:.120} refused: media are read from local files only, so that a data file cannot "
            "make the training host fetch URLs; download the file and give its path (under data.image_dir)"
        )
    path = Path(item)
    if image_dir is None:
        return path
    if path.is_absolute():
        if not allow_outside:
            raise MediaError(
                f"absolute path {item!r:.120} refused: with data.image_dir={str(image_dir)!r} set, media paths are "
                "relative to it; give the path relative to data.image_dir, or set "
                "data.allow_paths_outside_image_dir=true if you trust the data file"
            )
        return path
    path = image_dir / path
    inside = os.path.normpath(path)
    root = os.path.normpath(image_dir)
    if not allow_outside and os.path.commonpath([root, inside]) != root:
        raise MediaError(
            f"path {item!r:.120} leaves data.image_dir={str(image_dir)!r} (it resolves to {inside!r}); give a "
            "path inside data.image_dir, or set data.allow_paths_outside_image_dir=true if you trust the data file"
        )
    return path


def _check_pixels(image: Image.Image) -> None:
    """PIL's decompression-bomb limit, for an image handed over already open (PIL checks it when it opens one)."""
    limit = Image.MAX_IMAGE_PIXELS
    if limit and image.width * image.height > 2 * limit:
        raise Image.DecompressionBombError(
            f"Image size ({image.width * image.height} pixels) exceeds limit of {2 * limit} pixels, "
            "could be decompression bomb DOS attack."
        )


def open_image(item: Any, image_dir: Path | None, allow_outside: bool = False) -> Image.Image:
    """An RGB PIL image from a PIL image, bytes, a path, or a ``{"bytes", "path"}`` dict (bytes first).

    Paths go through ``local_path``; every form passes PIL's decompression-bomb check.
    """
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    try:
        if isinstance(item, Image.Image):
            _check_pixels(item)
            image = item
        elif isinstance(item, (bytes, bytearray)):
            image = Image.open(io.BytesIO(item))
        elif isinstance(item, str):
            path = local_path(item, image_dir, allow_outside)
            if not path.is_file():
                raise MediaError(
                    f"missing image file {str(path)!r}{resolved_from(path)}"
                    + ("" if image_dir else "; data.image_dir is not set")
                )
            image = Image.open(path)
        else:
            raise MediaError(f"cannot read an image from a {type(item).__name__}; use bytes, a path or a PIL image")
        return image.convert("RGB")
    except MediaError:
        raise
    except Image.DecompressionBombError as e:  # not an OSError: it would escape on_bad_sample=skip and end the run
        raise MediaError(
            f"image too large to decode ({e}); shrink it, or leave the row out with data.on_bad_sample=skip"
        ) from e
    except (
        OSError,
        ValueError,
        SyntaxError,
    ) as e:  # PIL raises all three for broken files
        raise MediaError(f"unreadable image ({type(e).__name__}: {e})") from e


def resize_to_grid(image: Image.Image, sizes: MediaSizes) -> Image.Image:
    """``image`` resized by the family's ``sizes``; MediaError where it cannot be."""
    try:
        return sizes.image(image)
    except ValueError as e:  # Qwen's smart_resize refuses aspect ratios over 200
        raise MediaError(f"image of {image.width}x{image.height} px cannot be used ({e})") from e


@dataclass
class Video:
    """Sampled, resized frames of one video."""

    frames: torch.Tensor
    """(T, C, H, W) float pixel values in 0..255; T even, H and W on the grid."""
    fps: float
    """Rate of the frames as sampled: frame i is at i / fps seconds."""

    @property
    def metadata(self) -> dict[str, Any]:
        """What vLLM's Qwen-VL processors want next to the frames: they are already sampled."""
        n = self.frames.shape[0]
        return {
            "fps": self.fps,
            "frames_indices": list(range(n)),
            "total_num_frames": n,
            "duration": n / self.fps,
            "do_sample_frames": False,
        }

    def for_vllm(self) -> tuple[np.ndarray, dict[str, Any]]:
        """(T, H, W, C) uint8 frames and their metadata, vLLM's video item."""
        frames = self.frames.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()
        return frames, self.metadata


def decode_video_file(
    source: Path | bytes,
    fps: float,
    max_frames: int = MAX_VIDEO_FRAMES,
    fit: Callable[[Image.Image], Image.Image] | None = None,
) -> tuple[list[Image.Image], float]:
    """(frames, rate): a video file (a path, or its bytes) sampled at ``fps``, at least two and at most
    ``max_frames`` frames, as PIL images, each passed through ``fit`` (a resize) as it is decoded.

    Only the sampled frames become images: the frames are counted from the packets first (no decoding),
    the picks chosen, and the decode keeps just those, so a long video costs the memory of the frames
    it contributes, not of all its frames. The rate is ``fps``, or lower when ``max_frames`` cut the
    count: frame i is at i / rate seconds.
    """
    import av

    name = "video bytes" if isinstance(source, (bytes, bytearray)) else f"video {str(source)!r}"
    if not isinstance(source, (bytes, bytearray)) and not source.is_file():
        raise MediaError(f"missing video file {str(source)!r}{resolved_from(source)}")

    def opened():
        return av.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else str(source))

    def keep(frame) -> Image.Image:
        image = frame.to_image()
        return fit(image) if fit is not None else image

    try:
        with opened() as container:
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or fps)
            total = sum(1 for packet in container.demux(stream) if packet.size)
        if not total:
            raise MediaError(f"{name} has no frames")
        at_fps = max(2, round(total / rate * fps))
        wanted = min(at_fps, total, max(2, max_frames))
        picks = np.linspace(0, total - 1, wanted).round().astype(int).tolist()
        frames: list[Image.Image] = []
        with opened() as container:
            stream = container.streams.video[0]
            index, last = 0, None
            for frame in container.decode(stream):
                last = frame
                while len(frames) < len(picks) and picks[len(frames)] == index:
                    frames.append(keep(frame))
                if len(frames) == len(picks):
                    break
                index += 1
        if last is None:
            raise MediaError(f"{name} has no frames")
        while len(frames) < len(picks):  # fewer frames decoded than packets counted: the last one stands in
            frames.append(keep(last))
    except MediaError:
        raise
    except (av.FFmpegError, IndexError, ValueError, OSError) as e:
        raise MediaError(f"unreadable {name} ({type(e).__name__}: {e})") from e
    return frames, fps * wanted / min(at_fps, total)


def load_video(
    item: Any,
    image_dir: Path | None,
    fps: float,
    sizes: MediaSizes,
    allow_outside: bool = False,
    max_frames: int = MAX_VIDEO_FRAMES,
) -> Video:
    """A ``Video`` from a video file (a path, or a ``{"bytes", "path"}`` dict, bytes first), or from a list of
    frames (each anything ``open_image`` reads).

    At most ``max_frames`` frames are kept (a longer frame list is sampled evenly, and its rate lowered to
    match), and each frame is resized as it is read (``sizes.frame``), then the frames as a video (``sizes.video``).
    """
    fit = sizes.frame

    if isinstance(item, dict) and ("bytes" in item or "path" in item):
        item = item.get("bytes") or item.get("path")
    try:
        if isinstance(item, (bytes, bytearray)):
            frames, rate = decode_video_file(bytes(item), fps, max_frames, fit)
        elif isinstance(item, str):
            frames, rate = decode_video_file(local_path(item, image_dir, allow_outside), fps, max_frames, fit)
        elif isinstance(item, (list, tuple)) and item:
            rate = fps
            if len(item) > max_frames:
                picks = np.linspace(0, len(item) - 1, max(2, max_frames)).round().astype(int).tolist()
                rate = fps * len(picks) / len(item)
                item = [item[i] for i in picks]
            frames = [fit(open_image(frame, image_dir, allow_outside)) for frame in item]
        else:
            raise MediaError(
                f"cannot read a video from {type(item).__name__} {item!r:.40}; use a file path or a list of frames"
            )
    except ValueError as e:  # the resize refuses aspect ratios over 200
        if isinstance(e, MediaError):
            raise
        raise MediaError(f"video frames cannot be used ({type(e).__name__}: {e})") from e
    if len(frames) == 1:
        frames = frames * 2  # the temporal patch spans two frames
    try:
        video = sizes.video(frames, rate)
    except (ValueError, RuntimeError) as e:
        raise MediaError(f"video frames cannot be used ({type(e).__name__}: {e})") from e
    return Video(frames=video, fps=rate)
