"""Conversions between checkpoint formats: open a source once, apply a view, write through a format's writer.

The formats themselves (reader and writer side by side, the same verbs each) are
``restorekit.formats``; the views a conversion applies are ``restorekit.layouts``
(``layout='torch'``) and the modules here::

    restorekit.export._hf            named rule sets (BERT, GPT-2 <-> Hugging Face) and config.json
    restorekit.export._options       weights_only, ema and rules: what an export writes, under which names
    restorekit.export._sources       a conversion's non-TF source (a file, or a set of shards)
    restorekit.export._request       the one table of which option applies to which format
    restorekit.export._targets       which format an output name asks for
    restorekit.export._outputs       a conversion's output: checks, lock, config.json, result
    restorekit.export._from_checkpoint  writing an open TF checkpoint or Keras file
    restorekit.export._from_files    writing an open safetensors, PyTorch, npz or ONNX file
    restorekit.export._keras         Keras files in conversions

and three functions over them (``_conversions``, each open -> plan -> write):
:func:`export_checkpoint` (TF checkpoint -> file), :func:`import_checkpoint` (file ->
TF checkpoint) and :func:`convert` (any -> any), each taking ``out`` (the output),
``to`` (the target format, where it is not fixed), ``rules=`` (``'bert-tf-to-hf'``,
``'gpt2-tf-to-hf'``, their reverses, or rename pairs), ``weights_only=``, ``ema=`` and
``max_shard_size=`` (the largest shard of the output, TF data shards included);
exports also ``config=``. Importing this package never imports torch or safetensors.

Round trips are bit-exact (names, dtypes including bfloat16, values), with or
without ``layout='torch'``: what an export did is recorded inside the file. String
tensors (such as TF2's ``_CHECKPOINTABLE_OBJECT_GRAPH``), which neither safetensors
nor torch can hold, travel in that record too (base64), up to 64 MiB in all;
npz stores them as fixed-width bytes.
"""

from __future__ import annotations

from restorekit.formats._sink import ExportResult

__all__ = [
    "FORMATS",
    "RULE_SETS",
    "ExportResult",
    "convert",
    "export_checkpoint",
    "import_checkpoint",
    "source_format",
]


_CONVERSIONS = ("convert", "export_checkpoint", "import_checkpoint", "source_format", "target_format")


def __getattr__(name: str):
    # The conversions are imported on first use: the format readers below this package
    # (restorekit.formats) read through export.layout(s) and export.base, and importing those
    # must not import the conversions, which import the readers.
    if name in _CONVERSIONS:
        from restorekit.export import _conversions as conversions

        return getattr(conversions, name)
    # FORMATS lists the format modules found in this package; computed on first use so
    # that importing restorekit does not import them.
    if name == "FORMATS":
        from restorekit.formats import _sinks as formats

        return formats.names()
    if name == "RULE_SETS":
        from restorekit.export._hf import RULE_SETS

        return RULE_SETS
    raise AttributeError(f"module 'restorekit.export' has no attribute {name!r}")
