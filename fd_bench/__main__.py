"""`python -m fd_bench`: the same as `fd bench`."""

import sys

from fd_bench import main

sys.exit(main())
