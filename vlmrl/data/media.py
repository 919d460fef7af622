"""Images and videos of a row: read, resized once to the processor's grid, and described for vLLM.

Both the actor's processor (called with ``do_resize=False``) and vLLM get the
pixels made here, so the two see the same grid and expand a placeholder into
the same number of tokens.

Video files are decoded with PyAV (a dependency of qwen-vl-utils) and sampled
at ``video_fps``; the frames then go through qwen-vl-utils' ``fetch_video``,
which resizes them to the grid and pads the count to an even number. The
qwen-vl-utils readers for files need decord or torchcodec, or torchvision's
``read_video``, which torchvision 0.29 no longer has; decoding here works with
what is installed.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from vlmrl.user_code import resolved_from


class MediaError(ValueError):
    """An image or video that cannot be read or used; the dataset adds the file and row."""


def grid_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) on the processor's grid, within [min_pixels, max_pixels].

    The processor's own smart_resize keeps each side at least one grid cell,
    which for a very wide or tall image can exceed max_pixels; the long side is
    then cut back. The result is a fixed point of smart_resize, so vLLM's
    processor and the actor's see the same grid.
    """
    h, w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    if h * w > max_pixels:
        if h <= w:
            w = max(factor, max_pixels // h // factor * factor)
        else:
            h = max(factor, max_pixels // w // factor * factor)
    return h, w


def open_image(item: Any, image_dir: Path | None) -> Image.Image:
    """An RGB PIL image from a PIL image, bytes, a path, or a ``{"bytes", "path"}`` dict (bytes first)."""
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    try:
        if isinstance(item, Image.Image):
            image = item
        elif isinstance(item, (bytes, bytearray)):
            image = Image.open(io.BytesIO(item))
        elif isinstance(item, str):
            path = Path(item)
            if not path.is_absolute() and image_dir is not None:
                path = image_dir / path
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


def resize_to_grid(image: Image.Image, factor: int, min_pixels: int, max_pixels: int) -> Image.Image:
    try:
        height, width = grid_size(image.height, image.width, factor, min_pixels, max_pixels)
    except ValueError as e:  # smart_resize refuses aspect ratios over 200
        raise MediaError(f"image of {image.width}x{image.height} px cannot be used ({e})") from e
    return image.resize((width, height), Image.Resampling.BICUBIC)


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


def decode_video_file(path: Path, fps: float) -> list[Image.Image]:
    """The frames of a video file sampled at ``fps`` (at least two), as PIL images.

    Only the sampled frames become images: the frames are counted from the packets first (no decoding),
    the picks chosen, and the decode keeps just those, so a long video costs the memory of the frames
    it contributes, not of all its frames.
    """
    import av

    if not path.is_file():
        raise MediaError(f"missing video file {str(path)!r}{resolved_from(path)}")
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or fps)
            total = sum(1 for packet in container.demux(stream) if packet.size)
        if not total:
            raise MediaError(f"video {str(path)!r} has no frames")
        wanted = min(max(2, round(total / rate * fps)), total)
        picks = np.linspace(0, total - 1, wanted).round().astype(int).tolist()
        frames: list[Image.Image] = []
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            index, last = 0, None
            for frame in container.decode(stream):
                last = frame
                while len(frames) < len(picks) and picks[len(frames)] == index:
                    frames.append(frame.to_image())
                if len(frames) == len(picks):
                    break
                index += 1
    except MediaError:
        raise
    except (av.FFmpegError, IndexError, ValueError, OSError) as e:
        raise MediaError(f"unreadable video {str(path)!r} ({type(e).__name__}: {e})") from e
    if last is None:
        raise MediaError(f"video {str(path)!r} has no frames")
    while len(frames) < len(picks):  # fewer frames decoded than packets counted: the last one stands in
        frames.append(last.to_image())
    return frames


def load_video(
    item: Any,
    image_dir: Path | None,
    fps: float,
    patch_size: int,
    min_pixels: int,
    max_pixels: int,
) -> Video:
    """A ``Video`` from a video file path, or from a list of frames (each anything ``open_image`` reads)."""
    from qwen_vl_utils import fetch_video

    if isinstance(item, str):
        path = Path(item)
        if not path.is_absolute() and image_dir is not None:
            path = image_dir / path
        frames = decode_video_file(path, fps)
    elif isinstance(item, (list, tuple)) and item:
        frames = [open_image(frame, image_dir) for frame in item]
    else:
        raise MediaError(
            f"cannot read a video from {type(item).__name__} {item!r:.40}; use a file path or a list of frames"
        )
    if len(frames) == 1:
        frames = frames * 2  # the temporal patch spans two frames
    try:
        video = fetch_video(
            {
                "video": frames,
                "sample_fps": fps,
                "min_pixels": min_pixels,
                "max_pixels": max_pixels,
            },
            image_patch_size=patch_size,
        )
    except (ValueError, RuntimeError) as e:
        raise MediaError(f"video frames cannot be used ({type(e).__name__}: {e})") from e
    return Video(frames=video, fps=fps)
