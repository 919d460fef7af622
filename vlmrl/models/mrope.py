"""Qwen-VL's 3-D rotary positions (mrope) of one prompt, computed from its tokens and media grids.

The scheme is shared by the Qwen-VL families; each family's adapter
(``qwen2_vl``, ``qwen3_vl``) says how it treats videos.

Text tokens take consecutive positions, equal on the three axes. A run of
image or video tokens takes (temporal, height, width) grid positions offset by
the position where it starts, and the text after it resumes one past the
largest position used so far. For Qwen2.5-VL a video's temporal index is
scaled by ``tokens_per_second * second_per_grid_ts``; Qwen3-VL writes each
temporal patch of a video as its own run between timestamp texts.

Deliberate deviation: this follows the original Qwen implementation, which is
what vLLM computes. transformers 5.19's ``get_rope_index`` resumes text after a
video at the start plus the video's spatial extent, ignoring its temporal
extent, so for a video with more temporal patches than rows or columns its
positions disagree with vLLM's (the log-probs differed by ~0.1 on the tiny
Qwen2-VL). For images the two agree, which the tests check.

The same function checks that each run of media tokens is as long as its
grid says: a mismatch here is the "Image features and image tokens do not
match" error the model would otherwise raise mid-step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class MRope:
    """What a model family's positions depend on, read from its config."""

    image_token_id: int
    video_token_id: int
    merge_size: int
    tokens_per_second: float | None
    """Qwen2.5-VL: temporal positions per second of video; None elsewhere (no scaling)."""
    video_frames_apart: bool
    """Qwen3-VL: each temporal patch of a video is a separate run of tokens."""

    @classmethod
    def from_config(cls, config, *, scale_video_time: bool, video_frames_apart: bool) -> MRope:
        """The scheme for ``config`` (a transformers config), with the video treatment the family decides."""
        vision = config.vision_config
        return cls(
            image_token_id=config.image_token_id,
            video_token_id=config.video_token_id,
            merge_size=vision.spatial_merge_size,
            tokens_per_second=getattr(vision, "tokens_per_second", None) if scale_video_time else None,
            video_frames_apart=video_frames_apart,
        )

    def _runs(self, mm_inputs: dict[str, torch.Tensor]) -> dict[int, list[tuple[tuple[int, int, int], float]]]:
        """Per token id, the expected runs in order: ((t, h, w) in merged units, temporal scale)."""
        m = self.merge_size
        image_runs = [((int(t), int(h) // m, int(w) // m), 1.0) for t, h, w in mm_inputs.get("image_grid_thw", [])]
        video_runs = []
        seconds = mm_inputs.get("second_per_grid_ts")
        for i, (t, h, w) in enumerate(mm_inputs.get("video_grid_thw", [])):
            scale = 1.0
            if self.tokens_per_second is not None and seconds is not None:
                scale = float(seconds[i]) * self.tokens_per_second
            if self.video_frames_apart:
                video_runs += [((1, int(h) // m, int(w) // m), 1.0)] * int(t)
            else:
                video_runs.append(((int(t), int(h) // m, int(w) // m), scale))
        return {self.image_token_id: image_runs, self.video_token_id: video_runs}

    def positions(self, input_ids: list[int], mm_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(3, len(input_ids)) positions of an unpadded prompt; raises ValueError if tokens and grids disagree."""
        expected = self._runs(mm_inputs)
        used = {token: 0 for token in expected}
        out = torch.empty((3, len(input_ids)), dtype=torch.long)
        next_pos, i = 0, 0
        while i < len(input_ids):
            token = input_ids[i]
            j = i + 1
            is_media = token in expected
            while j < len(input_ids) and (input_ids[j] == token if is_media else input_ids[j] not in expected):
                j += 1
            if not is_media:
                out[:, i:j] = torch.arange(next_pos, next_pos + j - i)
                next_pos += j - i
            else:
                kind = "image" if token == self.image_token_id else "video"
                runs = expected[token]
                if used[token] >= len(runs):
                    raise ValueError(f"the prompt has more {kind} token runs than the {len(runs)} its {kind}s give")
                (t, h, w), scale = runs[used[token]]
                used[token] += 1
                if t * h * w != j - i:
                    raise ValueError(f"a run of {j - i} {kind} tokens where the {kind}'s grid gives {t * h * w}")
                block, extent = _grid_block(t, h, w, scale)
                out[:, i:j] = block + next_pos
                next_pos += extent
            i = j
        for token, runs in expected.items():
            if used[token] != len(runs):
                kind = "image" if token == self.image_token_id else "video"
                raise ValueError(f"{len(runs)} {kind} grids but {used[token]} runs of {kind} tokens in the prompt")
        return out


@lru_cache(maxsize=256)
def _grid_block(t: int, h: int, w: int, scale: float) -> tuple[torch.Tensor, int]:
    """The (3, t*h*w) positions of a media run starting at 0, and how far the next text starts after it.

    Cached: a rollout's images mostly share a few grids, and building the block is most of the cost of an
    agent trajectory's positions (each observation adds an image). Callers add their offset into a new tensor,
    so the cached block is never written.
    """
    grid_t, grid_h, grid_w = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    block = torch.stack([(grid_t * scale).long(), grid_h, grid_w]).reshape(3, -1)
    return block, int(block.max()) + 1
