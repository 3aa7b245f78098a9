"""What the engine hands the sampling ops is what their semantics promise a kernel (fd_core.kernels.OPS), dtype for
dtype: the suite checks a vendor's kernel on those dtypes, so the engine giving others would run the kernel on inputs
it was never checked with."""

from __future__ import annotations

from typing import Any

from fd_core import native_ops
from fd_core.host.backend import Backend
from fd_core.host.kernel_table import KernelTable, check_kernel
from fd_core.host.loading import load_plugins
from fd_core.runtime.engine.loop import Engine, Job
from fd_core.runtime.engine.runner import ModelRunner
from fd_core.runtime.engine.sampling import SamplingParams
from fd_core.runtime.plan import model_config_for


def test_apply_penalties_gets_the_documented_dtypes() -> None:
    seen: list[tuple[str, ...]] = []

    def recording(logits: Any, prompt_mask: Any, output_counts: Any, presence: Any, frequency: Any,
                  repetition: Any) -> Any:
        args = (logits, prompt_mask, output_counts, presence, frequency, repetition)
        seen.append(tuple(str(a.dtype).replace("paddle.", "") for a in args))
        return native_ops.apply_penalties(*args)

    plugins = load_plugins()
    table = KernelTable()
    table.add(check_kernel("recording", "apply_penalties", recording, True), from_platform=False)
    arch = plugins.registry.get("ernie4_5")
    runner = ModelRunner(Backend(plugins, kernels=table), arch, model_config_for(arch, None), graph="off")
    runner.load()
    runner.decide()
    engine = Engine(runner)
    engine.add(Job(0, (5, 6, 7), SamplingParams(max_new_tokens=3, ignore_eos=True, presence_penalty=0.5,
                                                 frequency_penalty=0.3, repetition_penalty=1.2)))
    while engine.pending:
        engine.step()
    # docs/hooks.md: logits float32, prompt_mask bool, output_counts int32, the three factors float32.
    assert seen and set(seen) == {("float32", "bool", "int32", "float32", "float32", "float32")}, seen
