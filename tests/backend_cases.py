"""Run by tests/test_backends.py in a subprocess where TensorFlow cannot be imported (issue 24).

``python backend_cases.py DIR``: with ``KERAS_BACKEND`` set to 'jax' or 'torch', warm-start
the model described in ``DIR/spec.json`` from each checkpoint there, write the restored
weights to ``DIR/<backend>-<case>.npz`` and the reports to stdout as JSON. With torch, also
restore a torch twin of the TF1 conv/BN/dense net and save its outputs.
"""

import json
import os
import sys

import numpy as np


def _model(keras, head_units: int, head_name: str):
    inputs = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="relu", name="body")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    return keras.Model(inputs, keras.layers.Dense(head_units, name=head_name)(h), name="net")


def keras_cases(directory: str, spec: dict) -> dict:
    import keras

    import restorekit

    out = {}
    for case, (path, options) in spec["cases"].items():
        keras.utils.set_random_seed(7)
        model = _model(keras, spec["head_units"], spec["head_name"])
        before = {v.path: v.numpy() for v in model.variables}
        report = restorekit.scan(os.path.join(directory, path), model, **_options(restorekit, options))
        restorekit.restore(report)
        after = {v.path: v.numpy() for v in model.variables}
        np.savez(os.path.join(directory, f"{keras.config.backend()}-{case}.npz"),
                 **{"before/" + k: v for k, v in before.items()}, **{"after/" + k: v for k, v in after.items()})
        out[case] = report.to_dict()
    # A flipped byte in the tensor stored last: refused before any variable changes.
    model = _model(keras, spec["head_units"], spec["head_name"])
    before = {v.path: v.numpy() for v in model.variables}
    try:
        restorekit.restore(restorekit.scan(os.path.join(directory, spec["corrupt"]), model, rules=restorekit.KERAS_FROM_TF1))
        raised = None
    except restorekit.CorruptCheckpointError as e:
        raised = type(e).__name__
    out["corrupt"] = {"raised": raised, "unchanged": all(np.array_equal(v.numpy(), before[v.path]) for v in model.variables)}
    # WarmStart as a fit callback beside BackupAndRestore: warm-starts, then a rerun resumes from the backup.
    keras.utils.set_random_seed(7)
    model = _model(keras, spec["head_units"], spec["head_name"])
    model.compile(optimizer="sgd", loss="mse")
    backup = os.path.join(directory, f"backup-{keras.config.backend()}")
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((4, 6)).astype("float32"), rng.standard_normal((4, spec["head_units"])).astype("float32")
    warm = restorekit.WarmStart(os.path.join(directory, spec["cases"]["tf1"][0]), backup_dir=backup, verbose=0,
                                **_options(restorekit, spec["cases"]["tf1"][1]))
    batch_begin = {}

    class Peek(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0 and not batch_begin:
                batch_begin.update({v.path: v.numpy() for v in self.model.weights})

    model.fit(x, y, epochs=1, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup), warm, Peek()])
    np.savez(os.path.join(directory, f"{keras.config.backend()}-fit.npz"), **batch_begin)
    out["fit"] = {"how": warm.start.how, "matched": len(warm.start.report.matched)}
    out["resumed"] = interrupted_then_resumed(keras, restorekit, spec, directory, x, y)
    out["groups"] = grouped_fit(keras, restorekit, spec, x, y)
    return out


def interrupted_then_resumed(keras, restorekit, spec: dict, directory: str, x, y) -> str:
    """A run warm-started and preempted after its first epoch, then restarted: how the restart began."""
    backup = os.path.join(directory, f"preempted-{keras.config.backend()}")
    pretrained = os.path.join(directory, spec["cases"]["h5"][0])

    class Preempt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise KeyboardInterrupt  # after BackupAndRestore (listed first) saved the epoch

    model = _model(keras, spec["head_units"], spec["head_name"])
    model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(x, y, epochs=2, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup),
                                                        restorekit.WarmStart(pretrained, backup_dir=backup, verbose=0),
                                                        Preempt()])
    except KeyboardInterrupt:
        pass
    model = _model(keras, spec["head_units"], spec["head_name"])
    model.compile(optimizer="sgd", loss="mse")
    restart = restorekit.WarmStart(os.path.join(directory, "gone.weights.h5"), backup_dir=backup, verbose=0)
    model.fit(x, y, epochs=2, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup), restart])
    return restart.start.how


