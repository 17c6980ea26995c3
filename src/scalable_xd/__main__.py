"""``python -m scalable_xd``: the same command line as ``scalable-xd``."""

import sys

from .cli import main

sys.exit(main())
