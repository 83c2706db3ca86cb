"""Live TF objects: the variable behind a handle, trackable roots, and their attribute paths.

Walks Keras 3 models, layers and ``tf.Module``s with TF's public ``TrackableView``,
alone or in step with a checkpoint's decoded object graph, as ``tf.train.Checkpoint``
matches objects.
"""

from __future__ import annotations

from collections import deque

from restorekit._tensorflow import import_tensorflow
from restorekit._bundle.objectgraph import ObjectGraph

__all__ = ["is_keras_variable", "keras_backend", "is_trackable", "layer_paths", "live_paths", "object_graph_keys", "tf_variable"]


def is_keras_variable(var) -> bool:
    """True for a Keras 3 variable: not a tf.Variable, it holds one in ``value`` and is named by ``path``."""
    return type(var).__module__.startswith("keras") and isinstance(getattr(var, "path", None), str)


def keras_backend(var) -> str:
    """The Keras backend a Keras 3 variable lives on: 'tensorflow', 'jax', 'torch' or 'numpy'."""
    # Each backend defines its variable class (keras.src.backend.jax.core.JaxVariable) under
    # the re-exported keras.src.backend.Variable; the first such module in the MRO says which.
    for cls in type(var).__mro__:
        parts = cls.__module__.split(".")
        if "backend" in parts[:-2] and parts[parts.index("backend") + 1] != "common":
            return parts[parts.index("backend") + 1]
    import keras

    return keras.config.backend()


def tf_variable(var):
    """The tf.Variable behind a Keras 3 variable; any other variable as given."""
    return var.value if is_keras_variable(var) else var


def is_trackable(obj) -> bool:
    """True for a Keras model or layer, a tf.Module or another trackable root (not a variable)."""
    return hasattr(obj, "_trackable_children") and not hasattr(obj, "assign")


def _walk_live(root, graph: ObjectGraph, start: int) -> dict[int, str]:
    """id(live variable) -> checkpoint key, walking the live object and the graph in step."""
    tf = import_tensorflow()

    found: dict[int, str] = {}
    seen = {start}
    queue = deque([(root, start)])
    while queue:
        obj, node_id = queue.popleft()
        node = graph.nodes[node_id]
        for _, _, key in node.attributes:
            if key and hasattr(obj, "assign"):
                found.setdefault(id(obj), key)
                found.setdefault(id(tf_variable(obj)), key)
        if not node.children:
            continue
        try:
            children = tf.train.TrackableView(obj).children(obj)
        except Exception:  # a trackable whose children need a save context; nothing to match there
            continue
        for child_id, local in node.children:
            if child_id in seen or local not in children:
                continue
            seen.add(child_id)
            queue.append((children[local], child_id))
    return found


def live_paths(root) -> dict[int, str]:
    """id(variable) -> attribute path from ``root`` (``encoder/w``), the shortest, as checkpoints name them."""
    tf = import_tensorflow()

    paths: dict[int, str] = {}
    seen = {id(root)}
    queue = deque([(root, "")])
    while queue:
        obj, path = queue.popleft()
        try:
            children = tf.train.TrackableView(obj).children(obj)
        except Exception:  # a trackable whose children need a save context; it holds no plain variables
            continue
        for local, child in children.items():
            if id(child) in seen:
                continue
            seen.add(id(child))
            here = f"{path}/{local}" if path else local
            if hasattr(child, "assign"):
                paths[id(child)] = here
                paths.setdefault(id(tf_variable(child)), here)
            else:
                queue.append((child, here))
    return paths


def layer_paths(root) -> dict[int, str]:
    """id(variable) -> its path through ``root``'s named sublayers (``backbone/d1/kernel``), shortest first.

    Keras 3 names a variable by the layer that made it (``d1/kernel``), without the
    model it is nested in; this path names every enclosing layer (``root`` itself left
    out), so a nested model or block can be selected by its name. A ``tf.Module`` (not
    a Keras layer) gets its attribute path instead (``encoder/w``), as ``live_paths``.
    """
    if not hasattr(root, "_layers"):
        return live_paths(root)
    paths: dict[int, str] = {}
    seen = {id(root)}
    queue = deque([(root, "")])
    while queue:
        layer, prefix = queue.popleft()
        for variable in list(getattr(layer, "_trainable_variables", ())) + list(
            getattr(layer, "_non_trainable_variables", ())
        ):
            if prefix:  # the root's own variables keep their Keras path
                paths.setdefault(id(variable), f"{prefix}/{variable.name}")
                paths.setdefault(id(tf_variable(variable)), f"{prefix}/{variable.name}")
        for sub in getattr(layer, "_layers", ()):  # Keras 3 keeps a layer's direct sublayers here
            if id(sub) not in seen:
                seen.add(id(sub))
                queue.append((sub, f"{prefix}/{sub.name}" if prefix else sub.name))
    return paths


def object_graph_keys(root, graph: ObjectGraph, variables) -> dict[int, str]:
    """Match a live trackable to a checkpoint's object graph, as ``tf.train.Checkpoint`` does.

    The checkpoint's root, and each of its children (``model`` in
    ``tf.train.Checkpoint(model=...)``), is tried as the counterpart of ``root``;
    the one that reaches the most of ``variables`` wins.

    Returns:
        ``id(variable) -> checkpoint key`` for the variables matched.
    """
    wanted = {id(v) for v in variables} | {id(tf_variable(v)) for v in variables}
    best: dict[int, str] = {}
    for start in [0] + [child for child, _ in graph.nodes[0].children]:
        found = _walk_live(root, graph, start)
        hits = {k: v for k, v in found.items() if k in wanted}
        if len(hits) > len(best):
            best = hits
    return best
