"""Seeded random weights and safetensors checkpoints, sharded per tensor-parallel rank.

A checkpoint is checked whole from its metadata (the files an index names, every tensor's name,
shape, dtype and extent in its file) before any data is read; then each tensor is read on demand,
only this rank's slice of it, and converted to the compute dtype. So a bad checkpoint never
leaves a model half loaded, and loading holds one tensor at a time beside the parameters.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Iterator, Mapping

if TYPE_CHECKING:
    import numpy as np

from fd_core.errors import CheckpointError, NumericsError
from fd_core.models import WeightSpec
from fd_core.runtime import progress
from fd_core.runtime.files import regular_file

# Files that unpickle when loaded: refused, since loading them can run arbitrary code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".pdparams")  # compared case-blind
INDEX_NAME = "model.safetensors.index.json"
# Largest piece of one tensor a loader reads at once (in the compute dtype): see CheckpointShards.chunks. A piece
# is staged about four times over while it is read, converted and copied into its parameter (the read bytes,
# the float32 array, paddle's copy, the slice assignment's copy), beside the whole model: 8 MiB keeps that near
# 2% of the ERNIE-4.5-0.3B weights; the load took as long as with 32 MiB pieces (within this host's noise).
CHUNK_BYTES = 8 << 20
# safetensors dtype codes of the float types a checkpoint may store weights in; each converts to the compute dtype.
FLOAT_CODES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


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
    """The full float32 tensor `name` for `seed`; the same on every rank, so tp shards agree with tp=1."""
    import numpy as np

    if spec.init == "ones":
        return np.ones(spec.shape, dtype=np.float32)
    if spec.init == "zeros":
        return np.zeros(spec.shape, dtype=np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(spec.shape, dtype=np.float32) * (spec.std if std is None else std)).astype(np.float32)


class RandomShards(Mapping[str, Any]):
    """Seeded random float32 weights, each tensor this rank's shard, drawn when it is read (one full tensor at a
    time)."""

    def __init__(
        self, specs: Mapping[str, WeightSpec], seed: int, tp_rank: int = 0, tp_size: int = 1, std: float | None = None
    ) -> None:
        self.specs, self.seed, self.tp_rank, self.tp_size, self.std = dict(specs), seed, tp_rank, tp_size, std

    def __getitem__(self, name: str) -> np.ndarray:
        import numpy as np

        spec = self.specs[name]
        return np.ascontiguousarray(
            shard(random_full_tensor(name, spec, self.seed, self.std), spec, self.tp_rank, self.tp_size)
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


def random_state_dict(
    specs: Mapping[str, WeightSpec], seed: int, tp_rank: int = 0, tp_size: int = 1, std: float | None = None
) -> RandomShards:
    """Seeded random float32 weights, each tensor sliced to this rank's shard and drawn on access; `std` overrides the
    specs'."""
    return RandomShards(specs, seed, tp_rank, tp_size, std)


def _regular_file(path: Path, what: str) -> None:
    """Refuse a FIFO, device or directory where a file is expected: reading one can block forever."""
    regular_file(path, f"checkpoint {path}: {what}")


def _read_index(index: Path) -> dict[str, str]:
    """The weight map of a shard index (tensor name -> file name), checked for form."""
    _regular_file(index, "the shard index")
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(
            f"checkpoint {index}: not a readable shard index ({exc}); re-save or re-download it"
        ) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            f"checkpoint {index}: has no \"weight_map\" of tensor names to file names; re-save or re-download it"
        )
    for file_name in set(weight_map.values()):
        if Path(file_name).name != file_name:
            raise CheckpointError(
                f"checkpoint {index}: names {file_name!r}, which is not a file in the checkpoint directory"
            )
    return weight_map


