"""``python -m restorekit.demo``: the same as ``restorekit demo``."""

import sys

from restorekit.demo import main

sys.exit(main())
