"""Layer paths from a live Keras model, for checkpoints whose object graph names layers only by position.

A TF2 checkpoint of a Keras 3 functional model records where each variable sits in the
model's attributes (``model/_operations/1/_operations/2/_kernel``), not the names of
the layers on the way: Keras keeps those in the live model (and its config) only. Two
nested functional blocks holding a ``fc`` each give both the Keras path ``fc/kernel``
(a functional block's layers are built outside its scope), so the checkpoint alone
cannot tell ``block_a.fc`` from ``block_b.fc``. Walking the model along the object path
can: a position in a list of layers (``_operations/1``) reads as that layer's name
(``block_a``), an attribute (``self.fc1``, a torch twin's ``self.fc1``) as the attribute,
Keras' own bookkeeping (``_functional`` of a Sequential) as nothing.

Only attributes are read (``getattr``, list positions, ``.name``): no Keras import,
any backend, any model a checkpoint's object paths lead through.
"""

from __future__ import annotations

import re

# Attributes holding a model's layers in order: their positions read as the layers' names.
_LAYER_LISTS = {"_operations", "_layers", "layers", "_self_tracked_trackables"}
# Keras' own links inside a model, which a torch module tree has no level for.
_BOOKKEEPING = {"_functional"}
# MultiHeadAttention keeps its projections in private attributes; torch users know them by the Keras names.
PRIVATE = {"_query_dense": "query", "_key_dense": "key", "_value_dense": "value", "_output_dense": "attention_output"}
_LAYER_N = re.compile(r"layer(?:_with_weights)?-(\d+)")


def model_paths(model, object_paths) -> dict:
    """``{object path: layer path}`` for every object path that leads through ``model`` to a variable.

    The first segment may name the model (``tf.train.Checkpoint(model=m)``) or already
    be one of its attributes (a checkpoint of the model itself); object paths that lead
    nowhere in ``model`` (optimizer state, another root) are left out.
    """
    out = {}
    for object_path in object_paths:
        parts = object_path.split("/")
        path = _walk(model, parts[1:]) if len(parts) > 1 else None
        if path is None:
            path = _walk(model, parts)
        if path is not None:
            out[object_path] = path
    return out


def _walk(model, parts: list) -> str | None:
    node, in_layers = model, False
    names: list[str] = []
    for i, part in enumerate(parts):
        positional = isinstance(node, (list, tuple)) and part.isdigit()
        tf_keras = _LAYER_N.fullmatch(part)
        try:
            if positional:
                node = node[int(part)]
            elif tf_keras is not None and hasattr(node, "layers"):
                node = list(node.layers)[int(tf_keras.group(1))]
            else:
                node = getattr(node, part)
        except (AttributeError, IndexError, TypeError, ValueError):
            return None
        if i == len(parts) - 1:
            if not _is_variable(node):
                return None
            leaf = str(getattr(node, "path", None) or getattr(node, "name", None) or part)
            return "/".join([*names, leaf.split(":")[0].rpartition("/")[2] or part.lstrip("_")])
        if (positional and in_layers) or tf_keras is not None:  # a layer by its place: its name
            name = getattr(node, "name", None)
            if not isinstance(name, str):
                return None
            names.append(name)
        elif part not in _LAYER_LISTS and part not in _BOOKKEEPING:  # an attribute, or a plain list's index
            names.append(PRIVATE.get(part, part))
        in_layers = part in _LAYER_LISTS
    return None


def _is_variable(node) -> bool:
    return hasattr(node, "shape") and hasattr(node, "dtype") and (hasattr(node, "assign") or hasattr(node, "numpy"))
