"""Fuzz the graph readers: damaged .pb (binary and text), .meta and SavedModel files through restorekit.graph.

Each damaged file goes through ``restorekit.graph._loading._load``, ``inspect_graph`` and
``repair_graph`` (which hand the graph to TensorFlow's C++ importer) and must succeed or
raise a RestoreKitError. A crash inside TensorFlow cannot be caught in-process, so the
cases run in one worker process (this file run as a script) that prints one JSON line
when a case starts and one with its outcome; when the worker dies, the test names the
case it died on and starts a new worker after it. An alarm per case catches hangs.
"""

from __future__ import annotations

import os
import random
import sys

import pytest

from fuzzing import flip, outcome_counts, overwrite, run_all, run_cases, truncate

SEED = 20250612
CASE_SECONDS = 30  # a hang guard, not a speed bar: a loaded 2-core machine must not trip it
RSS_GROWTH_LIMIT = 400 << 20  # bytes; the seeds are a few KB, a damaged size field may claim terabytes
SEEDS = ("graph.pb", "graph.pbtxt", "frozen.pb", "model.meta", "v1_saved/saved_model.pb", "v2_saved/saved_model.pb")
MAX_OUTPUT_BYTES = 64 << 20


# ------------------------------------------------------------------ seeds (in the worker: they need TensorFlow)


def _build_seeds(directory: str) -> None:
    """A tf.compat.v1 graph (placeholder, variable, consts) as .pb, .pbtxt, .meta and two SavedModels."""
    import numpy as np
    import tensorflow as tf

    tf1 = tf.compat.v1
    with tf.Graph().as_default() as g:
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", initializer=np.arange(6, dtype=np.float32).reshape(3, 2))
        b = tf.constant(np.array([0.5, -1.0], np.float32), name="b")
        splat = tf.fill([2], 3.0, name="splat_fill")
        scale = tf.constant(2.0, shape=[2], name="scale")  # listed once, stands for both
        tf.constant([b"tag", b""], name="labels")
        y = tf.identity((tf.matmul(x, w) + b) * scale + splat, name="y")
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            saver.save(sess, os.path.join(directory, "model"), write_meta_graph=False)
            tf1.saved_model.simple_save(sess, os.path.join(directory, "v1_saved"), {"x": x}, {"y": y})
        tf1.train.export_meta_graph(os.path.join(directory, "model.meta"), saver_def=saver.as_saver_def())
        tf.io.write_graph(g.as_graph_def(), directory, "graph.pb", as_text=False)
        tf.io.write_graph(g.as_graph_def(), directory, "graph.pbtxt", as_text=True)
    from restorekit.graph import freeze

    freeze(os.path.join(directory, "model"), os.path.join(directory, "model.meta"), ["y"],
           out=os.path.join(directory, "frozen.pb"))

    class Dense(tf.Module):
        def __init__(self):
            super().__init__()
            self.kernel = tf.Variable(np.ones((3, 2), np.float32), name="kernel")

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="inp")])
        def __call__(self, x):
            return {"out": tf.matmul(x, self.kernel)}

    module = Dense()
    tf.saved_model.save(module, os.path.join(directory, "v2_saved"), signatures={"serving_default": module.__call__})


# ------------------------------------------------------------------ byte-level damage


# ------------------------------------------------------------------ structured damage (decode, change, encode)

_HUGE_DIMS = [2**31, 2**40, 2**62, -5, 10**6]
_BAD_DTYPES = [0, 20, 21, 101, 999, 7]  # invalid, resource, variant, a ref type, unknown, string


def _graph_of(message):
    if message.DESCRIPTOR.name == "SavedModel":
        return message.meta_graphs[0].graph_def
    if message.DESCRIPTOR.name == "MetaGraphDef":
        return message.graph_def
    return message


def _const_damage(rng, node):
    tensor = node.attr["value"].tensor
    choice = rng.randrange(5)
    if choice == 0:  # a huge shape over a few listed values: a splat claiming gigabytes
        del tensor.tensor_shape.dim[:]
        for _ in range(rng.randint(1, 3)):
            tensor.tensor_shape.dim.add().size = rng.choice(_HUGE_DIMS)
    elif choice == 1:
        tensor.dtype = rng.choice(_BAD_DTYPES)
    elif choice == 2:
        tensor.tensor_content = tensor.tensor_content[: rng.randrange(len(tensor.tensor_content) + 1)] + b"\x01"
    elif choice == 3:  # rank 70
        del tensor.tensor_shape.dim[:]
        for _ in range(70):
            tensor.tensor_shape.dim.add().size = 1
    else:
        node.attr["dtype"].type = rng.choice(_BAD_DTYPES)


