"""Weight specs, seeded random weights and safetensors checkpoints, sharded per tensor-parallel rank.

Everything here works on numpy arrays, so a checkpoint is fully read and checked before
any model parameter is touched: a bad file never leaves a model half loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Mapping

if TYPE_CHECKING:
    import numpy as np

from fd_core.errors import CheckpointError

# Files that unpickle when loaded: refused, since loading them can run arbitrary code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".pdparams")
_ST_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "int64": "I64", "int32": "I32"}


@dataclass(frozen=True)
class WeightSpec:
    """One checkpoint tensor: its full (unsharded) shape, the axis split across tp ranks, its init."""

    shape: tuple[int, ...]
    split_axis: int | None = None
    dtype: str = "float32"
    init: Literal["normal", "ones", "zeros"] = "normal"
    std: float = 0.02

    def shard_shape(self, tp_size: int) -> tuple[int, ...]:
        if self.split_axis is None:
            return self.shape
        shape = list(self.shape)
        shape[self.split_axis] //= tp_size
        return tuple(shape)


def shard_index(spec: WeightSpec, tp_rank: int, tp_size: int) -> tuple[slice, ...]:
    """The index of rank `tp_rank`'s slice of a full tensor of `spec`."""
    index = [slice(None)] * len(spec.shape)
    if spec.split_axis is not None and tp_size > 1:
        size = spec.shape[spec.split_axis] // tp_size
        index[spec.split_axis] = slice(tp_rank * size, (tp_rank + 1) * size)
    return tuple(index)


def shard(full: np.ndarray, spec: WeightSpec, tp_rank: int, tp_size: int) -> np.ndarray:
    """The slice of `full` that rank `tp_rank` of `tp_size` holds."""
    return full[shard_index(spec, tp_rank, tp_size)]


def random_full_tensor(name: str, spec: WeightSpec, seed: int, std: float | None = None) -> np.ndarray:
    """The full tensor `name` for `seed`; the same on every rank, so tp shards agree with tp=1."""
    import numpy as np

    if spec.init == "ones":
        return np.ones(spec.shape, dtype=spec.dtype)
    if spec.init == "zeros":
        return np.zeros(spec.shape, dtype=spec.dtype)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(spec.shape) * (spec.std if std is None else std)).astype(spec.dtype)


def random_state_dict(
    specs: Mapping[str, WeightSpec], seed: int, tp_rank: int = 0, tp_size: int = 1, std: float | None = None
) -> dict[str, np.ndarray]:
    """Seeded random weights, each tensor already sliced to this rank's shard; `std` overrides the specs'."""
    import numpy as np

    return {
        name: np.ascontiguousarray(shard(random_full_tensor(name, spec, seed, std), spec, tp_rank, tp_size))
        for name, spec in specs.items()
    }


def check_checkpoint_dir(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory; raises if it is not a usable checkpoint."""
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory}: not a directory; pass a folder with config.json and *.safetensors")
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"checkpoint {directory}: config.json is missing; add the model's config.json beside the weights")
    pickles = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"checkpoint {pickles[0]}: pickle-based weight files are refused (loading them can run code); "
            f"convert it to safetensors"
        )
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {directory}: no *.safetensors files found")
    return files


def _mismatch(first: str, names: list[str]) -> str:
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"{first}{more}; the checkpoint does not match this architecture's config"


def _truncated_tensor(path: Path) -> tuple[str, int, int] | None:
    """(name, end, data size) of the first tensor cut off by a truncated safetensors file, if that is what is wrong."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        data = path.stat().st_size - 8 - length
        ends = sorted((info["data_offsets"][1], name) for name, info in header.items() if name != "__metadata__")
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None  # not even the header is whole: the generic message has to do
    for end, name in ends:
        if end > data:
            return name, end, data
    return None


def load_checkpoint(
    directory: str | Path, specs: Mapping[str, WeightSpec], tp_rank: int = 0, tp_size: int = 1
) -> dict[str, np.ndarray]:
    """Read this rank's shard of every tensor in `specs` from a safetensors directory, checking all first."""
    import numpy as np
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    files = check_checkpoint_dir(directory)
    where: dict[str, Path] = {}
    handles = []
    try:
        for path in files:
            try:
                handle = safe_open(str(path), framework="numpy")
            except (SafetensorError, OSError) as exc:
                cut = _truncated_tensor(path)
                if cut is not None:
                    raise CheckpointError(
                        f"checkpoint {path}: truncated: tensor {cut[0]!r} ends at byte {cut[1]} of the data, "
                        f"but the file holds {cut[2]}; re-save or re-download it"
                    ) from None
                raise CheckpointError(f"checkpoint {path}: unreadable safetensors file ({exc}); re-save or re-download it") from None
            handles.append((path, handle))
            for name in handle.keys():
                if name in where:
                    raise CheckpointError(f"checkpoint {path}: tensor {name!r} is also in {where[name].name}; keep one copy")
                where[name] = path
        missing = sorted(set(specs) - set(where))
        if missing:
            raise CheckpointError(_mismatch(f"checkpoint {directory}: tensor {missing[0]!r} is missing", missing))
        unexpected = sorted(set(where) - set(specs))
        if unexpected:
            raise CheckpointError(_mismatch(f"checkpoint {where[unexpected[0]]}: unexpected tensor {unexpected[0]!r}", unexpected))
        by_path = dict(handles)
        out: dict[str, np.ndarray] = {}
        for name, spec in specs.items():
            path = where[name]
            piece = by_path[path].get_slice(name)
            shape = tuple(piece.get_shape())
            if shape != spec.shape:
                raise CheckpointError(f"checkpoint {path}: tensor {name!r} has shape {list(shape)}, expected {list(spec.shape)}")
            dtype = piece.get_dtype()
            if dtype != _ST_DTYPES.get(spec.dtype, spec.dtype):
                raise CheckpointError(f"checkpoint {path}: tensor {name!r} has dtype {dtype}, expected {_ST_DTYPES.get(spec.dtype)}")
            try:
                array = piece[shard_index(spec, tp_rank, tp_size)]
            except (SafetensorError, OSError, ValueError) as exc:
                raise CheckpointError(f"checkpoint {path}: tensor {name!r} cannot be read ({exc}); the file may be truncated") from None
            out[name] = np.ascontiguousarray(array)
        return out
    finally:
        handles.clear()


def save_checkpoint(
    directory: str | Path, config: dict, tensors: Mapping[str, np.ndarray]
) -> Path:
    """Write config.json and model.safetensors atomically: the directory appears whole or not at all."""
    import numpy as np
    from safetensors.numpy import save_file

    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise CheckpointError(f"{directory}: exists and is not empty; choose a new directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(staging / "model.safetensors"))
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if directory.exists():
            directory.rmdir()
        os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory
