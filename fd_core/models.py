"""The architecture registry, the model protocol the runtime drives, and the weight specs a model declares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Protocol, Sequence

from fd_core.errors import ConfigError, FdError, package_failure
from fd_core.graphs import GraphBackend

if TYPE_CHECKING:
    import numpy as np

    from fd_core.config import ModelConfig
    from fd_core.kvcache import KVBatch


def host_tensor(array: Any) -> Any:
    """A copy of a numpy array as a tensor of its dtype on Paddle's current device: what paddle.to_tensor makes of
    it, without its leak. Use it for what a model builds per request (inputs, masks, indices).

    paddle.to_tensor builds its result through the Tensor constructor (paddle.Tensor(value=..., place=..., ...)),
    and Paddle 3.3.1's constructor never releases the list of its keyword names: about 100 bytes lost per tensor,
    for good. With a decode step's five inputs made that way the engine grew about 4.4 MB per 1,000 requests of
    8 tokens, without end. paddle.empty and set_value (a copy into the new tensor) do not call it.
    """
    import numpy as np
    import paddle

    host = np.asarray(array, order="C")  # not np.ascontiguousarray: that makes a 0-d array 1-d
    tensor = paddle.empty(list(host.shape), dtype=host.dtype)
    tensor.set_value(host)
    return tensor


@dataclass(frozen=True)
class WeightSpec:
    """One checkpoint tensor: its full (unsharded) shape, the axis split across tp ranks, its dtype and init."""

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


class CausalModel(Protocol):
    """What an architecture's `build` returns; the runner calls only these."""

    config: "ModelConfig"

    def weight_specs(self) -> "dict[str, WeightSpec]":
        """Every checkpoint tensor with its full shape and tp split axis."""

    def load_weights(self, shards: "Mapping[str, np.ndarray]") -> None:
        """Assign this rank's shards (already checked against weight_specs) to the parameters."""

    def release_weights(self) -> None:
        """Free parameter storage; load_weights must work afterwards."""

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the paged KV cache once: `num_blocks` blocks of `block_size` positions for every layer, through the
        Backend's `allocate_kv_cache` op (the platform's layout; block 0 is the runtime's null block)."""

    def prefill(self, input_ids: Any, image: Any = None, batch: "KVBatch | None" = None) -> Any:
        """Run new tokens [B, S] (and pictures, for VL models) into the cache where `batch` says (row b's first
        batch.lengths[b] ids real, the rest padding; at positions batch.starts[b] onward, after its cached prefix);
        return the logits of each row's last new token [B, vocab] (full vocab). A VL model sets batch.rope_deltas for
        the rows it prefills with pictures. The keys and values go through the `write_kv_cache` op and attention
        through `paged_prefill_attention`."""

    # Optional (contract 1.8): `packs_rows = True` says prefill runs text rows packed end to end (a row costs its own
    # tokens, not the widest row's); the engine then runs a step's decode rows (one token each) in the same prefill call
    # as its prompt chunks, one forward pass for both. A model without it gets them in a decode step of their own.

    # Optional (contract 1.5): `prefill_every(input_ids, batch)` runs new tokens [B, S] (text only) as `prefill` does
    # and returns the logits of every new position [B, S, vocab]; the engine then scores a prompt
    # (SamplingParams.prompt_logprobs) in its prefill chunks. A model without it is scored a token a decode step.

    # Optional (contract 1.9): `read_kv(slots)` returns every layer's keys and values at the cache slots `slots` [T]
    # (the read_kv_cache op), [T, kv_heads, head_dim] each, layer by layer, the key before the value; `write_kv(slots,
    # parts)` writes such a list at slots (write_kv_cache). The engine hands a prompt from a prefill instance to a
    # decode instance with them (disaggregation); a model without them runs prefill and decode on one instance.

    def decode_step(self, token_ids: Any, batch: "KVBatch") -> Any:
        """One token per row [B, 1] at position batch.starts[b] of its sequence; return logits [B, vocab]. Each row
        attends through its own block table only (`paged_attention`), so a padding row (null block) changes no other
        row's result; replay the graph captured for (B, table width) when there is one."""

    def capture(self, graph_backend: GraphBackend, batch_size: int, table_width: int) -> None:
        """Capture the decode step for `batch_size` rows and block tables `table_width` blocks wide through
        `graph_backend`; later steps of that shape replay it."""


