"""An Engine on the tiny ERNIE-4.5 with seeded weights, eager (graph off), on the cpu platform: what engine tests
build when they drive steps themselves; and run_jobs, which steps any engine through a list of jobs."""

from __future__ import annotations

from typing import Any


def tiny_engine(**options: Any) -> Any:
    """The Engine, with `options` as its fields (speculation, max_batch, ...); its runner is loaded and decided."""
    from fd_core.host.backend import Backend
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.engine.loop import Engine
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for

    plugins = load_plugins({"FD_PLATFORM": "cpu"})
    arch = plugins.registry.get("ernie4_5")
    runner = ModelRunner(Backend(plugins), arch, model_config_for(arch, None), graph="off")
    runner.load()
    runner.decide()
    return Engine(runner, **options)


def run_jobs(engine: Any, jobs: list[Any]) -> dict[int, Any]:
    """Each job's Completion by key: the jobs queued together, the engine stepped until none is pending."""
    for job in jobs:
        engine.add(job)
    done: dict[int, Any] = {}
    while engine.pending:
        for event in engine.step():
            if event.done is not None:
                done[event.key] = event.done
    return done
