"""Which format an output name asks for: ``to`` checked against the name's extension, and names refused.

A TF checkpoint prefix may hold dots (``model.ckpt``, ``model.ckpt-1000``), so a name
with no known extension is a TF checkpoint. Refused instead of silently written as one:
another tool's extension (``.onnx``, ``.pb``, ...), one that looks like ours but is not
(``.keras``, ``.npy``, ``.st``, ``.safetensor``), and a ``to`` that contradicts a
known extension (a torch file named ``.safetensors`` is unreadable by name).
A legacy Keras ``.h5`` / ``.hdf5`` is written from a legacy Keras 2 ``.h5`` source only (the
editor and ``convert`` decide that, knowing the source); named so for any other source it is
refused by :func:`legacy_h5_refused`.
"""

from __future__ import annotations

import difflib
import os

from restorekit.errors import OutputNameError
from restorekit.formats import _sinks as formats

__all__ = ["OutputNameError", "legacy_h5_refused", "target_format"]

KERAS_WEIGHTS = ".weights.h5"
KERAS_SHARDED = ".weights.json"

# Extensions of other tools' files: an output named so is almost surely not meant to be
# a TF checkpoint prefix.
_FOREIGN_SUFFIXES = frozenset({".onnx", ".pb", ".pbtxt", ".tflite", ".json", ".txt", ".pkl", ".pickle",
                               ".msgpack", ".gguf", ".ggml", ".mlmodel", ".caffemodel", ".params", ".joblib",
                               ".zip", ".tar", ".gz", ".engine", ".plan"})

# Extensions close to what restorekit writes, each with what to name the file instead.
_HINTS = {
    ".keras": f"A .keras archive holds a model's config as well; restorekit writes the weights as '*{KERAS_WEIGHTS}'.",
    KERAS_SHARDED: "A Keras sharded set is written from a Keras 3 file by CheckpointEditor(src).save(out, "
                   "max_shard_size='500MB'); convert writes one '*.weights.h5'.",
    ".npy": "A .npy file holds one array; a checkpoint's tensors go in an '.npz'.",
    ".st": "Did you mean '.safetensors'?",
    ".torch": "Did you mean '.pt'?",
    ".pytorch": "Did you mean '.pt'?",
}

# Misspellings of these (".safetensor", ".safetensorss", ".npzz") are refused with "did you mean".
_SPELLED = (".safetensors", ".npz", ".pth")


def _suffixes() -> dict[str, str]:
    """Every extension restorekit writes -> its format name."""
    found = {s: name for name, mod in formats.modules().items() for s in mod.SUFFIXES}
    found[KERAS_WEIGHTS] = "keras"
    return found


def _suffix(path: str) -> str:
    lower = path.lower()
    for double in (KERAS_WEIGHTS, KERAS_SHARDED):
        if lower.endswith(double):
            return double
    return os.path.splitext(lower)[1]


def _odd_suffix(suffix: str) -> str | None:
    """Why an output with this extension is refused ('' for another tool's), or None when it may be a TF prefix."""
    if suffix in _HINTS:
        return _HINTS[suffix]
    if suffix in _FOREIGN_SUFFIXES:
        return ""
    close = difflib.get_close_matches(suffix, _SPELLED, n=1, cutoff=0.8)
    return f"Did you mean {close[0]!r}?" if close else None


def legacy_h5_refused(path, source: str | None = None) -> OutputNameError:
    """The error for an output named as a legacy Keras ``.h5`` (``path``) whose source (``source``: what it is,
    in words; None: not a Keras file) is not a legacy Keras 2 ``.h5``."""
    path = os.fspath(path)
    suffix = _suffix(path)
    what = f"{source} " if source else "TF checkpoint or other file "
    extensions = ", ".join(sorted(_suffixes()))
    return OutputNameError(path, lambda w: (
        f"restorekit writes a legacy Keras {suffix!r} file ({path!r}) only from a legacy Keras 2 .h5 file "
        f"(tf-keras model.save or save_weights), whose layer_names and weight_names it keeps; this source is a "
        f"{what}with none. Keras 3 weights files are named '*{KERAS_WEIGHTS}' (written from a Keras 3 "
        f"{KERAS_WEIGHTS} or .keras source). Nothing was written; name the output with one of {extensions}"
        + (f", or pass {w.option('to', 'tf')} to write a TF checkpoint under that name" if w.option("to", "tf") else "")))


def target_format(path, to: str | None, *, option: str = "to") -> str:
    """``to``, checked, or the format ``path``'s extension names ('tf' when none does).

    ``option`` is what the caller calls ``to`` (``export_checkpoint``: ``format``), for messages.

    Raises:
        InvalidArgumentError: an unknown ``to``.
        OutputNameError: ``to`` contradicts the extension (``to='torch'`` for ``x.safetensors``);
            or, without ``to``, an extension restorekit does not write (``.onnx``, ``.keras``,
            ``.npy``; ``.h5``, written from a legacy Keras source only: ``legacy_h5_refused``) or a
            near miss of one it does (``.st``, ``.safetensor``).
    """
    path = os.fspath(path)
    suffix = _suffix(path)
    known = _suffixes()
    if to is not None:
        if to != formats.TF:
            formats.module(to)  # InvalidArgumentError for an unknown name
        named = known.get(suffix)
        if named is not None and named != to:
            def words(w):
                given = w.option(option, to)
                return (f"{path!r} names a {named} file ({suffix}) but {given or 'writing ' + to} asks for {to}; "
                        f"nothing was written. Name the output for {to}"
                        + (f", or leave out {given} to write {named}" if given else ""))
            raise OutputNameError(path, words)
        return to
    if suffix in known:
        return known[suffix]
    if suffix in (".h5", ".hdf5"):
        raise legacy_h5_refused(path)
    why = _odd_suffix(suffix)
    if why is not None:
        extensions = ", ".join(sorted(known))
        raise OutputNameError(path, lambda w: (
            f"restorekit does not write {suffix!r} files ({path!r}). {why + ' ' if why else ''}Nothing was written; "
            f"name the output with one of {extensions}"
            + (f", or pass {w.option('to', 'tf')} to write a TF checkpoint under that name" if w.option("to", "tf") else "")))
    return formats.TF