@dataclass(frozen=True)
class Architecture:
    """A registered architecture: how to build it, its tiny preset, and its graph-clear hook's owner.

    `preset` is a tiny `config.json` in the published layout (what `fd save-random` writes, with
    `preset_files` beside it);
    `config_defaults` are the published config class's defaults for keys a `config.json` may omit.
    """

    name: str
    build: Callable[["ModelConfig", Any], CausalModel]
    preset: Mapping[str, Any]
    package: str = ""
    graph_capable: bool = True
    multimodal: bool = False
    aliases: tuple[str, ...] = ()
    description: str = ""
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    # Architecture-specific checks of a parsed config (raise ConfigError); must not import paddle.
    check_config: Callable[["ModelConfig", str], None] | None = None
    # Other JSON files of the tiny preset's checkpoint, by file name (a VL model's preprocessor_config.json).
    preset_files: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # A VL architecture's check of a prompt against its pictures' shapes [C, H, W] (raise ConfigError); no paddle.
    check_prompt: Callable[["ModelConfig", Sequence[int], Sequence[tuple[int, int, int]]], None] | None = None
    # A VL architecture's count of placeholder tokens for a picture [C, H, W]: what one placeholder a chat
    # template emits expands to (as the reference processor expands it); no paddle.
    image_tokens: Callable[["ModelConfig", tuple[int, int, int]], int] | None = None
    # Sizes tensor parallel splits beyond the decoder's own (expert widths, say), by name; tp must divide each.
    sharded_sizes: Callable[["ModelConfig"], Mapping[str, int]] | None = None
    # The reference implementation's class in transformers, which `fd check --model` compares greedy tokens with.
    # None: the first alias transformers defines; "": none (the reference check is then "not verified").
    reference: str | None = None
    # A second config the model suite checks besides the preset (odd sizes, the other head tying, biases), as a
    # config.json mapping.
    odd_preset: Mapping[str, Any] | None = None
    # Whether the model quantizes its linear layers under ModelConfig.quantization (contract 1.1): fd's shared layers
    # do, so a package built on them sets True; --quantization is refused for an architecture that does not.
    quantizable: bool = False

    def to_dict(self) -> dict[str, Any]:
        """What `fd plugins --json` lists; `reference` unresolved (the first alias unless set: transformers is not
        imported)."""
        reference = self.reference if self.reference is not None else (self.aliases[0] if self.aliases else None)
        return {"name": self.name, "aliases": list(self.aliases), "package": self.package,
                "graph_capable": self.graph_capable, "multimodal": self.multimodal, "quantizable": self.quantizable,
                "reference": reference or None,
                "description": self.description}

    def preset_config(self) -> "ModelConfig":
        """The tiny preset as a ModelConfig."""
        return self.config_from(self.preset, source=f"preset of {self.name}")

    def config_from(self, data: Mapping[str, Any], source: str = "config") -> "ModelConfig":
        """A `config.json` mapping of this architecture as a checked ModelConfig."""
        from fd_core.config import ModelConfig

        config = ModelConfig.from_dict(self.name, data, self.config_defaults, source=source)
        if self.check_config is not None:
            try:
                self.check_config(config, source)
            except FdError:
                raise
            # The package's own bug: one line naming it, the traceback in a file.
            except Exception as exc:  # noqa: BLE001
                raise package_failure(self.package, "check_config", exc, ConfigError) from None
        return config

    def build_model(self, config: "ModelConfig", ctx: Any) -> CausalModel:
        """`build(config, ctx)`, with an exception of the package's own reported as one line naming it."""
        try:
            return self.build(config, ctx)
        except FdError:
            raise
        except Exception as exc:  # noqa: BLE001 - as in config_from
            raise package_failure(self.package, "build", exc) from None