def _node_damage(rng, gd):
    nodes = list(gd.node)
    node = rng.choice(nodes)
    consts = [n for n in nodes if n.op == "Const"]
    choice = rng.randrange(9)
    if choice == 0 and consts:
        _const_damage(rng, rng.choice(consts))
    elif choice == 1:  # a wrong dtype attr
        keys = [k for k in node.attr if node.attr[k].WhichOneof("value") == "type"] or ["dtype"]
        node.attr[rng.choice(keys)].type = rng.choice(_BAD_DTYPES)
    elif choice == 2:
        node.input.append(rng.choice(["missing", node.name, f"{nodes[0].name}:99", "^" + node.name, ""]))
    elif choice == 3:
        node.op = rng.choice(["NoSuchOp", "", "Const", "VarHandleOp", "Placeholder", "While"])
    elif choice == 4:  # colocation with a name that is not text
        node.attr["_class"].list.s.append(rng.choice([b"loc:@\xff\xfe", b"loc:@", b"loc:@" + b"a" * 300]))
    elif choice == 5:
        shape = node.attr["_output_shapes"].list.shape.add()
        shape.dim.add().size = rng.choice(_HUGE_DIMS)
    elif choice == 6:
        gd.node.add().CopyFrom(node)  # a duplicate name
    elif choice == 7:
        key = rng.choice(list(node.attr) or ["shape"])
        node.attr[key].i = rng.choice([-1, 2**62])  # an attr of the wrong kind
    else:
        node.name = rng.choice(["", "a b", "\u00e9", "x" * 5000, node.name + ":0"])


def _meta_damage(rng, meta):
    choice = rng.randrange(4)
    if choice == 0 and meta.collection_def:
        key = rng.choice(sorted(meta.collection_def))
        values = meta.collection_def[key].bytes_list.value
        values.append(rng.choice([b"\xff", b"\n\x05ab", b"\x08\x80", b"\x12\xff\xff\xff\xff\x0f"]))
    elif choice == 1 and meta.signature_def:
        sig = meta.signature_def[rng.choice(sorted(meta.signature_def))]
        info = sig.inputs[rng.choice(["x", "inp", "new"])]
        info.dtype = rng.choice(_BAD_DTYPES)
        info.name = rng.choice(["", "nowhere:0", "y:7", ":"])
        info.tensor_shape.dim.add().size = rng.choice(_HUGE_DIMS)
    elif choice == 2 and meta.object_graph_def.nodes:
        nodes = meta.object_graph_def.nodes
        node = nodes[rng.randrange(len(nodes))]
        pick = rng.randrange(3)
        if pick == 0:
            node.children.add(node_id=rng.choice([len(nodes), 2**31 - 1, 0]), local_name="bad")
        elif pick == 1:
            node.variable.dtype = rng.choice(_BAD_DTYPES)
            node.variable.shape.dim.add().size = rng.choice(_HUGE_DIMS)
        else:
            node.slot_variables.add(original_variable_node_id=2**20, slot_variable_node_id=rng.randrange(len(nodes)))
    else:
        meta.meta_info_def.stripped_op_list.op.add().name = "NoSuchOp"
        meta.meta_info_def.tags.append("serve")


def _structured(rng, data, cls, binary: bool):
    from google.protobuf import text_format

    message = cls()
    if binary:
        message.ParseFromString(data)
    else:
        text_format.Parse(data.decode(), message)
    for _ in range(rng.randint(1, 2)):
        if cls.DESCRIPTOR.name != "GraphDef" and rng.random() < 0.4:
            _meta_damage(rng, message.meta_graphs[0] if cls.DESCRIPTOR.name == "SavedModel" else message)
        else:
            _node_damage(rng, _graph_of(message))
    if binary:
        return message.SerializeToString()
    return text_format.MessageToString(message).encode("utf-8", "surrogateescape")


def _crafted_graphs() -> list:
    """Small GraphDefs made by hand: constants claiming more than they hold, cycles, recursion."""
    from tensorflow.core.framework import graph_pb2

    def graph(dims, dtype=1, values=(1.0,), content=b"", consumer="Identity"):
        gd = graph_pb2.GraphDef()
        node = gd.node.add(name="c", op="Const")
        node.attr["dtype"].type = dtype
        tensor = node.attr["value"].tensor
        tensor.dtype = dtype
        for d in dims:
            tensor.tensor_shape.dim.add().size = d
        if content:
            tensor.tensor_content = content
        elif dtype == 7:
            tensor.string_val.extend(b"x" for _ in values)
        else:
            tensor.float_val.extend(values)
        if consumer:
            out = gd.node.add(name="y", op=consumer, input=["c"])
            out.attr["T"].type = dtype
        return gd

    cases = {
        "splat-2^31-floats": graph([2**31]),
        "splat-2^62-floats": graph([2**62]),
        "splat-2^40-cubed": graph([2**40] * 3),
        "content-short-for-2^31": graph([2**31], content=b"\0" * 8),
        "content-not-a-multiple": graph([3], content=b"\0" * 7),
        "splat-strings-2^31": graph([2**31], dtype=7),
        "rank-70": graph([1] * 70),
        "negative-dim": graph([-5]),
        "values-past-the-shape": graph([2], values=(1.0, 2.0, 3.0)),
        "resource-const": graph([2], dtype=20, consumer=None),
        "lone-splat": graph([2**31], consumer=None),
    }
    cycle = graph([2])
    cycle.node[0].input.append("^y")
    cases["cycle"] = cycle
    recursive = graph([2])
    function = recursive.library.function.add()
    function.signature.name = "f"
    function.node_def.add(name="call", op="f")
    recursive.node.add(name="g", op="f")
    cases["recursive-function"] = recursive
    mutual = graph([2])
    for name, callee in (("f", "g"), ("g", "f")):
        function = mutual.library.function.add()
        function.signature.name = name
        call = function.node_def.add(name="call", op="PartitionedCall")
        call.attr["f"].func.name = callee
    mutual.node.add(name="n", op="f")
    cases["functions-calling-each-other-by-attr"] = mutual
    return [(f"crafted-{name}", "graph.pb", gd.SerializeToString()) for name, gd in cases.items()]


