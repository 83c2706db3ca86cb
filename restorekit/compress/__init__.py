"""Compress a trained model for inference (LiteRT, ONNX / TensorRT-ready ONNX; fp16 or int8), checked.

``compress`` takes a frozen ``.pb``, a checkpoint plus its graph (frozen on the way with
``freeze``), a SavedModel or a Keras model file, converts it, runs the original and the compressed model on
the same inputs, and writes the result only when it computes what the original did.
TensorFlow, LiteRT, tf2onnx and ONNX Runtime load inside the functions that use them.
"""

from restorekit.compress._convert import BACKENDS, PRECISIONS, compress
from restorekit.compress._result import CompressResult

__all__ = ["BACKENDS", "PRECISIONS", "CompressResult", "compress"]
