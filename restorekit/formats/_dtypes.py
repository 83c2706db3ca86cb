"""What safetensors and torch call each TensorFlow dtype: one row per dtype.

The TF name, numpy dtype and element size of every dtype are decided in
``restorekit._bundle.format``; this table only adds the foreign names. Read by the
safetensors and torch readers (``formats.safetensors``, ``formats.torch``,
``formats._torchfile``) and through them by their writers.
"""

from __future__ import annotations

__all__ = ["FROM_SAFETENSORS", "STORAGE_DTYPES", "STORAGE_ONLY", "TO_SAFETENSORS", "TORCH_DTYPES"]

# TF dtype name -> (safetensors code, torch dtype attribute, torch storage class without 'Storage');
# None where that format has no such type. Dtypes not listed have none of the three.
_ROWS = {
    "float64": ("F64", "float64", "Double"),
    "float32": ("F32", "float32", "Float"),
    "float16": ("F16", "float16", "Half"),
    "bfloat16": ("BF16", "bfloat16", "BFloat16"),
    "int64": ("I64", "int64", "Long"),
    "int32": ("I32", "int32", "Int"),
    "int16": ("I16", "int16", "Short"),
    "int8": ("I8", "int8", "Char"),
    "uint64": ("U64", "uint64", None),
    "uint32": ("U32", "uint32", None),
    "uint16": ("U16", "uint16", None),
    "uint8": ("U8", "uint8", "Byte"),
    "bool": ("BOOL", "bool", "Bool"),
    "complex64": ("C64", "complex64", "ComplexFloat"),
    "complex128": (None, "complex128", "ComplexDouble"),  # safetensors: stored as float64 pairs
    "float8_e4m3fn": ("F8_E4M3", "float8_e4m3fn", None),
    "float8_e5m2": ("F8_E5M2", "float8_e5m2", None),
    "qint8": (None, None, "QInt8"),
    "quint8": (None, None, "QUInt8"),
    "qint32": (None, None, "QInt32"),
}

# TF dtype name -> safetensors code, and back. Others are stored as a stand-in (layouts.STORED_AS,
# complex128 as float64 pairs) and named in the layout record.
TO_SAFETENSORS = {name: row[0] for name, row in _ROWS.items() if row[0] is not None}
FROM_SAFETENSORS = {code: name for name, code in TO_SAFETENSORS.items()}
# TF dtype name -> torch dtype attribute (``torch.NAME``).
TORCH_DTYPES = {name: row[1] for name, row in _ROWS.items() if row[1] is not None}
# torch storage class (``torch.FloatStorage`` without 'Storage') -> TF dtype name.
STORAGE_DTYPES = {row[2]: name for name, row in _ROWS.items() if row[2] is not None}
# torch storage classes with no TF dtype, and their element sizes in bytes.
STORAGE_ONLY = {"Untyped": 1, "QUInt4x2": 1, "QUInt2x4": 1}