def _corpus(directory: str) -> list:
    """(case name, seed name, damaged bytes), in a fixed order from a fixed seed."""
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

    classes = {"graph.pb": graph_pb2.GraphDef, "frozen.pb": graph_pb2.GraphDef, "graph.pbtxt": graph_pb2.GraphDef, "model.meta": meta_graph_pb2.MetaGraphDef,
               "v1_saved/saved_model.pb": saved_model_pb2.SavedModel, "v2_saved/saved_model.pb": saved_model_pb2.SavedModel}
    rng = random.Random(int(os.environ.get("FUZZ_SEED", SEED)))
    cases = []
    for seed in SEEDS:
        with open(os.path.join(directory, seed), "rb") as f:
            data = f.read()
        for i in range(25):
            damage = rng.choice([flip, truncate, overwrite])
            cases.append((f"{seed}-{damage.__name__}-{i}", seed, damage(rng, data)))
        for i in range(30):
            damaged = _structured(rng, data, classes[seed], binary=not seed.endswith("txt"))
            cases.append((f"{seed}-structured-{i}", seed, damaged))
    return cases + _crafted_graphs()


# ------------------------------------------------------------------ the worker


def _place(directory: str, seed: str, data: bytes) -> str:
    """Write a case where its kind of reader looks for it; the path to pass."""
    case_dir = os.path.join(directory, "cases", seed.replace("/", "_"))
    os.makedirs(case_dir, exist_ok=True)
    for name in os.listdir(case_dir):
        os.remove(os.path.join(case_dir, name))
    path = os.path.join(case_dir, os.path.basename(seed))
    with open(path, "wb") as f:
        f.write(data)
    return case_dir if seed.endswith("saved_model.pb") else path


def _run_case(index, path, out) -> None:
    from restorekit.graph import inspect_graph, repair_graph, unfreeze
    from restorekit.graph._loading import _load

    _load(path)
    inspect_graph(path)
    repair_graph(path, out=out + ".meta" if index % 5 == 0 else None, overwrite=True)
    if path.endswith((".pb", ".pbtxt")) and not path.endswith("saved_model.pb"):
        # Every constant becomes a checkpoint entry: the sizes a damaged Const claims are tested.
        unfreeze(path, out, weights="large", min_bytes=0, trainable_graph=index % 3 == 0,
                 max_output_bytes=MAX_OUTPUT_BYTES, overwrite=True)


def worker(directory: str, start: int) -> None:
    """Run the corpus from case ``start``, one JSON line per case start and outcome."""
    if not os.path.exists(os.path.join(directory, "model.meta")):
        _build_seeds(directory)
    cases = _corpus(directory)
    out = os.path.join(directory, "out", "m")

    def run_one(index, case) -> None:
        _, seed, data = case
        _run_case(index, _place(directory, seed, data), out)

    run_cases(cases, start, CASE_SECONDS, run_one)


# ------------------------------------------------------------------ the test


@pytest.mark.slow
def test_damaged_graph_files_load_or_raise_restorekit_errors(tmp_path):
    total, base_rss, finished, failures = run_all(__file__, tmp_path, env={"TF_CPP_MIN_LOG_LEVEL": "3"})
    outcomes = outcome_counts(finished)
    peak_rss = max(((line["rss"], line["name"]) for line in finished), default=(0, None))
    assert total >= 250
    assert not failures, "\n".join(failures)
    grown = peak_rss[0] - base_rss
    assert grown < RSS_GROWTH_LIMIT, f"case {peak_rss[1]}: peak RSS grew by {grown >> 20} MiB"
    assert outcomes.get("error", 0) > total // 3 and outcomes.get("ok", 0) > 0, outcomes


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
