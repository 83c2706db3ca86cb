"""Keras files as a Source: Keras 3 ``.weights.h5`` / ``.keras`` / sharded ``.weights.json``, legacy Keras 2 HDF5."""

from __future__ import annotations

from restorekit._registry import BY_BYTES, BY_NAME, Probe, register
from restorekit.keras_files import KERAS_SUFFIXES, open_keras

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def detect(probe: Probe) -> int:
    if probe.is_dir or "://" in probe.path:
        return 0
    if probe.head.startswith(HDF5_SIGNATURE):
        return BY_BYTES
    if probe.members is not None and "model.weights.h5" in probe.members:
        return BY_BYTES
    if probe.lower.endswith(".weights.json") and (not probe.exists or probe.head.lstrip()[:1] == b"{"):
        return BY_BYTES if probe.exists else BY_NAME
    # a damaged or missing file named as a Keras file: its reader says what is wrong with it
    return BY_NAME if probe.lower.endswith(KERAS_SUFFIXES) else 0


register("keras", detect=detect, open=open_keras, order=20)
