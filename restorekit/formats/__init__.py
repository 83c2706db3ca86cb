"""Every readable checkpoint format behind one ``Source`` protocol, opened by one ``open(path)``.

    src = restorekit.formats.open('model.safetensors')   # or a TF prefix, .weights.h5, .keras, .pt, .npz
    src['dense/kernel'].shape, src.read('dense/kernel')

Formats (one package or module each, registered on import), each holding its reader and
its writer side by side with the same verbs (``read``, ``read_shapes``, ``read_record``,
``write``, ``write_checkpoint``; the table is ``_sinks``): ``tf`` (TF bundles, TF2
object-based checkpoints, SavedModel variables; ``write_tf``), ``keras`` (``.weights.h5``,
``.keras``, sharded ``.weights.json``, legacy Keras 2 ``.h5``), ``safetensors`` (one file,
or a Hugging Face shard set read by a subclass of the one-file reader and written by
``_shards``), ``torch``, ``npz`` and ``onnx`` (initializers and Constant tensors of ONNX
models, read only). ``files`` is what the file readers share, ``_sink`` what the writers
share, and every writer commits through ``restorekit._bundle``. The Source protocol and
the registry sit below every format (``restorekit._registry``). A file restorekit wrote
reads under the TF names of the checkpoint it was converted from, a file from elsewhere
under its own.
"""

from __future__ import annotations

from restorekit._registry import BY_BYTES, BY_NAME, Format, Probe, Source, detect, formats, open_source, register

open = open_source  # noqa: A001 - restorekit.formats.open(path), as tarfile.open and zipfile.ZipFile read

__all__ = ["BY_BYTES", "BY_NAME", "Format", "Probe", "Source", "detect", "formats", "open", "open_source", "register"]
