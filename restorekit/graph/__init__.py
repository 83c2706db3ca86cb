"""Graphs: inspect GraphDef / MetaGraph / SavedModel files, freeze a checkpoint into a .pb, unfreeze it back.

Three verbs, each over any accepted graph (a ``.pb`` binary or text GraphDef, a
``.meta`` MetaGraphDef, a SavedModel directory, or the protos / ``tf.Graph`` in memory):

* ``inspect_graph`` summarises inputs, likely outputs, variables, op counts and constant
  size, after repairing what makes old graphs fail to load in today's TensorFlow;
* ``freeze`` restores a checkpoint into a graph and writes the frozen ``.pb``;
* ``unfreeze`` turns the weight constants of a frozen ``.pb`` back into a checkpoint
  and, optionally, a trainable MetaGraph.

The package, bottom up: ``results`` (the values returned), ``common`` (shared helpers),
``loading``, ``repairs``, ``inspect``, ``freezing``, ``constants`` (sizes and bytes of Const values),
``trainable`` and ``unfreezing``.
"""

from __future__ import annotations

import sys
import types

from restorekit.graph import _common as common
from restorekit.graph._common import MAX_PROTO_BYTES  # noqa: F401
from restorekit.graph._freezing import freeze
from restorekit.graph._inspect import inspect_graph
from restorekit.graph._repairs import import_meta_graph, repair_graph
from restorekit.graph._results import (
    Alignment,
    ConvertedConstant,
    GraphSummary,
    TensorSummary,
    UnfreezeResult,
    VariableSummary,
)
from restorekit.graph._unfreezing import LARGE_CONSTANT_BYTES, unfreeze  # noqa: F401

__all__ = [
    "Alignment",
    "ConvertedConstant",
    "GraphSummary",
    "TensorSummary",
    "UnfreezeResult",
    "VariableSummary",
    "freeze",
    "import_meta_graph",
    "inspect_graph",
    "repair_graph",
    "unfreeze",
]

# Settings the package re-exports from the module that reads them.
_SETTINGS = {"MAX_PROTO_BYTES": common}


class _Package(types.ModuleType):
    """Setting ``restorekit.graph.MAX_PROTO_BYTES`` (as tests do) sets it where the code reads it."""

    def __setattr__(self, name, value):
        owner = _SETTINGS.get(name)
        if owner is not None:
            setattr(owner, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
