"""What the VL models share around their towers: image placeholders, multimodal rotary positions, splicing.

Images sit in a prompt as runs of placeholder tokens, one token per merged block of patches, one run
per image in order. Positions follow the references' `get_rope_index`: text counts up as usual; an
image's tokens take (t, h, w) = (start, start + row, start + col); text after it resumes at
start + max(rows, cols). Decode continues at cache slot + delta, delta = max position + 1 - S.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import paddle

from fd_core.models import host_tensor
from fd_models.layers.images import placeholder_runs


def mrope_positions(
    ids: np.ndarray, image_token_id: int, grids: Sequence[tuple[int, int, int]], merge: int
) -> tuple[np.ndarray, int]:
    """Rotary positions [3, S] (t, h, w) of one prompt holding one image per grid, in order, and the decode delta."""
    runs = placeholder_runs(ids, image_token_id)
    needed = [(gh // merge) * (gw // merge) for _, gh, gw in grids]
    if [length for _, length in runs] != needed:
        raise ValueError(
            f"the prompt needs {len(needed)} run(s) of image placeholder tokens ({image_token_id}) of "
            f"{', '.join(map(str, needed))} token(s), one per image in order; it has "
            f"{', '.join(str(length) for _, length in runs) or 'none'}"
        )
    positions = np.zeros((3, len(ids)), dtype=np.int64)
    current, cursor = 0, 0
    for (start, length), (_, gh, gw) in zip(runs, grids, strict=True):
        positions[:, cursor:start] = np.arange(current, current + start - cursor)
        current += start - cursor
        rows, cols = gh // merge, gw // merge
        h, w = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        positions[0, start : start + length] = current
        positions[1, start : start + length] = current + h.reshape(-1)
        positions[2, start : start + length] = current + w.reshape(-1)
        current += max(rows, cols)
        cursor = start + length
    positions[:, cursor:] = np.arange(current, current + len(ids) - cursor)
    return positions, int(positions.max()) + 1 - len(ids)


def batch_positions(
    ids: np.ndarray, image_token_id: int, grids: Sequence[tuple[int, int, int]], merge: int
) -> tuple[np.ndarray, int]:
    """mrope_positions for a batch [B, S] whose prompts hold their images at the same places
    (one rotary table serves all)."""
    first, delta = mrope_positions(ids[0], image_token_id, grids, merge)
    for row in ids[1:]:
        if not np.array_equal(mrope_positions(row, image_token_id, grids, merge)[0], first):
            raise ValueError("every prompt of a batch must hold its image placeholders at the same positions")
    return first, delta


def scatter_rows(base: paddle.Tensor, rows: paddle.Tensor, slots: np.ndarray) -> paddle.Tensor:
    """base [B, S, H] with positions `slots` replaced, in order, by rows [B, len(slots), H]
    (or [len(slots), H] for every prompt)."""
    batch, length, hidden = base.shape
    # Gather from [base | rows]: position s takes base s, or row k for the k-th slot.
    index = np.tile(np.arange(length), (batch, 1))
    index[:, slots] = length + np.arange(len(slots))
    extra = rows.astype(base.dtype)
    if len(extra.shape) == 2:
        extra = extra.unsqueeze(0).expand([batch, len(slots), hidden])
    gather = host_tensor(index).unsqueeze(-1).expand([batch, length, hidden])
    return paddle.take_along_axis(paddle.concat([base, extra], axis=1), gather, axis=1)


def batch_pictures(image: Any, batch: int) -> list[list[np.ndarray]]:
    """The pictures of each prompt of a batch, each float32 [C, H, W].

    `image` is one picture [C, H, W]; [1 or B, C, H, W] (one picture per prompt, or one for all);
    or a list of pictures [C, H, W], which every prompt holds in that order.
    """
    if isinstance(image, (list, tuple)):
        pictures = [np.asarray(p.numpy() if isinstance(p, paddle.Tensor) else p, dtype=np.float32) for p in image]
        if not pictures or any(p.ndim != 3 for p in pictures):
            raise ValueError("a list of images must hold arrays [C, H, W]")
        return [pictures] * batch
    pixels = np.asarray(image.numpy() if isinstance(image, paddle.Tensor) else image, dtype=np.float32)
    if pixels.ndim == 3:
        pixels = pixels[None]
    if pixels.ndim != 4 or pixels.shape[0] not in (1, batch):
        raise ValueError(f"image must be [C, H, W] or [1 or {batch}, C, H, W], got {list(pixels.shape)}")
    return [[pixels[min(b, pixels.shape[0] - 1)]] for b in range(batch)]


def encode_batch(
    per_row: list[list[np.ndarray]], encode: Any
) -> tuple[list[tuple[int, int, int]], list[list[paddle.Tensor]]]:
    """Run `encode(picture) -> (grid, [feature tensors])` on each prompt's pictures (a picture shared by prompts once).

    Returns the grids of the first prompt's pictures (every prompt must have the same sizes, so that
    one rotary table serves the batch) and, per prompt, each feature concatenated over its pictures.
    """
    done: dict[int, tuple[tuple[int, int, int], list[paddle.Tensor]]] = {}
    grids: list[tuple[int, int, int]] | None = None
    rows: list[list[paddle.Tensor]] = []
    for pictures in per_row:
        outputs = []
        for picture in pictures:
            if id(picture) not in done:
                done[id(picture)] = encode(picture)
            outputs.append(done[id(picture)])
        row_grids = [grid for grid, _ in outputs]
        if grids is not None and row_grids != grids:
            raise ValueError("every prompt of a batch must hold images of the same sizes")
        grids = row_grids
        rows.append(
            [paddle.concat([features[i] for _, features in outputs], axis=0) for i in range(len(outputs[0][1]))]
        )
    assert grids is not None
    return grids, rows
