"""fd-backends core: the plugin contract (what a plugin may use: `__all__`), versioned as CONTRACT_VERSION; and,
loaded on first use, the plugin host's Backend and load_backend. No paddle import here."""

from typing import TYPE_CHECKING, Any

from fd_core.capabilities import Capabilities
from fd_core.config import ModelConfig, ParallelConfig
from fd_core.contract import CONTRACT_VERSION
from fd_core.detection import Detection, DeviceMemory
from fd_core.errors import (
    CheckpointError,
    ConfigError,
    FdError,
    PlatformError,
    PluginError,
    RankError,
    RequestRefused,
    SequenceError,
)
from fd_core.graphs import GraphBackend, GraphDecision, GraphVote
from fd_core.kvcache import KVBatch
from fd_core.lifecycle import RankContext
from fd_core.markers import hookimpl
from fd_core.models import Architecture, CausalModel, WeightSpec
from fd_core.transfer import KVTransport, TransferState

if TYPE_CHECKING:
    from fd_core.host.backend import Backend, load_backend


def __getattr__(name: str) -> Any:
    # The Backend pulls in entry-point discovery (importlib.metadata): loaded on first use, so that
    # `import fd_core` stays light for plugin modules.
    if name in ("Backend", "load_backend"):
        from fd_core.host import backend

        return getattr(backend, name)
    raise AttributeError(f"module 'fd_core' has no attribute {name!r}")

__all__ = [
    "CONTRACT_VERSION",
    "Architecture",
    "Backend",
    "Capabilities",
    "CausalModel",
    "CheckpointError",
    "ConfigError",
    "Detection",
    "DeviceMemory",
    "FdError",
    "GraphBackend",
    "GraphDecision",
    "GraphVote",
    "KVBatch",
    "KVTransport",
    "ModelConfig",
    "ParallelConfig",
    "PlatformError",
    "PluginError",
    "RankContext",
    "RankError",
    "RequestRefused",
    "SequenceError",
    "TransferState",
    "WeightSpec",
    "hookimpl",
    "load_backend",
]
