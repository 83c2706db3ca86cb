"""restorekit.formats.onnx: ONNX models as a Source, checked against onnx's own decoder.

The models are built with ``onnx.helper`` (and saved with external data by
``onnx.save_model(..., save_as_external_data=True)``); every value restorekit reads or
writes is compared bit for bit with ``onnx.numpy_helper.to_array`` of the same tensor,
and every output is read back by its own framework's loader (TensorFlow, numpy,
safetensors' header).
"""

import json
import os
import struct
import sys

import ml_dtypes
import numpy as np
import onnx
import pytest
import tensorflow as tf
from onnx import TensorProto, helper, numpy_helper

import restorekit
from restorekit import formats
from restorekit.cli import main
from restorekit.errors import CorruptCheckpointError, ExternalDataError, MissingDependencyError
from restorekit.export import convert

from conftest import import_torch, requires_torch

RNG = np.random.default_rng(7)


def _info(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _const(output, array):
    return helper.make_node("Constant", [], [output], value=numpy_helper.from_array(array, output + "_value"))


def _model(scale: float = 1.0, *, weights_in_subgraphs_only: bool = False):
    """A model with every place a weight can sit: float32 / float16 / bfloat16 initializers, an int8 weight with
    its Q/DQ scale and zero point, Constant nodes in both If branches, in a Loop body and in an If inside it."""
    w = (RNG.standard_normal((3, 4)) * scale).astype(np.float32)
    inits = [] if weights_in_subgraphs_only else [
        numpy_helper.from_array(w, "fc.weight"),
        numpy_helper.from_array((np.arange(4) * scale).astype(np.float16), "fc.bias_fp16"),
        numpy_helper.from_array((np.linspace(-2, 2, 6) * scale).astype(ml_dtypes.bfloat16).reshape(2, 3), "emb.bf16"),
        numpy_helper.from_array(np.array([[-128, 0, 5], [127, -3, 9]], np.int8), "q.weight"),
        numpy_helper.from_array(np.array(0.02 * scale, np.float32), "q.scale"),
        numpy_helper.from_array(np.array(3, np.int8), "q.zero_point"),
    ]
    then_g = helper.make_graph([_const("then_w", np.full((2, 2), 3.5 * scale, np.float32))], "then", [],
                               [_info("then_w", TensorProto.FLOAT, [2, 2])])
    else_g = helper.make_graph([helper.make_node("Constant", [], ["else_w"], value_floats=[1.0 * scale, 2.0, 0.5, -1]),
                                helper.make_node("Constant", [], ["else_shape"], value_ints=[2, 2]),
                                helper.make_node("Reshape", ["else_w", "else_shape"], ["else_y"])],
                               "else", [], [_info("else_y", TensorProto.FLOAT, [2, 2])])
    inner_then = helper.make_graph([_const("inner_w", (np.arange(6, dtype=np.float16) * scale).reshape(3, 2))],
                                   "inner_then", [], [_info("inner_w", TensorProto.FLOAT16, [3, 2])])
    inner_else = helper.make_graph([_const("inner_other", np.zeros((3, 2), np.float16))],
                                   "inner_else", [], [_info("inner_other", TensorProto.FLOAT16, [3, 2])])
    body = helper.make_graph(
        [_const("step", np.array([scale], np.float32)),
         helper.make_node("Add", ["acc_in", "step"], ["acc_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("If", ["cond_in"], ["inner_y"], then_branch=inner_then, else_branch=inner_else, name="inner")],
        "body", [_info("i", TensorProto.INT64, []), _info("cond_in", TensorProto.BOOL, []),
                 _info("acc_in", TensorProto.FLOAT, [1])],
        [_info("cond_out", TensorProto.BOOL, []), _info("acc_out", TensorProto.FLOAT, [1]),
         _info("inner_y", TensorProto.FLOAT16, [3, 2])])
    nodes = [
        helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g, name="branch"),
        helper.make_node("Loop", ["n", "c", "acc0"], ["acc", "inner_ys"], body=body, name="loop"),
    ]
    outputs = [_info("y", TensorProto.FLOAT, [2, 2]), _info("acc", TensorProto.FLOAT, [1]),
               _info("inner_ys", TensorProto.FLOAT16, ["n", 3, 2])]
    if not weights_in_subgraphs_only:
        nodes += [helper.make_node("MatMul", ["x", "fc.weight"], ["z"]),
                  helper.make_node("DequantizeLinear", ["q.weight", "q.scale", "q.zero_point"], ["dq"])]
        outputs += [_info("z", TensorProto.FLOAT, [1, 4]), _info("dq", TensorProto.FLOAT, [2, 3])]
    graph = helper.make_graph(nodes, "g", [_info("x", TensorProto.FLOAT, [1, 3]), _info("c", TensorProto.BOOL, []),
                                           _info("n", TensorProto.INT64, []), _info("acc0", TensorProto.FLOAT, [1])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(model, full_check=True)
    return model


SUBGRAPH_NAMES = {"then_w", "else_w", "else_shape", "step", "inner_w", "inner_other"}
MAIN_NAMES = {"fc.weight", "fc.bias_fp16", "emb.bf16", "q.weight", "q.scale", "q.zero_point"}


def _save(model, path, external: bool):
    path.parent.mkdir(parents=True, exist_ok=True)
    if external:  # every tensor, Constant values too, in one data file beside the model
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="weights.bin", size_threshold=0, convert_attribute=True)
    else:
        onnx.save_model(model, str(path))
    return path


def _expected(path):
    """Every stored tensor by onnx's own decoder (external data loaded by onnx itself): name -> array."""
    model = onnx.load(str(path))
    out = {}

    def walk(graph):
        for t in graph.initializer:
            out[t.name] = numpy_helper.to_array(t)
        for node in graph.node:
            if node.op_type == "Constant":
                attr = node.attribute[0]
                kind = {"value_floats": np.float32, "value_ints": np.int64}.get(attr.name)
                out[node.output[0]] = (numpy_helper.to_array(attr.t) if attr.name == "value"
                                       else np.array(helper.get_attribute_value(attr), kind))
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)

    walk(model.graph)
    return out


def _same(actual, expected, name=""):
    """Equal bit for bit, dtype included."""
    actual = np.asarray(actual)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (name, actual.dtype, expected.dtype)
    assert actual.tobytes() == expected.tobytes(), name


STORAGE = [pytest.param(False, id="embedded"), pytest.param(True, id="external_data")]


@pytest.mark.parametrize("external", STORAGE)
def test_every_initializer_and_constant_reads_back_exactly_as_onnx_decodes_it(tmp_path, external):
    path = _save(_model(), tmp_path / "m" / "model.onnx", external)
    if external:
        assert (tmp_path / "m" / "weights.bin").stat().st_size > 0
        assert all(i.data_location == TensorProto.EXTERNAL for i in onnx.load(str(path), load_external_data=False)
                   .graph.initializer)
    expected = _expected(path)
    assert set(expected) == MAIN_NAMES | SUBGRAPH_NAMES

    src = formats.open(path)

    assert formats.detect(path) == "onnx" and src.format == "onnx"
    assert set(src.entries) == set(expected)
    for name, value in expected.items():
        entry = src.entries[name]
        assert entry.shape == value.shape and entry.nbytes == value.nbytes
        _same(src.read(name), value, name)
    assert src.entries["emb.bf16"].dtype == "bfloat16" and src.entries["fc.bias_fp16"].dtype == "float16"
    assert src.entries["q.weight"].dtype == "int8" and src.entries["q.zero_point"].dtype == "int8"
    assert src.verify().ok
    files = src.reader.files
    assert files == ((str(path), str(tmp_path / "m" / "weights.bin")) if external else (str(path),))


def _safetensors_arrays(path):
    """A .safetensors file by its format's spec: 8-byte header length, JSON header, little-endian bytes."""
    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I8": np.int8, "I64": np.int64}
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return {name: np.frombuffer(data[8 + n + info["data_offsets"][0]:8 + n + info["data_offsets"][1]],
                                dtypes[info["dtype"]]).reshape(info["shape"]) for name, info in header.items()}


def _npz_arrays(path):
    with np.load(path, allow_pickle=False) as data:  # bfloat16 is stored as its bits, as the npz writer documents
        return {n: data[n].view(ml_dtypes.bfloat16) if n == "emb.bf16" else data[n] for n in data.files
                if n != "__restorekit__"}


def _tf_arrays(prefix):
    reader = tf.train.load_checkpoint(str(prefix))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


TARGETS = [
    pytest.param("m.safetensors", _safetensors_arrays, id="safetensors"),
    pytest.param("m.npz", _npz_arrays, id="npz"),
    pytest.param("tf/model.ckpt", _tf_arrays, id="tf"),
]


@pytest.mark.parametrize("external", STORAGE)
@pytest.mark.parametrize("out_name,load", TARGETS)
def test_convert_writes_every_value_bit_exact(tmp_path, external, out_name, load):
    path = _save(_model(), tmp_path / "m" / "model.onnx", external)
    out = tmp_path / "out" / out_name
    out.parent.mkdir(parents=True, exist_ok=True)

    result = convert(path, out)

    written = load(out)
    expected = _expected(path)
    assert set(written) == set(expected) and result.count == len(expected)
    for name, value in expected.items():
        # the Constant of a value_floats attribute is float32 as ONNX defines it
        _same(written[name], value, name)


def test_cli_convert_and_inspect_of_an_onnx_model(tmp_path, capsys):
    """Issue 39 finding 2 / 40 item 4: `convert model.onnx out.safetensors` said 'no checkpoint at'."""
    path = _save(_model(), tmp_path / "model.onnx", external=False)
    code = main(["convert", str(path), str(tmp_path / "out.safetensors")])
    out, err = capsys.readouterr()
    assert code == 0 and err == "" and "wrote 12 tensors" in out
    assert main(["inspect", str(path), "--tensor", "inner_w"]) == 0
    out, _ = capsys.readouterr()
    assert out.splitlines()[0] == "inner_w [3, 2] float16"
    assert main(["inspect", str(path), "--stats", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["entries"]}
    assert rows["then_w"]["stats"]["max"] == 3.5 and rows["q.weight"]["stats"]["min"] == -128


def test_inspect_counts_tensors_in_subgraphs_and_lists_their_ops(tmp_path, capsys):
    """Issue 39 finding 4: a model whose weights all sit in If / Loop bodies showed 'tensors: 0'."""
    path = _save(_model(weights_in_subgraphs_only=True), tmp_path / "vad.onnx", external=False)

    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  ops: If x1, Loop x1" in out
    assert "  ops in subgraphs: Add x1, Constant x6, Identity x1, If x1, Reshape x1" in out
    assert "  tensors: 6, 76 B" in out
    assert main(["inspect", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {t["name"] for t in data["tensors"]} == SUBGRAPH_NAMES
    assert data["subgraph_ops"] == {"Constant": 6, "Add": 1, "Identity": 1, "If": 1, "Reshape": 1}


def test_diff_and_average_take_two_onnx_models(tmp_path, capsys):
    a = _save(_model(1.0), tmp_path / "a" / "model.onnx", external=True)
    b = _save(_model(3.0), tmp_path / "b.onnx", external=False)

    assert main(["diff", str(a), str(a)]) == 0
    capsys.readouterr()
    assert main(["diff", str(a), str(b), "--json"]) == 1
    changed = {r["name"] for r in json.loads(capsys.readouterr().out)["values"]}
    assert changed == {"fc.weight", "fc.bias_fp16", "emb.bf16", "q.scale", "then_w", "else_w", "step", "inner_w"}

    result = restorekit.average([a, b], tmp_path / "avg.npz")

    ea, eb = _expected(a), _expected(b)
    averaged = _npz_arrays(tmp_path / "avg.npz")
    for name in ("then_w", "step", "q.scale"):  # float32: the plain mean
        np.testing.assert_array_equal(averaged[name], (ea[name] + eb[name]) / 2)
    np.testing.assert_array_equal(averaged["q.weight"], ea["q.weight"])  # int8, equal in both: copied
    assert "q.weight" in result.copied


@requires_torch
def test_scan_and_restore_a_torch_module_from_an_onnx_model(tmp_path):
    torch = import_torch()
    path = _save(_model(), tmp_path / "model.onnx", external=True)
    module = torch.nn.Module()
    module.fc = torch.nn.Linear(4, 3, bias=False)  # torch keeps the transpose of ONNX's MatMul weight: 3 x 4 here
    report = restorekit.scan(path, module)
    assert [r.checkpoint_name for r in report.matched] == ["fc.weight"]

    restorekit.restore(report)

    np.testing.assert_array_equal(module.fc.weight.detach().numpy(), _expected(path)["fc.weight"])


# ------------------------------------------------------------------ external data: only inside the model's directory


def _relocate(path, location):
    """Point every external tensor of the model at ``location`` (the data itself is left where it is)."""
    model = onnx.load(str(path), load_external_data=False)
    tensors = list(model.graph.initializer)
    for tensor in tensors:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save_model(model, str(path))


OUTSIDE = [
    pytest.param(lambda d: "../weights.bin", id="dot_dot"),
    pytest.param(lambda d: "sub/../../weights.bin", id="dot_dot_inside_a_path"),
    pytest.param(lambda d: str(d / "weights.bin"), id="absolute"),
    pytest.param(lambda d: "link/weights.bin", id="symlink_out"),
]


@pytest.mark.parametrize("location", OUTSIDE)
@pytest.mark.parametrize("verb", ["convert", "inspect", "open"])
def test_external_data_outside_the_model_directory_is_refused_and_nothing_is_written(tmp_path, capsys, location, verb):
    outside = tmp_path / "elsewhere"
    built = _save(_model(), outside / "built.onnx", external=True)  # weights.bin, with the right bytes, outside
    model_dir = tmp_path / "models"
    model_dir.mkdir()
    os.symlink(outside, model_dir / "link")
    path = model_dir / "model.onnx"
    path.write_bytes(built.read_bytes())
    _relocate(path, location(outside))
    out = tmp_path / "out"
    out.mkdir()

    if verb == "open":
        with pytest.raises(ExternalDataError, match=r"keeps its data in .*not a file inside the model's directory"):
            formats.open(path)
        with pytest.raises(ExternalDataError):
            convert(path, out / "m.npz")
    else:
        argv = [verb, str(path)] + ([str(out / "m.safetensors")] if verb == "convert" else [])
        assert main(argv) == 3
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1
        assert "restorekit: error: " in captured.err and "inside the model's directory" in captured.err
    assert os.listdir(out) == []


def test_external_data_of_the_wrong_length_or_missing_is_refused(tmp_path):
    path = _save(_model(), tmp_path / "model.onnx", external=True)
    data = (tmp_path / "weights.bin").read_bytes()
    (tmp_path / "weights.bin").write_bytes(data[:-4])
    with pytest.raises(CorruptCheckpointError, match=r"lie outside its \d+ bytes"):
        formats.open(path)
    os.remove(tmp_path / "weights.bin")
    with pytest.raises(CorruptCheckpointError, match="which is not beside the model"):
        convert(path, tmp_path / "m.npz")
    assert not (tmp_path / "m.npz").exists()


def test_a_truncated_model_is_a_corrupt_checkpoint_error(tmp_path):
    path = _save(_model(), tmp_path / "model.onnx", external=False)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CorruptCheckpointError, match="is not a readable ONNX model"):
        convert(path, tmp_path / "m.npz")
    assert not (tmp_path / "m.npz").exists()


def test_without_onnx_installed_the_error_names_the_extra(tmp_path, monkeypatch):
    path = _save(_model(), tmp_path / "model.onnx", external=False)
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'restorekit\[onnx\]'"):
        convert(path, tmp_path / "m.npz")
    assert not (tmp_path / "m.npz").exists()
