"""fd-backends core: the hook contract, plugin selection and the Backend (no paddle import here)."""

from fd_core.capabilities import Capabilities
from fd_core.config import GraphConfig, ModelConfig, ParallelConfig
from fd_core.detection import Detection
from fd_core.errors import CheckpointError, ConfigError, FdError, PlatformError, PluginError, RankError
from fd_core.markers import hookimpl
from fd_core.graphs import GraphBackend, GraphDecision, GraphVote
from fd_core.models import Architecture, CausalModel
from fd_core.weights import WeightSpec

__all__ = [
    "Architecture",
    "Capabilities",
    "CausalModel",
    "CheckpointError",
    "ConfigError",
    "Detection",
    "FdError",
    "GraphBackend",
    "GraphConfig",
    "GraphDecision",
    "GraphVote",
    "ModelConfig",
    "ParallelConfig",
    "PlatformError",
    "PluginError",
    "RankError",
    "WeightSpec",
    "hookimpl",
]
