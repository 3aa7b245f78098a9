"""pluggy markers for the `fd` project: decorate hook implementations with `hookimpl`."""

from __future__ import annotations

import pluggy

PROJECT = "fd"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
