"""Tests for restorekit/graph/_repairs.py: the repaired graph of an old TF 1.x file, as a proto and imported."""

import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import meta_graph_pb2

from restorekit.errors import OutputExistsError
from restorekit.graph import import_meta_graph, inspect_graph, repair_graph
from test_graph import _corrupt_like_old_tf, _run, make_net

tf1 = tf.compat.v1


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    return make_net(True, tmp_path_factory.mktemp("net"))


@pytest.fixture
def old_meta(net, tmp_path):
    """The net's .meta as an old TF wrote it: stale shapes, an unknown attr, stale colocation."""
    meta_graph = meta_graph_pb2.MetaGraphDef.FromString(open(net.meta, "rb").read())
    path = tmp_path / "old.meta"
    path.write_bytes(_corrupt_like_old_tf(meta_graph).SerializeToString())
    with tf.Graph().as_default(), pytest.raises(ValueError):
        tf1.train.import_meta_graph(str(path))
    return path


def test_repair_graph_returns_a_meta_graph_that_tensorflow_imports(net, old_meta):
    before = old_meta.read_bytes()

    repaired = repair_graph(str(old_meta))

    assert isinstance(repaired, meta_graph_pb2.MetaGraphDef)
    matmul = next(n for n in repaired.graph_def.node if n.name == "net/fc/MatMul")
    assert "use_cudnn_legacy" not in matmul.attr and "_output_shapes" not in matmul.attr
    with tf.Graph().as_default():
        saver = tf1.train.import_meta_graph(repaired)
        with tf1.Session() as sess:
            saver.restore(sess, net.prefix)
            np.testing.assert_array_equal(sess.run("y:0", {"x:0": net.inputs}), net.outputs)
    assert old_meta.read_bytes() == before  # the source is never rewritten
    assert inspect_graph(repaired).repaired == ()  # nothing left to repair


@pytest.mark.parametrize("name, text", [("fixed.meta", False), ("fixed.metatxt", True)], ids=["binary", "text"])
def test_repair_graph_writes_out(old_meta, tmp_path, name, text):
    out = tmp_path / name

    repaired = repair_graph(str(old_meta), out=str(out))

    if text:
        on_disk = text_format.Parse(out.read_text(), meta_graph_pb2.MetaGraphDef())
    else:
        on_disk = meta_graph_pb2.MetaGraphDef.FromString(out.read_bytes())
    assert on_disk == repaired
    with tf.Graph().as_default():
        tf1.train.import_meta_graph(str(out))


def test_repair_graph_of_a_graph_def_is_a_graph_def(net):
    repaired = repair_graph(net.graph_def)

    assert isinstance(repaired, tf1.GraphDef)
    np.testing.assert_array_equal(_run(repaired, net.inputs, "x:0"), net.inputs)


def test_repair_graph_refuses_an_existing_out_and_the_source(old_meta, tmp_path):
    out = tmp_path / "fixed.meta"
    out.write_bytes(b"keep me")

    with pytest.raises(OutputExistsError) as info:
        repair_graph(str(old_meta), out=str(out))
    assert info.value.path == str(out) and not info.value.is_source
    assert out.read_bytes() == b"keep me"

    before = old_meta.read_bytes()
    with pytest.raises(OutputExistsError) as info:
        repair_graph(str(old_meta), out=str(old_meta), overwrite=True)
    assert info.value.is_source
    assert old_meta.read_bytes() == before

    repair_graph(str(old_meta), out=str(out), overwrite=True)
    assert meta_graph_pb2.MetaGraphDef.FromString(out.read_bytes()).graph_def.node


def test_import_meta_graph_repairs_then_imports_and_returns_the_saver(net, old_meta):
    with tf.Graph().as_default() as g:
        saver = import_meta_graph(str(old_meta), import_scope="old", clear_devices=True)

        assert isinstance(saver, tf1.train.Saver)
        assert g.get_tensor_by_name("old/y:0") is not None
        with tf1.Session() as sess:
            saver.restore(sess, net.prefix)
            outputs = sess.run("old/y:0", {"old/x:0": net.inputs})
    np.testing.assert_array_equal(outputs, net.outputs)


# ------------------------------------------------------------------ the CLI over repairs (issue 14 item 7)

def test_cli_scan_and_graph_repair_handle_an_old_tf1_meta(net, old_meta, tmp_path, capsys):
    from restorekit._checkpoint import Checkpoint
    from restorekit.cli import main

    prefix = Checkpoint(net.prefix).prefix
    assert main(["scan", prefix, "--meta-graph", str(old_meta)]) == 0  # every variable restores
    out, _ = capsys.readouterr()
    assert out.startswith("restorekit: ") and "missing        0" in out
    assert main(["graph", "repair", str(old_meta), str(tmp_path / "fixed.meta")]) == 0
    with tf.Graph().as_default():
        tf1.train.import_meta_graph(str(tmp_path / "fixed.meta"))  # loads as it is now
    assert main(["graph", "repair", str(old_meta), str(tmp_path / "fixed.meta")]) == 3  # exists
    _, err = capsys.readouterr()
    assert "pass --overwrite to replace it" in err


def test_cli_scan_with_an_index_file_as_meta_graph_says_what_to_pass(net, capsys):
    from restorekit._checkpoint import Checkpoint
    from restorekit.cli import main

    prefix = Checkpoint(net.prefix).prefix
    assert main(["scan", prefix, "--meta-graph", prefix + ".index"]) == 3
    _, err = capsys.readouterr()
    assert "is a checkpoint file; pass the '.meta'" in err and "Traceback" not in err
