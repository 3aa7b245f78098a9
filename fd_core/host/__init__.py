"""The plugin host: what finds, checks and selects plugins, and the Backend bound from them.

Not the contract (that is fd_core's top level): the machinery behind it. `load_plugins` discovers
and validates every installed plugin and selects the platform; `load_backend` builds the Backend a
run computes through.
"""

from fd_core.host.backend import Backend, load_backend
from fd_core.host.loading import PluginSet, load_plugins

__all__ = ["Backend", "PluginSet", "load_backend", "load_plugins"]