def check_checkpoint_dir(directory: Path, weights: bool = True) -> list[Path]:
    """The safetensors files of a checkpoint directory (those its index names, if it has one); raises if unusable.
    Without `weights` (a plan that reads none: fd explain), a directory holding config.json alone is usable.

    Needs no paddle, so `fd run` calls it before any rank starts.
    """
    if not directory.is_dir():
        raise CheckpointError(
            f"checkpoint {directory}: not a directory; pass a folder with config.json and *.safetensors"
        )
    if not (directory / "config.json").exists():
        raise CheckpointError(
            f"checkpoint {directory}: config.json is missing; add the model's config.json beside the weights"
        )
    _regular_file(directory / "config.json", "config.json")
    try:
        entries = sorted(directory.iterdir())
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint {directory}: cannot be listed ({exc.strerror}); check its permissions"
        ) from None
    pickles = [p for p in entries if p.suffix.lower() in PICKLE_SUFFIXES]
    if pickles:
        raise CheckpointError(
            f"checkpoint {pickles[0]}: pickle-based weight files are refused (loading them can run code); "
            f"convert it to safetensors"
        )
    index = directory / INDEX_NAME
    if index.exists():
        named = sorted(set(_read_index(index).values()))
        missing = [name for name in named if not (directory / name).exists()]
        if missing:
            raise CheckpointError(
                f"checkpoint {index}: names {missing[0]}, which is missing"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; re-download the checkpoint"
            )
        files = [directory / name for name in named]
    else:
        files = [p for p in entries if p.name.endswith(".safetensors")]
    if not files and weights:
        raise CheckpointError(f"checkpoint {directory}: no *.safetensors files found")
    for path in files:
        _regular_file(path, "weight file")
    return files


def _mismatch(first: str, names: list[str]) -> str:
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"{first}{more}; the checkpoint does not match this architecture's config"


def _read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data, header) of a safetensors file; raises ValueError on a header that cannot be real."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > size:
            raise ValueError(f"header length {length} exceeds the file size {size}")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return 8 + length, header


def _truncated_tensor(path: Path) -> tuple[str, int, int] | None:
    """(name, end, data size) of the first tensor cut off by a truncated safetensors file, if that is what is wrong."""
    try:
        start, header = _read_header(path)
        data = path.stat().st_size - start
        ends = sorted((info["data_offsets"][1], name) for name, info in header.items() if name != "__metadata__")
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return None  # not even the header is whole: the generic message has to do
    for end, name in ends:
        if end > data:
            return name, end, data
    return None


def _open(path: Path) -> Any:
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="paddle")
    except (SafetensorError, OSError, MemoryError) as exc:
        cut = _truncated_tensor(path)
        if cut is not None:
            raise CheckpointError(
                f"checkpoint {path}: truncated: tensor {cut[0]!r} ends at byte {cut[1]} of the data, "
                f"but the file holds {cut[2]}; re-save or re-download it"
            ) from None
        reason = "its header is too large to be real" if isinstance(exc, MemoryError) else str(exc)
        raise CheckpointError(
            f"checkpoint {path}: unreadable safetensors file ({reason}); re-save or re-download it"
        ) from None


