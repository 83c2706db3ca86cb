"""``python -m restorekit``: the restorekit command line."""

from restorekit.cli import main

raise SystemExit(main())
