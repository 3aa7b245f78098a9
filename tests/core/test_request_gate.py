"""fd_check_request: a plugin refuses a request, with its reason, before any rank works on it; a broken gate is that
plugin's error. In-process here (plan_run, LLM at tp=1 and tp=2); tests/failures/test_request_gate.py runs `fd run`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType

import pytest

from fd_core.errors import PluginError, RequestRefused
from fd_core.host.loading import load_plugins
from fd_core.runtime.plan import RunConfig, plan_run
from plugin_sources import ANSWERING_GATE, REQUEST_GATE


def module_from(source: str, name: str) -> ModuleType:
    module = ModuleType(name)
    exec(compile(source, name, "exec"), module.__dict__)
    return module


def gate_plugins(source: str = REQUEST_GATE, name: str = "gate"):
    module = module_from(source, f"{name}_module")
    return load_plugins(os.environ, extra=[("extension", name, module)]), module


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_a_gate_refuses_in_the_plan_naming_itself_with_what_it_was_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = tmp_path / "gate.log"
    monkeypatch.setenv("FDTEST_GATE_LOG", str(log))
    plugins, _ = gate_plugins()
    with pytest.raises(RequestRefused) as refused:
        plan_run(RunConfig(model="ernie4_5", tp=2, temperature=0.7, steps=8, id_prompts=((1, 2), (3, 4, 5))), plugins)
    assert str(refused.value) == "gate refuses this request: cannot sample with a temperature here; use greedy decoding"
    # What the gate was shown: the built request (two prompts, the sampling), the model and the layout, no streaming.
    assert calls(log) == [{"pid": os.getpid(), "paddle_imported": calls(log)[0]["paddle_imported"], "prompts": 2,
                           "images": 0, "temperature": 0.7, "max_new_tokens": 8, "architecture": "ernie4_5", "tp": 2,
                           "stream": False}]
    # Accepted requests plan as before; the gate is asked once per plan.
    plan = plan_run(RunConfig(model="ernie4_5", tp=2, steps=8), plugins)
    assert plan.request.prompts == ((1, 2, 3, 4),) and len(calls(log)) == 2
    with pytest.raises(RequestRefused, match=r"^gate refuses this request: at most 64 new tokens, 100 asked for$"):
        plan_run(RunConfig(model="ernie4_5", tp=1, steps=100), plugins)
    with pytest.raises(RequestRefused, match="no streaming on this device"):
        plan_run(RunConfig(model="ernie4_5", tp=1, stream=True), plugins)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (42, "plugin 'answering': fd_check_request returned int 42; return a reason (str) to refuse the request, or None to accept it"),
        (True, "plugin 'answering': fd_check_request returned bool True; return a reason (str) to refuse the request, or None to accept it"),
        ("  ", "plugin 'answering': fd_check_request refused with an empty reason; return the reason as a string"),
        ("raise", "plugin 'answering': fd_check_request raised RuntimeError: the gate broke; fix or uninstall the plugin"),
    ],
)
def test_a_broken_gate_is_its_plugins_error(answer: object, message: str) -> None:
    plugins, module = gate_plugins(ANSWERING_GATE, "answering")
    module.ANSWER = answer
    with pytest.raises(PluginError) as raised:
        plan_run(RunConfig(model="ernie4_5", tp=1), plugins)
    assert str(raised.value) == message and not isinstance(raised.value, RequestRefused)


def test_a_gate_with_fewer_arguments_and_a_multi_line_reason_refuses_in_one_line() -> None:
    plugins, module = gate_plugins(ANSWERING_GATE, "answering")
    module.ANSWER = None
    plan_run(RunConfig(model="ernie4_5", tp=1), plugins)  # None accepts
    module.ANSWER = "no seeds\n  on this chip"
    with pytest.raises(RequestRefused, match=r"^answering refuses this request: no seeds on this chip$"):
        plan_run(RunConfig(model="ernie4_5", tp=1), plugins)


def test_a_gate_that_never_returns_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FD_HOOK_TIMEOUT", "0.2")
    plugins, _ = gate_plugins("import time\nfrom fd_core import hookimpl\n\n@hookimpl\ndef fd_check_request(request):\n    time.sleep(5)\n", "stuck")
    with pytest.raises(PluginError, match=r"^plugin 'stuck': fd_check_request did not return within 0.2 s"):
        plan_run(RunConfig(model="ernie4_5", tp=1), plugins)


def test_llm_asks_the_gate_about_each_request_before_the_engine_runs(
    install_plugin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fd_core.runtime import LLM, SamplingParams

    log = tmp_path / "gate.log"
    monkeypatch.setenv("FDTEST_GATE_LOG", str(log))
    install_plugin("fd-gate", {"gate_probe": REQUEST_GATE}, {"fd.plugins": {"gate": "gate_probe"}})
    with LLM(model="ernie4_5", tp=1, graph="off") as llm:
        assert calls(log) == []  # the model's plan holds no request of the caller's: nothing to ask about yet
        engine = llm._session.worker.engine
        ran: list = []
        real = engine.add
        monkeypatch.setattr(engine, "add", lambda job: ran.append(job) or real(job))
        with pytest.raises(RequestRefused, match="^gate refuses this request: no streaming on this device$"):
            llm.stream([1, 2, 3], SamplingParams(max_new_tokens=4))  # refused when called, not at the first piece
        with pytest.raises(RequestRefused, match="cannot sample with a temperature here"):
            llm.generate([[1, 2], [3, 4]], SamplingParams(max_new_tokens=4, temperature=0.5, seed=1))
        assert ran == [] and engine.decoded_tokens == 0
        [done] = llm.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
        assert len(done.token_ids) == 4 and len(ran) == 1
    assert ([(c["stream"], c["prompts"], c["temperature"]) for c in calls(log)]
            == [(True, 1, 0.0), (False, 2, 0.5), (False, 1, 0.0)])


def test_llm_at_tp2_refuses_without_disturbing_its_ranks(
    install_plugin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fd_core.runtime import LLM, SamplingParams

    log = tmp_path / "gate.log"
    monkeypatch.setenv("FDTEST_GATE_LOG", str(log))
    install_plugin("fd-gate", {"gate_probe": REQUEST_GATE}, {"fd.plugins": {"gate": "gate_probe"}})
    with LLM(model="ernie4_5", tp=2, graph="off") as llm:
        pool = llm._session.driver
        with pytest.raises(RequestRefused, match="at most 64 new tokens, 65 asked for"):
            llm.generate([1, 2, 3], SamplingParams(max_new_tokens=65))
        # Refused before it queued: no rank saw it, nothing waits, the ranks are up.
        assert llm.error is None and llm.queued() == 0 and pool is not None and pool.thread.is_alive()
        [done] = llm.generate([1, 2, 3], SamplingParams(max_new_tokens=3))
        assert len(done.token_ids) == 3
    # Asked in this process only, never on a rank.
    assert {c["pid"] for c in calls(log)} == {os.getpid()} and [c["tp"] for c in calls(log)] == [2, 2]
