"""Test this source tree, not an installed copy; spawned ranks inherit sys.path, so they import it too."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
