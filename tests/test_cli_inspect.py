"""``restorekit inspect`` of a file restorekit wrote with a layout: stored names by default, --tf-names for TF's (issue 39)."""

import json

import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit.cli import EXIT_OK, main


class _Conv(tf.Module):
    def __init__(self):
        super().__init__()
        self.kernel = tf.Variable(np.arange(3 * 3 * 3 * 4, dtype=np.float32).reshape(3, 3, 3, 4))
        self.bias = tf.Variable(np.arange(4, dtype=np.float32))


@pytest.fixture
def torch_layout_file(tmp_path):
    prefix = tf.train.Checkpoint(conv=_Conv()).write(str(tmp_path / "tf" / "ckpt"))
    out = tmp_path / "m.safetensors"
    restorekit.convert(prefix, out, layout="torch", progress=False)
    return out


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == EXIT_OK, err
    return out


def test_inspect_lists_the_stored_names_and_shapes_by_default(capsys, torch_layout_file):
    from safetensors import safe_open

    with safe_open(str(torch_layout_file), "np") as f:  # the format's own reader: what the file holds
        stored = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    assert stored == {"conv.weight": [4, 3, 3, 3], "conv.bias": [4]}
    out = run(capsys, "inspect", torch_layout_file)
    rows = {line.split()[0]: line for line in out.splitlines()[1:-1]}
    assert set(rows) == {"conv.weight", "conv.bias"}
    assert "[4, 3, 3, 3]" in rows["conv.weight"] and "conv/kernel/.ATTRIBUTES/VARIABLE_VALUE  [3, 3, 3, 4]" in rows[
        "conv.weight"]
    assert out.splitlines()[0].split()[:2] == ["NAME", "SHAPE"] and "TF NAME" in out.splitlines()[0]
    assert "--tf-names for the TF view" in out.splitlines()[-1]


def test_inspect_tf_names_lists_the_tf_view_beside_the_stored_names(capsys, torch_layout_file):
    out = run(capsys, "inspect", torch_layout_file, "--tf-names")
    kernel = next(line for line in out.splitlines() if line.startswith("conv/kernel "))
    assert kernel.split()[1:2] == ["conv/kernel/.ATTRIBUTES/VARIABLE_VALUE"]
    assert "[3, 3, 3, 4]" in kernel and kernel.rstrip().endswith("conv.weight  [4, 3, 3, 3]")
    assert "STORED NAME" in out.splitlines()[0]


@pytest.mark.parametrize("tf_names", [False, True], ids=["stored-view", "tf-view"])
def test_inspect_json_carries_both_names_and_shapes(capsys, torch_layout_file, tf_names):
    data = json.loads(run(capsys, "inspect", torch_layout_file, "--json", *(["--tf-names"] if tf_names else [])))
    rows = {r["name"]: r for r in data["entries"]}
    if tf_names:
        assert data["names"] == "tf"
        kernel = rows["conv/kernel/.ATTRIBUTES/VARIABLE_VALUE"]
        assert (kernel["shape"], kernel["stored_name"], kernel["stored_shape"]) == ([3, 3, 3, 4], "conv.weight",
                                                                                      [4, 3, 3, 3])
    else:
        assert data["names"] == "stored" and set(rows) == {"conv.weight", "conv.bias"}
        kernel = rows["conv.weight"]
        assert (kernel["shape"], kernel["tf_name"], kernel["tf_shape"]) == (
            [4, 3, 3, 3], "conv/kernel/.ATTRIBUTES/VARIABLE_VALUE", [3, 3, 3, 4])


def test_inspect_tensor_takes_a_stored_name_or_a_tf_path(capsys, torch_layout_file):
    stored = run(capsys, "inspect", torch_layout_file, "--tensor", "conv.weight", "--json")
    tf_view = run(capsys, "inspect", torch_layout_file, "--tensor", "conv/kernel", "--json")
    kernel = np.arange(3 * 3 * 3 * 4, dtype=np.float32).reshape(3, 3, 3, 4)
    np.testing.assert_array_equal(np.array(json.loads(stored)["values"]), kernel.transpose(3, 2, 0, 1))
    np.testing.assert_array_equal(np.array(json.loads(tf_view)["values"]), kernel)
