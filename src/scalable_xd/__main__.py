"""``python -m scalable_xd``: the same command line as ``scalable-xd``."""

import sys

from .pipeline.cli import main

sys.exit(main())