def grouped_fit(keras, restorekit, spec: dict, x, y) -> dict:
    """One SGD step with the body frozen and the head at 10x: which variables moved, and by how much."""
    keras.utils.set_random_seed(7)
    model = _model(keras, spec["head_units"], spec["head_name"])
    groups = restorekit.group_variables({"body": 0, spec["head_name"]: 10.0}, model)
    model.compile(optimizer=restorekit.grouped_keras_optimizer(lambda m: keras.optimizers.SGD(0.01 * m), groups),
                  loss="mse")
    before = {v.path: v.numpy() for v in model.trainable_variables}
    model.fit(x, y, epochs=1, batch_size=len(x), verbose=0)
    moved = {v.path: float(np.abs(v.numpy() - before[v.path]).max()) for v in model.trainable_variables}
    return {"frozen": groups.groups[0].variables, "moved": moved}


def _options(restorekit, options: dict) -> dict:
    """JSON options as scan takes them: the string 'KERAS_FROM_TF1' (alone or in a rules list) is the rule set."""
    def rule(item):
        return restorekit.KERAS_FROM_TF1 if item == "KERAS_FROM_TF1" else tuple(item) if isinstance(item, list) else item

    def policy(item):  # ["ResizePositions", {...}] -> restorekit.ResizePositions(...)
        return getattr(restorekit, item[0])(**item[1]) if isinstance(item, list) else item

    def option(k, v):
        if k == "shape_policy" and isinstance(v, dict):
            return {name: policy(p) for name, p in v.items()}
        return [rule(i) for i in v] if k == "rules" and isinstance(v, list) else rule(v)

    return {k: option(k, v) for k, v in options.items()}


def torch_twin(directory: str) -> dict:
    import torch

    import restorekit

    class Twin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(4, eps=1e-3)
            self.fc = torch.nn.Linear(4 * 5 * 5, 7)
            self.logits = torch.nn.Linear(7, 2)  # the new head: not in the checkpoint

        def forward(self, x):  # x NCHW; flatten as TF does (NHWC)
            h = torch.relu(self.bn(self.conv(x)))
            return self.fc(h.permute(0, 2, 3, 1).reshape(x.shape[0], -1))

    torch.manual_seed(0)
    twin = Twin().eval()
    head = twin.logits.weight.detach().clone()
    report = restorekit.scan(os.path.join(directory, "convnet", "model.ckpt"), twin, layout="torch")
    restorekit.restore(report)
    x = np.load(os.path.join(directory, "convnet-io.npz"))["x"]
    with torch.no_grad():
        y = twin(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
    # The same net for one-channel images: its first kernel adapted from the RGB one, in numpy.
    gray = Twin()
    gray.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
    adapted = restorekit.scan(os.path.join(directory, "convnet", "model.ckpt"), gray, layout="torch",
                              shape_policy={"conv.weight": restorekit.AdaptInputChannels(axis=1)})
    restorekit.restore(adapted)
    np.savez(os.path.join(directory, "torch-convnet.npz"), y=y, num_batches_tracked=twin.bn.num_batches_tracked.numpy(),
             gray_conv=gray.conv.weight.detach().numpy(), gray_fc=gray.fc.weight.detach().numpy())
    return {"report": report.to_dict(), "head_untouched": bool(torch.equal(head, twin.logits.weight)),
            "gray_report": adapted.to_dict()}


def main(directory: str) -> None:
    with open(os.path.join(directory, "spec.json")) as f:
        spec = json.load(f)
    out = {"keras": keras_cases(directory, spec)}
    if os.environ["KERAS_BACKEND"] == "torch":
        out["torch"] = torch_twin(directory)
    out["tensorflow_imported"] = "tensorflow" in sys.modules
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
