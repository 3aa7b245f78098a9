"""`python -m fd_core.cli`: the `fd` command."""

import sys

from fd_core.cli.main import main

sys.exit(main())
