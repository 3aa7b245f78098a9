"""The Backend: hot-path binding, first-result chaining, wrappers, votes, graph clear."""

from __future__ import annotations

import sys

import pytest

from fd_core import GraphVote, ModelConfig, ParallelConfig
from fd_core.errors import SETTINGS_STYLE_ENV, PlatformError, PluginError
from fd_core.host.backend import load_backend

CHIP = """
from fd_core import Detection, GraphVote, hookimpl

CALLS = []

@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority=5, reason="fake chip", max_ranks=4)

@hookimpl
def fd_all_reduce(tensor, group):
    CALLS.append(("chip", tensor, group))
    return tensor * 2

@hookimpl
def fd_clean_memory_fragments(state_dict):
    CALLS.append(("clean", state_dict))

@hookimpl
def fd_graph_eligibility(model_config, parallel_config):
    if parallel_config.tp_size > 1 and model_config.architecture == "vl_model":
        return GraphVote.veto(f"vl_model with tp={parallel_config.tp_size} fails under capture")
    return GraphVote.ok("captures everything else")

class Graphs:
    mode = "chip_graph"

@hookimpl
def fd_graph_backend(parallel_config):
    return Graphs()
"""

TRACER = """
from fd_core import hookimpl

SEEN = []

@hookimpl(wrapper=True)
def fd_all_reduce(tensor, group):
    SEEN.append(tensor)
    result = yield
    SEEN.append(result)
    return result
"""

SMALL_ONLY = """
from fd_core import hookimpl

@hookimpl(tryfirst=True)
def fd_all_reduce(tensor):
    return None if tensor > 100 else -tensor
"""

SILENT_VETO = """
from fd_core import GraphVote, hookimpl

@hookimpl
def fd_graph_eligibility(model_config):
    return GraphVote.veto("  ")
"""

NO_GAIN = """
from fd_core import GraphVote, hookimpl

@hookimpl
def fd_graph_eligibility(model_config):
    return GraphVote.no_gain("eager is as fast here")
"""


@pytest.fixture
def chip(install_plugin):
    install_plugin("fake-chip", {"fake_chip": CHIP}, {"fd.platforms": {"fakechip": "fake_chip"}})
    return lambda: sys.modules["fake_chip"]


def test_one_rank_all_reduce_is_the_identity_and_calls_no_hook(chip) -> None:
    backend = load_backend(ParallelConfig(tp_size=1))
    value = object()
    assert backend.all_reduce(value) is value
    assert backend.all_reduce_binding == "identity (one rank)"
    assert chip().CALLS == []


def test_single_implementation_is_bound_directly_without_an_extra_frame(chip) -> None:
    group = object()
    backend = load_backend(ParallelConfig(tp_size=2, group=group))
    assert backend.all_reduce_binding == "direct: fakechip.fd_all_reduce"
    # The bound callable runs the plugin's own code object: no wrapper frame on the hot path.
    assert backend.all_reduce.__code__ is chip().fd_all_reduce.__code__
    assert backend.all_reduce(21) == 42
    assert chip().CALLS == [("chip", 21, group)]


def test_a_wrapper_sees_every_call(chip, install_plugin) -> None:
    install_plugin("tracer", {"tracer_plugin": TRACER}, {"fd.plugins": {"tracer": "tracer_plugin"}})
    backend = load_backend(ParallelConfig(tp_size=2))
    assert backend.all_reduce_binding == "hook call (wrapped by tracer)"
    assert [backend.all_reduce(x) for x in (1, 2)] == [2, 4]
    assert sys.modules["tracer_plugin"].SEEN == [1, 2, 2, 4]


def test_an_extension_takes_precedence_and_passes_with_none(chip, install_plugin) -> None:
    install_plugin("small-only", {"small_only": SMALL_ONLY}, {"fd.plugins": {"smallonly": "small_only"}})
    backend = load_backend(ParallelConfig(tp_size=2))
    assert backend.all_reduce_binding == "first result of smallonly, fakechip"
    assert backend.all_reduce(7) == -7  # the extension answered
    assert backend.all_reduce(700) == 1400  # it passed; the platform answered
    hook = backend.hook.fd_all_reduce
    assert hook(tensor=7, group=None) == -7 and hook(tensor=700, group=None) == 1400


def test_graph_decision_keeps_every_vote_and_the_veto_reason(chip) -> None:
    backend = load_backend(ParallelConfig(tp_size=2))
    decision = backend.graph_decision(ModelConfig(architecture="vl_model"))
    assert not decision.allowed and decision.mode == "chip_graph"
    assert decision.summary() == "chip_graph off: fakechip vetoed: vl_model with tp=2 fails under capture"
    allowed = backend.graph_decision(ModelConfig(architecture="vl_model"), ParallelConfig(tp_size=1))
    assert allowed.allowed and [v.line() for v in allowed.votes] == ["fakechip allows: captures everything else"]
    off = backend.graph_decision(ModelConfig(architecture="text"), requested="off")
    assert not off.allowed and off.summary() == "chip_graph off: disabled by request (LLM(graph='off'))"
    assert off.votes == ()  # nobody is asked: votes that cannot change anything are not reported


