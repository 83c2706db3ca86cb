"""Every readable checkpoint format behind one ``Source`` protocol, opened by one ``open(path)``.

    src = restorekit.formats.open('model.safetensors')   # or a TF prefix, .weights.h5, .keras, .pt, .npz
    src['dense/kernel'].shape, src.read('dense/kernel')

Formats (one module each, registered on import): ``tf`` (TF bundles, TF2 object-based
checkpoints, SavedModel variables), ``keras`` (``.weights.h5``, ``.keras``, sharded
``.weights.json``, legacy Keras 2 ``.h5``), and ``safetensors`` (one file or a Hugging
Face shard set), ``torch`` and ``npz`` in ``files``: read under the TF names of the
checkpoint they were converted from when restorekit wrote them, else under their own.
"""

from __future__ import annotations

from restorekit.formats.registry import BY_BYTES, BY_NAME, Format, Probe, Source, detect, formats, open_source, register

open = open_source  # noqa: A001 - restorekit.formats.open(path), as tarfile.open and zipfile.ZipFile read

__all__ = ["BY_BYTES", "BY_NAME", "Format", "Probe", "Source", "detect", "formats", "open", "open_source", "register"]
