"""The hook contract: one function per hook. Implementations may take fewer arguments than the spec."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from fd_core.markers import hookspec

if TYPE_CHECKING:
    from fd_core.config import ModelConfig, ParallelConfig
    from fd_core.detection import Detection
    from fd_core.graphs import GraphBackend, GraphVote
    from fd_core.lifecycle import RankContext
    from fd_core.models import Architecture

    # register(name, help, run): `fd NAME ARGS...` calls run(ARGS) and exits with what it returns.
    CommandRegistrar = Callable[[str, str, Callable[[list[str]], int]], None]
    # register(op, fn, capturable=True, prepare=None): `fn` serves fd's named op `op` (fd_core.kernels.OPS);
    # `prepare`, for an op with prepared arguments, transforms a weight once when it loads (contract 1.1).
    KernelRegistrar = Callable[..., None]
    from fd_core.transfer import TransportRegistrar


@hookspec
def fd_platform_detect() -> Detection | None:
    """Say whether this platform's hardware is here, how specific the platform is, and what was seen."""


@hookspec(firstresult=True)
def fd_all_reduce(tensor: Any, group: Any) -> Any:
    """Sum `tensor` over the tensor-parallel `group` and return the result; return None to pass."""


@hookspec
def fd_clean_memory_fragments(state_dict: dict[str, Any] | None) -> None:
    """Release cached memory blocks after weights are loaded or dropped; `state_dict` may be None."""


@hookspec
def fd_graph_eligibility(
    model_config: ModelConfig, parallel_config: ParallelConfig, graph_mode: str
) -> GraphVote | None:
    """Vote on capturing `graph_mode` graphs for this model and layout; a veto must carry its reason."""


@hookspec(firstresult=True)
def fd_graph_backend(parallel_config: ParallelConfig) -> GraphBackend | None:
    """Return a new capture / replay / clear object for this device."""


@hookspec(firstresult=True)
def fd_clear_graphs(model: Any) -> bool | None:
    """Drop `model`'s captured graphs and return True; return None when the model is not yours."""


@hookspec
def fd_register_models(register: Callable[[Architecture], None]) -> None:
    """Register this package's architectures by calling `register(Architecture(...))` for each."""


@hookspec
def fd_register_commands(register: CommandRegistrar) -> None:
    """Add `fd` subcommands by calling `register(name, help, run)`; `run(args)` returns the exit code."""


@hookspec
def fd_check_request(
    request: Any, model_config: ModelConfig, parallel_config: ParallelConfig, stream: bool
) -> str | None:
    """Return a reason (str) to refuse this request before any rank works on it, or None to accept it."""


@hookspec
def fd_register_kernels(register: KernelRegistrar) -> None:
    """Provide kernels for fd's named ops by calling `register(op, fn, capturable=True, prepare=None)` for each."""


@hookspec
def fd_rank_start(rank: RankContext) -> None:
    """Prepare this process for `rank` (bind its device, start the vendor runtime) before fd creates a tensor on it."""


@hookspec
def fd_before_step(rank: RankContext, rows: int | None) -> None:
    """Set per-phase state before a prefill (`rows` None) or a decode step of `rows` sequences, on its thread."""


@hookspec
def fd_rank_end(rank: RankContext, reason: str) -> None:
    """Release what fd_rank_start took; `reason` is "normal", "error" or "signal", and fd waits a bounded time."""


@hookspec
def fd_kv_transports(register: TransportRegistrar) -> None:
    """Provide KV transports (contract 1.9) by calling `register(name, factory)`; `factory(listen, rank)` makes one."""
