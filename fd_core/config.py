"""Model, parallel and graph configuration: plain data, no paddle import."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from fd_core.errors import ConfigError, setting
from fd_core.quantization import SCHEMES, head_bits

# Floating-point dtypes a model may compute in (the platform says which of them it can).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "float64")
# The share of a device's free memory a run plans weights and KV cache in by default (--memory-fraction):
# activations, the allocator and the rest of the process need the remainder.
DEFAULT_MEMORY_FRACTION = 0.9
# How long compiling one request's grammar for the model's tokens (with its first mask) may take, in seconds of wall
# time (fd serve --grammar-timeout, LLM(grammar_timeout=...)); llguidance's fuel limits bound its work too.
DEFAULT_GRAMMAR_TIMEOUT_S = 1.0
# Rope types the decoders implement; "mrope" is the multimodal name older Qwen-VL configs use.
_ROPE_TYPES = ("default", "mrope")
# Settings that live at the top level of a multimodal config.json even when a `text_config` is nested.
_TOP_LEVEL = ("tie_word_embeddings",)
# Sizes with no sensible default: a config.json without them is refused rather than filled in.
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# Settings the shared decoder reads beyond the sizes: each comes from config.json or the architecture's
# declared `config_defaults`, never from a value of fd's own (a silent fill gives plausible wrong tokens).
# `use_bias` sets both biases; a `rope_parameters` / `rope_scaling` object may carry rope_theta.
DECODER_KEYS = (
    "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act",
)
# Of those, the switches of optional features the shared layers have (projection biases): absent means off.
FEATURE_KEYS = ("attention_bias", "mlp_bias")
# Layer types the decoders implement (a config's `layer_types`).
_LAYER_TYPES = ("full_attention",)
_POSITIVE_INTS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "max_position_embeddings",
)


@dataclass(frozen=True)
class ModelConfig:
    """The decoder settings the core and the shared layers use; everything else of `config.json` stays in `extra`.

    Built from a Hugging Face `config.json` by `from_dict`: a nested `text_config` (the VL models)
    is read for the decoder, `rope_theta` comes from the top level or from `rope_parameters` /
    `rope_scaling`, and `use_bias` (ERNIE) / `attention_bias` (Qwen) set the projection biases.
    `dtype` is the compute dtype the runner chose, not the checkpoint's storage dtype.
    """

    architecture: str
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    dtype: str = "float32"
    # Weight-only quantization of the decoder's linear layers at load (fd_core.quantization.SCHEMES; contract 1.1):
    # set by the runner from --quantization, never read from config.json.
    quantization: str | None = None
    # Its group size (contract 1.6): inputs a scale covers (fd_core.quantization.group_for), 0 per output channel; set
    # by the runner from --quantization-group or the scheme's default.
    quantization_group: int = 0
    # Whether --quantization leaves the embedding table and the LM head in the compute dtype (--float-embeddings);
    # else the head is quantized with the linear layers and a tied embedding looks tokens up in its quantized form.
    float_embeddings: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(
        cls,
        architecture: str,
        data: Mapping[str, Any],
        defaults: Mapping[str, Any] | None = None,
        source: str = "config",
    ) -> "ModelConfig":
        """Build from a Hugging Face style `config.json` mapping, then check it; unknown keys go to `extra`."""
        text = data.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise ConfigError(f"{source}: text_config must be a JSON object, got {type(text).__name__}")
        settings: dict[str, Any] = {**(defaults or {}), **(text if text is not None else data)}
        if text is not None:
            settings.update({k: data[k] for k in _TOP_LEVEL if k in data})
        absent = [k for k in _REQUIRED if k not in settings]
        if absent:
            where = "text_config" if text is not None else "config.json"
            raise ConfigError(f"{source}: {where} does not set {', '.join(absent)}; a model config must give its sizes")
        # A layer's optional feature (a bias) the config and the package do not mention is one its architecture does not
        # have: off. Values (a norm's epsilon, rope's theta, the context) are never filled in.
        missing = [k for k in DECODER_KEYS
                   if k not in settings and k not in FEATURE_KEYS and not _given_otherwise(k, settings)]
        if missing:
            where = "text_config" if text is not None else "config.json"
            raise ConfigError(
                f"{source}: {where} does not set {', '.join(missing)} and architecture {architecture!r} declares no "
                f"default for {'it' if len(missing) == 1 else 'them'}; add {'it' if len(missing) == 1 else 'them'} to "
                f"config.json (or to the architecture's config_defaults, as the reference config class defines them)"
            )
        _refuse_unimplemented(settings, source)
        known = {f.name for f in fields(cls)} - {"architecture", "extra", "dtype", "quantization", "quantization_group",
                                                  "float_embeddings"}
        kwargs = {k: v for k, v in settings.items() if k in known}
        kwargs["rope_theta"] = _rope_theta(settings, source)
        if "use_bias" in settings:
            kwargs.setdefault("attention_bias", settings["use_bias"])
            kwargs.setdefault("mlp_bias", settings["use_bias"])
        # An explicit null means what it means to transformers: as many kv heads as heads (head_dim: hidden / heads).
        if settings.get("num_key_value_heads") is None and "num_attention_heads" in settings:
            kwargs["num_key_value_heads"] = settings["num_attention_heads"]
        extra = {k: v for k, v in settings.items() if k not in known and k != "architecture"}
        if text is not None:
            extra.update({k: v for k, v in data.items() if k != "text_config"})
        try:
            config = cls(architecture=architecture, extra=extra, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"{source}: malformed config for {architecture!r}: {exc}") from None
        config.check(source)
        return config

    def check(self, source: str = "config") -> None:
        """Raise ConfigError naming the first setting that is of the wrong type, out of range or inconsistent."""
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{source}: {name} must be a positive integer, got {value!r}")
        if self.head_dim is not None and (
            isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 1
        ):
            raise ConfigError(f"{source}: head_dim must be a positive integer, got {self.head_dim!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{source}: {name} must be a positive number, got {value!r}")
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{source}: {name} must be true or false, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{source}: num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}; fix config.json"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"{source}: hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                f"{self.num_attention_heads} and no head_dim is given; set head_dim or fix the sizes"
            )
        if self.hidden_act != "silu":
            raise ConfigError(
                f"{source}: hidden_act {self.hidden_act!r} is not supported; the decoders implement silu (SwiGLU)"
            )
        if self.dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not a compute dtype; choose one of {', '.join(COMPUTE_DTYPES)}")
        if self.quantization is not None and self.quantization not in SCHEMES:
            raise ConfigError(
                f"{setting('quantization', self.quantization)} is not a quantization fd has; choose one of "
                f"{', '.join(SCHEMES)} (or none)"
            )
        if isinstance(self.quantization_group, bool) or not isinstance(self.quantization_group, int) \
                or self.quantization_group < 0:
            raise ConfigError(
                f"{setting('quantization-group', self.quantization_group)} is not a group size; give the inputs a "
                f"scale covers (a positive integer, 32 or 128 say) or 0 for one scale per output channel"
            )

    def estimated_bytes(self, batch_size: int, max_len: int) -> int:
        """Weights (the decoder's dense parts; experts and vision towers not counted) and the KV cache, all ranks
        together."""
        return self.weight_bytes_per_rank(1) + self.cache_bytes_per_token(1) * batch_size * max_len

    @property
    def dtype_width(self) -> int:
        """Bytes of one element of the compute dtype."""
        return {"float64": 8, "float32": 4}.get(self.dtype, 2)

    def weight_bytes_per_rank(self, tp: int) -> int:
        """One rank's share of the weights at `tp` (an estimate from the sizes: the decoder's dense parts, split as
        the tensor-parallel layers split them, norms replicated; experts and vision towers not counted)."""
        head_dim = self.resolved_head_dim
        attention = self.hidden_size * head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        linear = self.num_hidden_layers * (attention + 3 * self.hidden_size * self.intermediate_size)
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        replicated = (2 * self.num_hidden_layers + 1) * self.hidden_size  # each layer's two norms and the final one
        if self.quantization is None:
            return (-(-(linear + embeddings) // tp) + replicated) * self.dtype_width
        # Quantized linear weights: a byte a value (half that at 4 bits) and a float32 scale per group of inputs (per
        # output row: about one per hidden_size values); embeddings and norms stay in the compute dtype.
        table = self.vocab_size * self.hidden_size
        head = 0
        if not self.float_embeddings:
            # The LM head quantized (to HEAD_BITS at least); a tied table's quantized form is held once more for the
            # embedding's lookup (the head's product may be in the platform's own layout); an untied embedding stays.
            head = table * (2 if self.tie_word_embeddings else 1)
            embeddings -= table
        group = self.quantization_group or self.hidden_size

        def stored(values: int, bits: int) -> int:
            return values * bits // 8 + 4 * values // group

        quantized = stored(-(-linear // tp), SCHEMES[self.quantization]) + stored(-(-head // tp),
                                                                                  head_bits(self.quantization))
        return quantized + (-(-embeddings // tp) + replicated) * self.dtype_width

    def cache_bytes_per_token(self, tp: int) -> int:
        """KV-cache bytes one rank holds for one token of one sequence at `tp` (keys and values of every layer)."""
        kv_heads = max(1, self.num_key_value_heads // tp)
        return 2 * self.num_hidden_layers * kv_heads * self.resolved_head_dim * self.dtype_width

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("extra", "architecture")}
        data.update(self.extra)
        data["architecture"] = self.architecture
        return data

    def with_overrides(self, **changes: Any) -> "ModelConfig":
        return replace(self, **changes)

    def check_tensor_parallel(self, tp: int, more: Mapping[str, int] | None = None) -> None:
        """Raise ConfigError unless every sharded dimension (the decoder's, and `more` an architecture adds) divides by
        `tp`."""
        if tp < 1:
            raise ConfigError(f"{setting('tp')} must be a positive integer, got {tp}")
        dims = {
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            **(more or {}),
        }
        bad = [f"{name}={value}" for name, value in dims.items() if value % tp]
        if bad:
            raise ConfigError(
                f"tp={tp} does not divide {', '.join(bad)} of {self.architecture}; "
                f"choose a tp that divides each of them"
            )


def _given_otherwise(key: str, settings: Mapping[str, Any]) -> bool:
    """Whether `key` is set under another published name: `use_bias` (ERNIE), rope_theta inside the rope object."""
    if key in ("attention_bias", "mlp_bias"):
        return "use_bias" in settings
    if key == "rope_theta":
        return any(
            isinstance(settings.get(k), dict) and "rope_theta" in settings[k]
            for k in ("rope_parameters", "rope_scaling")
        )
    return False


def _refuse_unimplemented(settings: Mapping[str, Any], source: str) -> None:
    """A config feature the decoders do not implement is refused by name: running it as full attention gives wrong
    tokens."""
    window = settings.get("sliding_window")
    used = settings.get("use_sliding_window", window is not None)
    if window is not None and used:
        raise ConfigError(
            f"{source}: sliding_window={window!r} asks for sliding-window attention, which fd's decoders do not "
            f"implement (they attend over the whole context); use a checkpoint without it"
        )
    types = settings.get("layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise ConfigError(f"{source}: layer_types must be a list, got {type(types).__name__}")
        unknown = sorted({str(t) for t in types} - set(_LAYER_TYPES))
        if unknown:
            raise ConfigError(
                f"{source}: layer_types has {', '.join(map(repr, unknown))}, which fd's decoders do not implement "
                f"(only {', '.join(_LAYER_TYPES)}); use a checkpoint without them"
            )


def _rope_theta(settings: Mapping[str, Any], source: str) -> Any:
    """rope_theta from the top level or from `rope_parameters` / `rope_scaling` (current transformers writes the
    former).

    from_dict has made sure one of them sets it (or the architecture's defaults do)."""
    theta = settings.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        params = settings.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ConfigError(f"{source}: {key} must be a JSON object, got {type(params).__name__}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ConfigError(
                f"{source}: {key} asks for rope type {rope_type!r}, which is not supported (only default rope); "
                f"remove the scaling or use a checkpoint without it"
            )
        theta = params.get("rope_theta", theta)
    return theta


def read_config_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or a one-line ConfigError saying what is wrong with the file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; a checkpoint directory needs a config.json") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{path}: cannot be read ({exc.__class__.__name__}: {exc}); check the file and its permissions"
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); fix or regenerate config.json") from None
    except RecursionError:
        raise ConfigError(
            f"{path}: JSON nested too deeply to be a model config; fix or regenerate config.json"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of model settings")
    return data


@dataclass(frozen=True)
class ParallelConfig:
    """Where this process sits in the tensor-parallel job."""

    tp_size: int = 1
    tp_rank: int = 0
    # The process group handed to all-reduce; None means the default (world) group.
    group: Any = None

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"tensor-parallel size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} is outside 0..{self.tp_size - 1}")
