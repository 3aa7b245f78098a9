"""fd_register_models: graph-clear is part of registering a graph-capable architecture."""

from __future__ import annotations

import pytest

from fd_core.errors import PluginError
from fd_core.host.loading import load_plugins
from plugin_sources import NO_CLEAR_HOOK

NOT_GRAPH_CAPABLE = """
from fd_core import Architecture, hookimpl

@hookimpl
def fd_register_models(register):
    register(Architecture(name="eager_only", build=lambda config, backend: None, preset={}, graph_capable=False))
"""

CLASH = """
from fd_core import Architecture, hookimpl

@hookimpl
def fd_register_models(register):
    register(Architecture(name="ernie4_5", build=lambda config, backend: None, preset={}, graph_capable=False))
"""

HALF_CLASH = """
from fd_core import Architecture, hookimpl

@hookimpl
def fd_register_models(register):
    register(Architecture(name="first_ok", build=lambda config, backend: None, preset={}, graph_capable=False))
    register(Architecture(name="ernie4_5", build=lambda config, backend: None, preset={}, graph_capable=False))
"""

# A wrapper runs around each package's registration (pluggy calls it around each one).
REGISTER_WRAPPER = """
from fd_core import hookimpl

SEEN = []

@hookimpl(wrapper=True)
def fd_register_models(register):
    SEEN.append("before")
    result = yield
    SEEN.append("after")
    return result
"""

WRONG_TYPE = """
from fd_core import hookimpl

@hookimpl
def fd_register_models(register):
    register({"name": "dict_model"})
"""


def test_graph_capable_architecture_without_clear_hook_fails_naming_it(install_plugin) -> None:
    install_plugin("mini-vl", {"mini_vl_pkg": NO_CLEAR_HOOK}, {"fd.models": {"mini_vl": "mini_vl_pkg"}})
    with pytest.raises(PluginError) as err:
        load_plugins({})
    assert str(err.value) == (
        "plugin 'mini_vl' registers graph-capable architecture 'mini_vl' without a graph-clear hook: "
        "implement fd_clear_graphs(model) in 'mini_vl' or register it with graph_capable=False"
    )


def test_architecture_that_is_not_graph_capable_needs_no_clear_hook_and_is_vetoed(install_plugin) -> None:
    from fd_core import ModelConfig
    from fd_core.host.backend import load_backend

    install_plugin("eager-only", {"eager_only_pkg": NOT_GRAPH_CAPABLE}, {"fd.models": {"eager_only": "eager_only_pkg"}})
    plugins = load_plugins({})
    assert plugins.registry.get("eager_only").package == "eager_only"
    decision = load_backend(plugins=plugins).graph_decision(ModelConfig(architecture="eager_only"))
    assert not decision.allowed
    assert "eager_only vetoed: eager_only is registered as not graph-capable" in decision.summary()


def test_name_clash_blames_the_newcomer_not_the_builtin(install_plugin) -> None:
    install_plugin("clash", {"clash_pkg": CLASH}, {"fd.models": {"clash": "clash_pkg"}})
    with pytest.raises(PluginError) as err:
        load_plugins({})
    assert str(err.value) == (
        "plugin 'clash' registers architecture 'ernie4_5', already registered by the built-in 'ernie4_5'; rename it in 'clash'"
    )


def test_a_failed_registration_is_listed_not_fatal_to_the_listing(install_plugin) -> None:
    """`fd plugins` (strict=False) lists the failed package with its error, keeps the others,
    and drops what it half registered."""
    install_plugin("clash", {"clash_pkg": HALF_CLASH}, {"fd.models": {"clash": "clash_pkg"}})
    plugins = load_plugins({}, strict=False)
    record = plugins.record("clash", "model")
    assert record.status.startswith("failed: plugin 'clash' registers architecture 'ernie4_5'") and not record.active
    assert "first_ok" not in plugins.registry and "ernie4_5" in plugins.registry
    assert plugins.problems == [record.error]
    with pytest.raises(PluginError, match="rename it in 'clash'"):
        plugins.require_usable()


def test_a_wrapper_on_register_models_runs(install_plugin) -> None:
    install_plugin("reg-wrap", {"reg_wrap": REGISTER_WRAPPER}, {"fd.plugins": {"regwrap": "reg_wrap"}})
    load_plugins({})
    import reg_wrap

    assert reg_wrap.SEEN == ["before", "after"] * 3  # the three built-in model packages


def test_register_takes_an_architecture(install_plugin) -> None:
    install_plugin("wrong-type", {"wrong_type_pkg": WRONG_TYPE}, {"fd.models": {"wrongtype": "wrong_type_pkg"}})
    with pytest.raises(PluginError, match=r"plugin 'wrongtype': fd_register_models passed dict to register\(\); pass fd_core.Architecture"):
        load_plugins({})


def test_builtin_architectures_are_registered_with_aliases() -> None:
    registry = load_plugins({}).registry
    assert [a.name for a in registry] == ["ernie4_5", "ernie4_5_vl", "qwen3_vl"]
    assert registry.get("Ernie4_5_VLMoeForConditionalGeneration").name == "ernie4_5_vl"
    assert all(a.graph_capable for a in registry)
