"""TF <-> PyTorch names and axes (layout='torch'): the old home of ``restorekit.export.layouts``, kept as an alias."""

from __future__ import annotations

from restorekit.export.layouts import *  # noqa: F401,F403
from restorekit.export.layouts import __all__  # noqa: F401
from restorekit.export.layouts._names import (  # noqa: F401  (private names importable from here as before)
    KERNEL_PERMS as _KERNEL_PERMS,
    LEAVES as _LEAVES,
    TF2_SUFFIX as _TF2_SUFFIX,
    dotted as _dotted,
    split_leaf as _leaf,
)
from restorekit.export.layouts._foreign import _is_embedding  # noqa: F401
