"""The TF bundle format (``PREFIX.index`` + ``PREFIX.data-*``), name-based or TF2 object-based, as a Source."""

from __future__ import annotations

import builtins
import os
import re
import struct

from restorekit._bundle.table import MAGIC
from restorekit._checkpoint import Checkpoint
from restorekit._registry import BY_BYTES, BY_NAME, Probe, register

_DATA = re.compile(r"\.data-\d{5}-of-\d{5}$")


def _has_table_footer(path: str) -> bool:
    """True when the file ends with the LevelDB table magic every TF ``.index`` ends with."""
    try:
        with builtins.open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() < 8:
                return False
            f.seek(-8, os.SEEK_END)
            return struct.unpack("<Q", f.read(8))[0] == MAGIC
    except OSError:
        return False


def detect(probe: Probe) -> int:
    path = probe.path
    if "://" in path:
        return BY_NAME  # remote: only TF reads through tf.io.gfile
    if probe.is_dir:
        names = probe.listing
        if "checkpoint" in names or "variables" in names or any(n.endswith(".index") for n in names):
            return BY_BYTES
        return 0
    if probe.exists and path.endswith(".index"):
        return BY_BYTES if _has_table_footer(path) else BY_NAME
    if _DATA.search(path):
        return BY_BYTES if os.path.exists(_DATA.sub("", path) + ".index") else BY_NAME
    if os.path.exists(path + ".index"):
        return BY_BYTES  # a prefix (also one that is a file's name, 'model.h5' beside 'model.h5.index': the prefix wins)
    return 0


register("tf", detect=detect, open=Checkpoint, order=10)
