"""``python -m restorekit.demo``: the same as ``restorekit demo``."""

import sys

from restorekit.cli import main

sys.exit(main(["demo", *sys.argv[1:]]))