class CheckpointShards(Mapping[str, Any]):
    """This rank's slice of every tensor in `specs`, checked on construction and read on access.

    A value is a paddle tensor in its spec's dtype, converted from whatever float type the file
    stores (bfloat16, float16, float32, float64). Tensors named in `ignore` may be present and
    are skipped (a tied `lm_head.weight`, say); any other tensor the specs do not name is an error.
    """

    def __init__(
        self, directory: str | Path, specs: Mapping[str, WeightSpec], tp_rank: int = 0, tp_size: int = 1,
        ignore: Collection[str] = (), check_finite: bool = False,
    ) -> None:
        self.directory = Path(directory)
        self.check_finite = check_finite
        self.specs = dict(specs)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        files = check_checkpoint_dir(self.directory)
        index = self.directory / INDEX_NAME
        expected = _read_index(index) if index.exists() else None
        self._handles: dict[Path, Any] = {}
        self._layouts: dict[Path, tuple[int, dict[str, Any]]] = {}
        self._where: dict[str, Path] = {}
        for path in files:
            handle = self._handles[path] = _open(path)
            for name in handle.keys():
                if name in self._where:
                    raise CheckpointError(
                        f"checkpoint {path}: tensor {name!r} is also in {self._where[name].name}; keep one copy"
                    )
                self._where[name] = path
        if expected is not None:
            for name, file_name in sorted(expected.items()):
                if name not in self._where or self._where[name].name != file_name:
                    raise CheckpointError(
                        f"checkpoint {index}: says {name!r} is in {file_name}, which does not hold it; "
                        f"re-download the checkpoint"
                    )
        self._check(ignore)

    def _check(self, ignore: Collection[str]) -> None:
        missing = sorted(set(self.specs) - set(self._where))
        if missing:
            raise CheckpointError(_mismatch(f"checkpoint {self.directory}: tensor {missing[0]!r} is missing", missing))
        # Present and deliberately not loaded (a tied head's copy of the embedding): reported by the runner, never
        # silent.
        self.unused = sorted((set(self._where) - set(self.specs)) & set(ignore))
        unexpected = sorted(set(self._where) - set(self.specs) - set(ignore))
        if unexpected:
            raise CheckpointError(
                _mismatch(f"checkpoint {self._where[unexpected[0]]}: unexpected tensor {unexpected[0]!r}", unexpected)
            )
        for name, spec in self.specs.items():
            path = self._where[name]
            piece = self._handles[path].get_slice(name)
            shape = tuple(piece.get_shape())
            if shape != spec.shape:
                raise CheckpointError(
                    f"checkpoint {path}: tensor {name!r} has shape {list(shape)}, expected {list(spec.shape)}"
                )
            code = piece.get_dtype()
            if code not in FLOAT_CODES:
                raise CheckpointError(
                    f"checkpoint {path}: tensor {name!r} has dtype {code}, expected a float type "
                    f"({', '.join(FLOAT_CODES)})"
                )

    def __getitem__(self, name: str) -> Any:
        from safetensors import SafetensorError

        spec = self.specs[name]
        path = self._where[name]
        try:
            tensor = self._handles[path].get_slice(name)[shard_index(spec, self.tp_rank, self.tp_size)]
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(
                f"checkpoint {path}: tensor {name!r} cannot be read ({exc}); the file may be damaged"
            ) from None
        progress.report("loading weights")
        if tensor.dtype != _paddle_dtype(spec.dtype):
            tensor = tensor.astype(spec.dtype)
        if self.check_finite:
            import paddle

            if not bool(paddle.isfinite(tensor).all()):
                raise NumericsError(
                    f"checkpoint {path}: tensor {name!r} holds NaN or Inf; re-save or re-download it "
                    f"(fd run --allow-non-finite loads it anyway, for experiments)"
                )
        return tensor

    def chunks(self, name: str, max_bytes: int | None = None) -> Iterator[tuple[int, Any]]:
        """This rank's slice of `name` in pieces along its first axis: (first row, piece), each read within
        `max_bytes` of storage.

        A loader assigns piece by piece, so reading a large tensor (an embedding) never stages it
        whole. Float32 pieces (a norm's vector too) are read from the file with pread into numpy
        arrays: safetensors maps the whole file, and every page it reads stays in this process's
        resident set until the file is closed (the whole checkpoint's worth, beside the parameters,
        at the peak; even a 2 KB norm vector's read maps 2 MiB of a large folio there).
        """
        import numpy as np

        spec = self.specs[name]
        if spec.dtype != "float32" or not spec.shape:
            yield 0, self[name]
            return
        path = self._where[name]
        if path not in self._layouts:
            self._layouts[path] = _read_header(path)
        data_start, header = self._layouts[path]
        info = header[name]
        stored = _NUMPY_CODES[info["dtype"]]
        index = shard_index(spec, self.tp_rank, self.tp_size)
        row_bytes = math.prod(spec.shape[1:]) * stored[1]
        count = spec.shard_shape(self.tp_size)[0]
        step = max(1, (max_bytes or CHUNK_BYTES) // max(1, row_bytes * 2))
        first = index[0].start or 0
        with open(path, "rb", buffering=0) as f:
            for start in range(0, count, step):
                rows = min(count, start + step) - start
                offset = data_start + info["data_offsets"][0] + (first + start) * row_bytes
                try:
                    raw = os.pread(f.fileno(), rows * row_bytes, offset)
                except OSError as exc:
                    raise CheckpointError(
                        f"checkpoint {path}: tensor {name!r} cannot be read ({exc.strerror}); the file may be damaged"
                    ) from None
                if len(raw) != rows * row_bytes:
                    raise CheckpointError(
                        f"checkpoint {path}: tensor {name!r} cannot be read (short read); the file may be damaged"
                    )
                progress.report("loading weights")
                within = (slice(None), *index[1:])
                piece = _widen(raw, stored[0], (rows, *spec.shape[1:]))[within]
                if self.check_finite and not np.isfinite(piece).all():
                    raise NumericsError(
                        f"checkpoint {path}: tensor {name!r} holds NaN or Inf; re-save or re-download it "
                        f"(fd run --allow-non-finite loads it anyway, for experiments)"
                    )
                yield start, piece

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def close(self) -> None:
        self._handles.clear()


# safetensors dtype code -> (numpy dtype of the stored bits, bytes an element).
_NUMPY_CODES = {"F32": ("float32", 4), "F64": ("float64", 8), "F16": ("float16", 2), "BF16": ("bfloat16", 2)}


def _widen(raw: bytes, stored: str, shape: tuple[int, ...]) -> np.ndarray:
    """Stored bytes as a float32 array of `shape`; bfloat16 is the high half of a float32, so widening is exact."""
    import numpy as np

    if stored == "bfloat16":
        # Shifted straight into the float32 array's bits: no whole-piece uint32 temporaries beside it.
        out = np.empty(shape, np.float32)
        np.left_shift(np.frombuffer(raw, np.uint16).reshape(shape), 16, out=out.view(np.uint32), dtype=np.uint32)
        return out
    return np.frombuffer(raw, stored).astype(np.float32, copy=False).reshape(shape)


def _paddle_dtype(name: str) -> Any:
    import paddle

    return getattr(paddle, name)


def load_checkpoint(
    directory: str | Path, specs: Mapping[str, WeightSpec], tp_rank: int = 0, tp_size: int = 1,
    ignore: Collection[str] = (), check_finite: bool = False,
) -> CheckpointShards:
    """This rank's shards of every tensor in `specs` from a safetensors directory, all checked before any is read.

    With `check_finite`, a tensor holding NaN or Inf raises as it is read (naming it); the run ends there.
    """
    return CheckpointShards(directory, specs, tp_rank, tp_size, ignore, check_finite)


def check_new_directory(directory: Path) -> None:
    """Raise unless `directory` is absent or an empty directory (a checkpoint is never written over anything)."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise CheckpointError(f"{directory}: exists and is not empty; choose a new directory")


# Stored dtype -> safetensors dtype code.
_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _write_safetensors(path: Path, tensors: Mapping[str, Any], dtype: str) -> None:
    """Write `tensors` as one safetensors file stored as `dtype`, converting and writing one tensor at a time.

    The data goes to a side file first (a tensor's shape is known only once it is drawn), then
    behind the header; so a lazy mapping (seeded weights) never holds more than one tensor.
    """
    import numpy as np
    import paddle

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # what transformers looks for
    data = path.with_name(path.name + ".data")
    end = 0
    with open(data, "wb") as out:
        for name in sorted(tensors):
            # A dtype name paddle accepts.
            stored = paddle.to_tensor(np.ascontiguousarray(tensors[name])).astype(dtype)  # type: ignore[arg-type]
            raw = stored.numpy().tobytes()  # bfloat16 comes out as its uint16 bits
            header[name] = {"dtype": _CODES[dtype], "shape": list(stored.shape), "data_offsets": [end, end + len(raw)]}
            out.write(raw)
            end += len(raw)
            del stored, raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as out, open(data, "rb") as src:
        out.write(len(text).to_bytes(8, "little") + text)
        shutil.copyfileobj(src, out, 16 << 20)
    data.unlink()


def save_checkpoint(
    directory: str | Path, config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], dtype: str = "float32",
    files: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """Write config.json, model.safetensors (tensors stored as `dtype`) and other JSON `files` atomically.

    The directory appears whole or not at all.
    """
    directory = Path(directory)
    check_new_directory(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        _write_safetensors(staging / "model.safetensors", tensors, dtype)
        for name, content in {"config.json": config, **(files or {})}.items():
            (staging / name).write_text(json.dumps(dict(content), indent=2, sort_keys=True) + "\n")
        if directory.exists():
            directory.rmdir()
        os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory
