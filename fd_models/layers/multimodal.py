"""What the VL models share around their towers: image placeholders, multimodal rotary positions, splicing.

One image per prompt: its placeholder tokens form one contiguous run, one token per merged block of
patches. Positions follow the references' `get_rope_index`: text before the image counts up as
usual; the image's tokens take (t, h, w) = (start, start + row, start + col); text after it resumes
at start + max(rows, cols). Decode continues at cache slot + delta, delta = max position + 1 - S.
"""

from __future__ import annotations

import numpy as np
import paddle


def mrope_positions(ids: np.ndarray, image_token_id: int, grid: tuple[int, int, int], merge: int) -> tuple[np.ndarray, int]:
    """Rotary positions [3, S] (t, h, w) of one prompt holding one image, and the decode delta."""
    slots = np.flatnonzero(ids == image_token_id)
    _, gh, gw = grid
    rows, cols = gh // merge, gw // merge
    contiguous = len(slots) < 2 or slots[-1] - slots[0] + 1 == len(slots)
    if len(slots) != rows * cols or not contiguous:
        raise ValueError(
            f"the prompt needs one run of {rows * cols} image placeholder tokens ({image_token_id}) for this "
            f"{gh}x{gw}-patch image; it has {len(slots)}{'' if contiguous else ', not contiguous'}"
        )
    start = int(slots[0])
    positions = np.broadcast_to(np.arange(len(ids)), (3, len(ids))).copy()
    h, w = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    positions[0, start : start + rows * cols] = start
    positions[1, start : start + rows * cols] = start + h.reshape(-1)
    positions[2, start : start + rows * cols] = start + w.reshape(-1)
    after = start + max(rows, cols)
    positions[:, start + rows * cols :] = np.arange(after, after + len(ids) - start - rows * cols)
    return positions, int(positions.max()) + 1 - len(ids)


def batch_positions(ids: np.ndarray, image_token_id: int, grid: tuple[int, int, int], merge: int) -> tuple[np.ndarray, int]:
    """mrope_positions for a batch [B, S] whose prompts hold their image at the same places (one rotary table serves all)."""
    first, delta = mrope_positions(ids[0], image_token_id, grid, merge)
    for row in ids[1:]:
        if not np.array_equal(mrope_positions(row, image_token_id, grid, merge)[0], first):
            raise ValueError("every prompt of a batch must hold its image placeholders at the same positions")
    return first, delta


def scatter_rows(base: paddle.Tensor, rows: paddle.Tensor, slots: np.ndarray) -> paddle.Tensor:
    """base [B, S, H] with positions `slots` replaced, in order, by rows [B, len(slots), H] (or [len(slots), H] for every prompt)."""
    batch, length, hidden = base.shape
    # Gather from [base | rows]: position s takes base s, or row k for the k-th slot.
    index = np.tile(np.arange(length), (batch, 1))
    index[:, slots] = length + np.arange(len(slots))
    extra = rows.astype(base.dtype)
    if len(extra.shape) == 2:
        extra = extra.unsqueeze(0).expand([batch, len(slots), hidden])
    gather = paddle.to_tensor(index).unsqueeze(-1).expand([batch, length, hidden])
    return paddle.take_along_axis(paddle.concat([base, extra], axis=1), gather, axis=1)


def batch_images(image: object, batch: int) -> list[np.ndarray]:
    """image [1 or B, C, H, W] -> B float32 images [C, H, W] (the one image repeated when one serves the batch)."""
    pixels = np.asarray(image.numpy() if isinstance(image, paddle.Tensor) else image, dtype=np.float32)
    if pixels.ndim != 4 or pixels.shape[0] not in (1, batch):
        raise ValueError(f"image must be [1 or {batch}, C, H, W], got {list(pixels.shape)}")
    return [pixels[min(b, pixels.shape[0] - 1)] for b in range(batch)]
