"""The kernels plugins registered for fd's named ops: each registration checked, the table by op and plugin,
and the resolved op table a Backend holds (an extension's kernel over the platform's over the native one)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from fd_core.contract import CONTRACT_VERSION, deprecated, parse_version
from fd_core.errors import PluginError
from fd_core.host.suggest import edit_distance
from fd_core.kernels import NATIVE, OPS


@dataclass(frozen=True)
class Kernel:
    """A plugin's implementation of one op."""

    op: str
    fn: Callable[..., Any]
    plugin: str
    capturable: bool = True
    # Transforms a weight once, when it loads, into what `fn` receives (fd_core.kernels.Op.prepared); None: as is.
    prepare: Callable[..., Any] | None = None
    # The contract version its plugin was written for (FD_CONTRACT): what the kernel may be given (a quant_matmul
    # kernel of a plugin before 1.6 is given per-channel scales only).
    contract: str = "1.0"


def nearest_op(name: str) -> str:
    """'; did you mean X?' when `name` looks like a misspelling of one of fd's ops (at most two letters changed,
    added, removed or swapped, and at most a quarter of the name), else '': a name merely sharing a part with an op
    (add_rms_norm and rms_norm, fused_rope and rotary_embedding) is another op, not a typo of it."""
    allowed = min(2, len(name) // 4)
    close = sorted((distance, op) for op in OPS if (distance := edit_distance(name, op, swaps=True)) <= allowed)
    return f"; did you mean {close[0][1]!r}?" if close else ""


def _signature_problem(fn: Any, want: tuple[str, ...]) -> str | None:
    """How `fn`'s parameters differ from `want` (taken by those names, in order; more only with defaults), or None.
    A `*args` takes the arguments its named parameters do not: fd calls every op positionally, so a wrapper of
    `(*args, **kwargs)` accepts every call."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: taken on trust, the suite checks its results
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = tuple(p.name for p in positional[: len(want)])
    if any(p.kind == p.VAR_POSITIONAL for p in params) and len(names) < len(want):
        want = want[: len(names)]
    extra = [p for p in positional[len(want):] if p.default is p.empty] + [
        p for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty
    ]
    return ", ".join(p.name for p in params) if names != want or extra else None


def check_kernel(plugin: str, op: str, fn: Any, capturable: Any, prepare: Any = None) -> Kernel:
    """A registration checked: a known op, a callable taking the op's arguments by their names, a bool flag, and a
    preparation function only for an op that has prepared arguments, taking the op's arguments after the first."""
    if not isinstance(op, str) or op not in OPS:
        raise PluginError(
            f"plugin {plugin!r}: fd_register_kernels registered an unknown op {op!r}{nearest_op(str(op))} "
            f"(fd's ops: {', '.join(OPS)}); fix the name in {plugin!r}"
        )
    if not callable(fn):
        raise PluginError(f"plugin {plugin!r}: fd_register_kernels registered {fn!r} for {op!r}, which is not callable")
    if not isinstance(capturable, bool):
        raise PluginError(
            f"plugin {plugin!r}: fd_register_kernels registered {op!r} with capturable={capturable!r}; "
            f"pass True or False"
        )
    want = OPS[op].args
    got = _signature_problem(fn, want)
    if got is not None:
        raise PluginError(
            f"plugin {plugin!r}: its kernel for {op!r} takes ({got}), but {op} is called as {op}({', '.join(want)}); "
            f"give it exactly those arguments (more only with defaults)"
        )
    if prepare is not None:
        if not OPS[op].prepared:
            with_prepare = ", ".join(name for name, o in OPS.items() if o.prepared)
            raise PluginError(
                f"plugin {plugin!r}: fd_register_kernels registered a prepare function for {op!r}, whose arguments "
                f"are never prepared (ops with prepared weights: {with_prepare}); register {op!r} without prepare="
            )
        takes = preparation_args(op)
        if not callable(prepare):
            raise PluginError(
                f"plugin {plugin!r}: fd_register_kernels registered prepare={prepare!r} for {op!r}, which is not "
                f"callable; pass a function taking ({', '.join(takes)})"
            )
        got = _signature_problem(prepare, takes)
        if got is not None:
            which = f"the op's arguments after {want[0]}" if takes == want[1:] else "the op's weights"
            raise PluginError(
                f"plugin {plugin!r}: its prepare function for {op!r} takes ({got}), but it is called as "
                f"prepare({', '.join(takes)}) ({which}); give it exactly those arguments"
            )
    return Kernel(op, fn, plugin, capturable, prepare)


def preparation_args(op: str) -> tuple[str, ...]:
    """What a preparation function for `op` takes: its prepare_args, or every argument after the first."""
    return OPS[op].prepare_args or OPS[op].args[1:]


@dataclass
class KernelTable:
    """Every kernel the active platform and the extension plugins registered, by op."""

    platform: dict[str, Kernel] = field(default_factory=dict)
    extensions: dict[str, Kernel] = field(default_factory=dict)

    def add(self, kernel: Kernel, from_platform: bool) -> None:
        """Record a kernel; a second extension (or the same plugin twice) on one op is an error naming both."""
        table = self.platform if from_platform else self.extensions
        held = table.get(kernel.op)
        if held is not None and held.plugin == kernel.plugin:
            raise PluginError(f"plugin {kernel.plugin!r} registers a kernel for {kernel.op!r} twice; register it once")
        if held is not None:
            raise PluginError(
                f"plugins {held.plugin!r} and {kernel.plugin!r} both register a kernel for {kernel.op!r}; "
                f"uninstall one, or leave it out with FD_PLUGINS"
            )
        table[kernel.op] = kernel

    def remove_plugin(self, plugin: str) -> None:
        for table in (self.platform, self.extensions):
            for op in [op for op, k in table.items() if k.plugin == plugin]:
                del table[op]

    def chosen(self, op: str) -> Kernel | None:
        """The kernel that serves `op`: an extension's over the platform's; None for the native op.

        An extension's rms_norm serves every norm, the post-attention one included: with no add_rms_norm of its own,
        the platform's fused add_rms_norm gives way to the native one (the add, then the rms_norm kernel in use)."""
        if op == "add_rms_norm" and op not in self.extensions and "rms_norm" in self.extensions:
            return None
        return self.extensions.get(op) or self.platform.get(op)

    def by_plugin(self, plugin: str) -> list[str]:
        """The ops `plugin` registered kernels for."""
        return sorted(op for table in (self.platform, self.extensions) for op, k in table.items() if k.plugin == plugin)

    def providers(self) -> dict[str, str]:
        """Each op with the plugin whose kernel serves it ("native" for the native implementation)."""
        return {op: kernel.plugin if (kernel := self.chosen(op)) is not None else NATIVE for op in OPS}

    def uncapturable(self) -> dict[str, str]:
        """The ops a captured decode step traces that a kernel registered with capturable=False serves, with its
        plugin."""
        return {
            op: kernel.plugin
            for op in OPS
            if OPS[op].traced and (kernel := self.chosen(op)) is not None and not kernel.capturable
        }


def _unreadable(layout: str) -> Callable[..., Any]:
    """read_kv_cache where the cache's layout is plugin `layout`'s and that plugin has no kernel for it."""

    def refuse(*args: Any) -> Any:
        raise PluginError(
            f"plugin {layout!r}: its allocate_kv_cache makes a cache layout of its own and it registers no "
            f"read_kv_cache kernel (contract 1.9), so a prompt's keys and values cannot be read out for another "
            f"instance; register read_kv_cache in its fd_register_kernels, or run prefill and decode on one instance"
        )

    return refuse


class Ops:
    """The resolved op table of one Backend: `ops.rms_norm(x, weight, eps)` calls the chosen function directly."""

    matmul: Callable[..., Any]
    rms_norm: Callable[..., Any]
    silu_and_mul: Callable[..., Any]
    rotary_embedding: Callable[..., Any]
    attention: Callable[..., Any]
    sample: Callable[..., Any]
    accept_draft: Callable[..., Any]
    apply_penalties: Callable[..., Any]
    allocate_kv_cache: Callable[..., Any]
    write_kv_cache: Callable[..., Any]
    read_kv_cache: Callable[..., Any]
    paged_attention: Callable[..., Any]
    paged_prefill_attention: Callable[..., Any]
    paged_packed_attention: Callable[..., Any]
    quant_matmul: Callable[..., Any]
    add_rms_norm: Callable[..., Any]
    gelu: Callable[..., Any]
    moe_experts: Callable[..., Any]

    def __init__(self, table: KernelTable, native: Any) -> None:
        self.providers = table.providers()
        # The contract version each op's kernel was written for (this fd's own for a native op).
        self.contracts = {name: (k.contract if (k := table.chosen(name)) is not None else CONTRACT_VERSION)
                          for name in OPS}
        self._kernels: dict[str, Callable[..., Any]] = {}
        self._prepares: dict[str, Callable[..., Any]] = {}
        for name in OPS:
            kernel = table.chosen(name)
            fn = getattr(native, name) if kernel is None else kernel.fn
            self._kernels[name] = fn
            if kernel is not None and kernel.prepare is not None:
                self._prepares[name] = kernel.prepare
                # Called with weights as they loaded (a model that does not prepare them): prepared on every call.
                fn = self._preparing(name, fn)
            setattr(self, name, fn)
        if self.native("add_rms_norm") and not self.native("rms_norm"):
            # No kernel of its own: the add, then the rms_norm kernel in use (a platform or an extension that has an
            # rms_norm kernel keeps serving every norm of the decoder). Exactly the op's semantics, as the native
            # add_rms_norm is the add, then the native rms_norm.
            self.add_rms_norm = _add_then(self.rms_norm)
        layout = self.providers["allocate_kv_cache"]
        if layout != NATIVE and self.providers["paged_packed_attention"] != layout:
            # The cache's layout is a plugin's whose kernels do not include this op (one written before 1.8): each row
            # through the prefill attention in use, which reads that layout (the packed kernel in use reads another).
            self.paged_packed_attention = native.packed_through(self.paged_prefill_attention)
            self.providers["paged_packed_attention"] = self.providers["paged_prefill_attention"]
            self.contracts["paged_packed_attention"] = self.contracts["paged_prefill_attention"]

        if layout != NATIVE and self.providers["read_kv_cache"] != layout:
            # The native op would read another layout than the cache's: nothing reads a handed-over prompt there.
            self.read_kv_cache = _unreadable(layout)

    def written_for(self, name: str, version: str) -> bool:
        """Whether the kernel in use for `name` was written for contract `version` or later (a native op always)."""
        return (parse_version(self.contracts[name]) or (1, 0)) >= (parse_version(version) or (1, 0))

    def quant_group(self, group: int) -> int:
        """The group size the quant_matmul kernel in use is given: `group`, or 0 (per output channel) for a kernel
        written for a contract before 1.6, which knows per-channel scales only (one DeprecationWarning says so)."""
        if group and not self.written_for("quant_matmul", "1.6"):
            deprecated(f"plugin {self.providers['quant_matmul']!r}: a quant_matmul kernel taking per-channel scales "
                       f"only (contract {self.contracts['quant_matmul']})",
                       "scales [N] or [N, groups] (contract 1.6); its weights are quantized per output channel "
                       "meanwhile", "2.0")
            return 0
        return group

    def native(self, name: str) -> bool:
        """Whether `name` runs the native implementation."""
        return self.providers[name] == NATIVE

    def prepares(self, name: str) -> bool:
        """Whether the kernel in use for `name` transforms its weights when they load."""
        return name in self._prepares

    def prepare(self, name: str, *args: Any) -> tuple[Any, ...]:
        """The op's arguments after the first, as the kernel in use receives them: its preparation applied to the
        op's prepared ones (fd_core.kernels.Op.prepared), the rest as given. Call it once per weight load."""
        prepare = self._prepares.get(name)
        if prepare is None:
            return tuple(args)
        given = dict(zip(OPS[name].args[1:], args, strict=True))
        taken = tuple(given[n] for n in preparation_args(name))
        return _placed(name, args, _run_prepare(prepare, name, taken, self.providers[name]), self.providers[name])

    def prepared(self, name: str) -> Callable[..., Any]:
        """The kernel in use for `name`, called with the first argument and what `prepare` returned."""
        return self._kernels[name]

    def _preparing(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` taking weights as they loaded: each call prepares them first."""

        def call(first: Any, *args: Any) -> Any:
            return fn(first, *self.prepare(name, *args))

        call.__name__ = getattr(fn, "__name__", name)
        return call


def _add_then(rms_norm: Callable[..., Any]) -> Callable[..., Any]:
    """add_rms_norm as the add, then `rms_norm`."""

    def add_rms_norm(x: Any, residual: Any, weight: Any, eps: float) -> tuple[Any, Any]:
        summed = x + residual
        return rms_norm(summed, weight, eps), summed

    return add_rms_norm


def _placed(name: str, args: tuple[Any, ...], result: Any, plugin: str) -> tuple[Any, ...]:
    """`args` with the op's prepared arguments replaced by what `plugin`'s preparation function returned."""
    names = OPS[name].args[1:]
    prepared = OPS[name].prepared
    # A tuple holds one value each (one value may come alone, or as a 1-tuple).
    several = isinstance(result, (tuple, list)) and (len(prepared) > 1 or len(result) == 1)
    values = tuple(result) if several else (result,)
    if len(values) != len(prepared):
        raise PluginError(
            f"plugin {plugin!r}: its prepare function for {name!r} returned {len(values)} value(s) for "
            f"{', '.join(prepared)}; return a tuple of one value for each, in that order"
        )
    given = dict(zip(names, args, strict=True))
    given.update(zip(prepared, values, strict=True))
    return tuple(given[n] for n in names)


def _run_prepare(prepare: Callable[..., Any], name: str, args: tuple[Any, ...], plugin: str) -> Any:
    """`prepare(*args)`, an exception from it named for its plugin and op."""
    try:
        return prepare(*args)
    except Exception as exc:  # noqa: BLE001 - the plugin's own error, named for it
        raise PluginError(
            f"plugin {plugin!r}: its prepare function for {name!r} raised {type(exc).__name__}: {exc}; fix the "
            f"plugin, or uninstall it"
        ) from exc

