"""Sources of deliberately broken plugins, shared by the in-process tests and the CLI failure tests."""

MISSPELLED_HOOK = """
from fd_core import hookimpl

@hookimpl
def fd_clear_grpah_opt_backend(model):
    return True
"""

UNKNOWN_ARGUMENT = """
from fd_core import hookimpl

@hookimpl
def fd_graph_eligibility(model_config, paralel_config):
    return None
"""

NOT_A_GENERATOR = """
from fd_core import hookimpl

@hookimpl(wrapper=True)
def fd_all_reduce(tensor, group):
    return tensor
"""

NO_CLEAR_HOOK = """
from fd_core import Architecture, hookimpl

@hookimpl
def fd_register_models(register):
    register(Architecture(name="mini_vl", build=lambda config, backend: None, preset={}, graph_capable=True))
"""
