"""Run by tests/test_flax_target.py in a subprocess where TensorFlow cannot be imported (issue 36 item 3).

``python flax_cases.py DIR``: build the Flax NNX twins of the nets whose checkpoints and
outputs ``DIR`` holds (written by TensorFlow and Keras), scan and restore them from each
source, compute their outputs, and print what happened as one ``RESULT {json}`` line.
"""

import json
import os
import sys

import numpy as np


class Net:
    """The twin: conv (SAME, HWIO) -> BatchNorm (inference) -> relu -> flatten (NHWC order) -> fc."""

    @staticmethod
    def build(head: int = 7, conv_dtype=None):
        from flax import nnx

        class _Net(nnx.Module):
            def __init__(self, rngs):
                kwargs = {} if conv_dtype is None else {"param_dtype": conv_dtype}
                self.conv = nnx.Conv(3, 4, (3, 3), padding="SAME", rngs=rngs, **kwargs)
                self.bn = nnx.BatchNorm(4, epsilon=1e-3, rngs=rngs)
                self.fc = nnx.Linear(100, head, rngs=rngs)

            def __call__(self, x):
                h = nnx.relu(self.bn(self.conv(x), use_running_average=True))
                return self.fc(h.reshape(h.shape[0], -1))

        return _Net(nnx.Rngs(0))


def _values(module) -> dict:
    from flax import nnx

    return {"/".join(map(str, path)): np.asarray(v.get_value()).copy()
            for path, v in nnx.iter_graph(module) if isinstance(v, nnx.Variable)}


def _unchanged(module, before: dict) -> bool:
    return all(np.array_equal(v, before[k]) for k, v in _values(module).items())


def _error(call) -> str:
    try:
        call()
    except Exception as e:  # noqa: BLE001  (its class name is the result)
        return type(e).__name__
    return "none"


def outputs(directory: str, io: dict) -> dict:
    """Every source restored into the twin; its outputs saved; the report of each."""
    import restorekit

    out = {}
    x = np.load(os.path.join(directory, "io.npz"))["x"]
    for case, path in io.items():
        model = Net.build()
        report = restorekit.scan(os.path.join(directory, path), model, rules=restorekit.FLAX_FROM_TF)
        restorekit.restore(report)
        np.save(os.path.join(directory, f"flax-{case}.npy"), np.asarray(model(x)))
        out[case] = report.to_dict()
    return out


def mismatched_head(directory: str) -> dict:
    import restorekit

    model = Net.build(head=5)
    before = _values(model)
    prefix = os.path.join(directory, "tf1", "model.ckpt")
    plain = restorekit.scan(prefix, model)  # by name alone: TF's leaf names are missing, and a hint says so
    report = restorekit.scan(prefix, model, rules=restorekit.FLAX_FROM_TF)
    strict = _error(lambda: restorekit.restore(report, strict=True))
    untouched_by_strict = _unchanged(model, before)
    restorekit.restore(report)
    after = _values(model)
    return {"plain": plain.to_dict(), "report": report.to_dict(), "strict": strict,
            "untouched_by_strict": untouched_by_strict,
            "head_untouched": all(np.array_equal(after[k], before[k]) for k in ("fc/kernel", "fc/bias")),
            "conv_restored": bool(np.array_equal(after["conv/kernel"], np.load(os.path.join(directory, "io.npz"))["conv"])),
            "text": str(report)}


def bad_values(directory: str) -> dict:
    import restorekit

    prefix = os.path.join(directory, "tf1", "model.ckpt")
    out = {}
    # A float16 conv: reported dtype_mismatched, not written; dtype_policy='cast' restores it cast.
    model = Net.build(conv_dtype="float16")
    before = _values(model)
    report = restorekit.scan(prefix, model, rules=restorekit.FLAX_FROM_TF)
    restorekit.restore(report)
    out["dtype_mismatched"] = [r.variable_name for r in report.dtype_mismatched]
    out["float16_conv_untouched"] = bool(np.array_equal(_values(model)["conv/kernel"], before["conv/kernel"]))
    restorekit.restore(restorekit.scan(prefix, model, rules=restorekit.FLAX_FROM_TF, dtype_policy="cast"))
    conv = _values(model)["conv/kernel"]
    out["cast"] = [str(conv.dtype), bool(np.array_equal(conv, np.load(os.path.join(directory, "io.npz"))["conv"]
                                                        .astype("float16")))]
    # A flipped byte in the tensor stored last: refused before any Variable is set.
    model = Net.build()
    before = _values(model)
    report = restorekit.scan(os.path.join(directory, "tf1_corrupt", "model.ckpt"), model, rules=restorekit.FLAX_FROM_TF)
    out["corrupt"] = [_error(lambda: restorekit.restore(report)), _unchanged(model, before)]
    # A head's shape policy that returns a value of neither shape: nothing is set, the matches before it neither.
    model = Net.build(head=5)
    before = _values(model)
    report = restorekit.scan(prefix, model, rules=restorekit.FLAX_FROM_TF,
                             shape_policy={"fc/kernel": lambda value, variable: value[:, :3]})
    out["bad_policy"] = [_error(lambda: restorekit.restore(report)), _unchanged(model, before)]
    return out


def partitions() -> dict:
    """grouped_optax: the frozen conv stays, fc moves at 10x the rate of the default group, one SGD step."""
    import jax
    import optax
    from flax import nnx

    import restorekit

    model = Net.build()
    before = _values(model)
    tx = restorekit.grouped_optax(lambda m: optax.sgd(0.1 * m), model, {"conv": 0, "fc": 10.0})
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = np.random.default_rng(1).standard_normal((2, 5, 5, 3)).astype("float32")
    grads = nnx.grad(lambda m: (m(x) ** 2).sum())(model)
    flat = {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}
    optimizer.update(model, grads)
    after = _values(model)
    # the step each group took, as a multiple of its gradient: -lr * multiplier
    rate = {k: float(np.median((after[k] - before[k])[flat[k] != 0] / flat[k][flat[k] != 0]))
            for k in ("fc/kernel", "bn/scale")}
    labels = restorekit.optax_partitions(model, {"conv": 0, "fc": 10.0})
    return {"conv_unchanged": bool(np.array_equal(after["conv/kernel"], before["conv/kernel"])
                                   and np.array_equal(after["conv/bias"], before["conv/bias"])),
            "rate": rate, "labels": {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(labels)},
            "batch_stats_unchanged": bool(np.array_equal(after["bn/mean"], before["bn/mean"])),
            "jax": jax.__version__}


def main(directory: str) -> None:
    with open(os.path.join(directory, "spec.json")) as f:
        spec = json.load(f)
    out = {"outputs": outputs(directory, spec["io"]), "mismatched_head": mismatched_head(directory),
           "bad_values": bad_values(directory), "partitions": partitions()}
    out["tensorflow_imported"] = "tensorflow" in sys.modules
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
