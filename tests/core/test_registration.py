"""fd_register_models: graph-clear is part of registering a graph-capable architecture."""

from __future__ import annotations

import pytest

from fd_core.errors import PluginError
from fd_core.plugins import load_plugins
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
    from fd_core.backend import load_backend

    install_plugin("eager-only", {"eager_only_pkg": NOT_GRAPH_CAPABLE}, {"fd.models": {"eager_only": "eager_only_pkg"}})
    plugins = load_plugins({})
    assert plugins.registry.get("eager_only").package == "eager_only"
    decision = load_backend(plugins=plugins).graph_decision(ModelConfig(architecture="eager_only"))
    assert not decision.allowed
    assert "eager_only vetoed: eager_only is registered as not graph-capable" in decision.summary()


def test_name_clash_names_both_packages(install_plugin) -> None:
    install_plugin("clash", {"clash_pkg": CLASH}, {"fd.models": {"clash": "clash_pkg"}})
    with pytest.raises(PluginError, match=r"registers architecture 'ernie4_5', already registered by '(clash|ernie4_5)'; rename one of them") as err:
        load_plugins({})
    message = str(err.value)
    assert "'clash'" in message and message.count("'ernie4_5'") == 2


def test_register_takes_an_architecture(install_plugin) -> None:
    install_plugin("wrong-type", {"wrong_type_pkg": WRONG_TYPE}, {"fd.models": {"wrongtype": "wrong_type_pkg"}})
    with pytest.raises(PluginError, match=r"plugin 'wrongtype': fd_register_models passed dict to register\(\); pass fd_core.Architecture"):
        load_plugins({})


def test_builtin_architectures_are_registered_with_aliases() -> None:
    registry = load_plugins({}).registry
    assert [a.name for a in registry] == ["ernie4_5", "ernie4_5_vl", "qwen3_vl"]
    assert registry.get("Ernie4_5_VLMoeForConditionalGeneration").name == "ernie4_5_vl"
    assert all(a.graph_capable for a in registry)