def test_a_no_gain_vote_skips_under_auto_and_yields_to_on_but_a_veto_never_does(chip, install_plugin) -> None:
    install_plugin("slow", {"no_gain": NO_GAIN}, {"fd.plugins": {"nogain": "no_gain"}})
    backend = load_backend(ParallelConfig(tp_size=1))
    auto = backend.graph_decision(ModelConfig(architecture="text"))
    assert not auto.allowed
    assert auto.summary() == "chip_graph off: nogain skipped (no gain; LLM(graph='on') captures anyway): eager is as fast here"
    with pytest.MonkeyPatch.context() as flags:  # fd run and fd explain name the flag
        flags.setenv(SETTINGS_STYLE_ENV, "cli")
        assert auto.summary() == "chip_graph off: nogain skipped (no gain; --graph on captures anyway): eager is as fast here"
    assert "nogain skips (no gain): eager is as fast here" in [v.line() for v in auto.votes]
    assert ({"plugin": "nogain", "allow": False, "reason": "eager is as fast here", "advisory": True}
            in auto.to_dict()["votes"])
    on = backend.graph_decision(ModelConfig(architecture="text"), requested="on")
    assert on.allowed and on.summary() == "chip_graph on: requested (LLM(graph='on')) over nogain's no-gain vote"
    vetoed = backend.graph_decision(ModelConfig(architecture="vl_model"), ParallelConfig(tp_size=2), requested="on")
    assert not vetoed.allowed and "fakechip vetoed: vl_model with tp=2 fails under capture" in vetoed.summary()


def test_a_veto_without_a_reason_is_a_contract_error(chip, install_plugin) -> None:
    install_plugin("silent", {"silent_veto": SILENT_VETO}, {"fd.plugins": {"silent": "silent_veto"}})
    backend = load_backend(ParallelConfig(tp_size=1))
    with pytest.raises(PluginError, match=r"plugin 'silent': fd_graph_eligibility vetoed without a reason"):
        backend.graph_decision(ModelConfig(architecture="text"))


def test_cleanup_runs_every_implementation(chip) -> None:
    backend = load_backend()
    backend.clean_memory_fragments({"w": 1})
    backend.clean_memory_fragments()
    assert chip().CALLS == [("clean", {"w": 1}), ("clean", None)]


def test_clear_graphs_of_a_model_nobody_owns_is_an_error() -> None:
    backend = load_backend()

    class Stranger:
        pass

    with pytest.raises(PluginError, match="no fd_clear_graphs implementation handled Stranger"):
        backend.clear_graphs(Stranger())


def test_platform_limits_and_missing_hardware(chip) -> None:
    backend = load_backend()
    backend.check_ranks(4)
    with pytest.raises(PlatformError, match=r"LLM\(tp=5\) is more than platform 'fakechip' serves here \(4\); use LLM\(tp=4\) or fewer"):
        backend.check_ranks(5)
    forced = load_backend(env={"FD_PLATFORM": "cuda"})
    with pytest.raises(PlatformError, match=r"platform 'cuda' is selected but its hardware is not here \(paddle is the CPU build \(paddlepaddle "):
        forced.require_hardware()


def test_graph_vote_helpers() -> None:
    assert GraphVote.veto("why") == GraphVote(False, "why")
    assert GraphVote.ok() == GraphVote(True, "")


VOTE_WRAPPER = """
from fd_core import GraphVote, hookimpl

SEEN = []

@hookimpl(wrapper=True)
def fd_graph_eligibility(model_config, parallel_config):
    votes = yield
    SEEN.append(len(votes))
    return votes
"""

BAD_VOTE = """
from fd_core import GraphVote, hookimpl

@hookimpl
def fd_graph_eligibility(model_config):
    return GraphVote(allow="no", reason="strings are not booleans")
"""

STUCK_VOTE = """
import threading
from fd_core import hookimpl

@hookimpl
def fd_graph_eligibility(model_config):
    threading.Event().wait()
"""


def test_a_wrapper_on_the_vote_runs_and_the_votes_keep_their_voters(chip, install_plugin) -> None:
    install_plugin("vote-wrap", {"vote_wrap": VOTE_WRAPPER}, {"fd.plugins": {"votewrap": "vote_wrap"}})
    backend = load_backend(ParallelConfig(tp_size=2))
    decision = backend.graph_decision(ModelConfig(architecture="vl_model"))
    import vote_wrap

    assert vote_wrap.SEEN and all(n == 1 for n in vote_wrap.SEEN)  # pluggy ran it around each voter
    assert [v.plugin for v in decision.votes] == ["fakechip"] and not decision.allowed


def test_a_vote_with_a_non_boolean_allow_is_a_contract_error(chip, install_plugin) -> None:
    install_plugin("bad-vote", {"bad_vote": BAD_VOTE}, {"fd.plugins": {"badvote": "bad_vote"}})
    with pytest.raises(PluginError, match=r"^plugin 'badvote': fd_graph_eligibility returned GraphVote\(allow='no'"):
        load_backend().graph_decision(ModelConfig(architecture="x"))


def test_a_vote_that_never_returns_is_bounded_and_named(chip, install_plugin, monkeypatch) -> None:
    install_plugin("stuck-vote", {"stuck_vote": STUCK_VOTE}, {"fd.plugins": {"stuckvote": "stuck_vote"}})
    monkeypatch.setenv("FD_HOOK_TIMEOUT", "0.5")
    with pytest.raises(PluginError, match=r"^plugin 'stuckvote': fd_graph_eligibility did not return within 0.5 s"):
        load_backend().graph_decision(ModelConfig(architecture="x"))
