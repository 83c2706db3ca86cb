"""Run by tests/test_optimizer_state_flax.py in a subprocess where TensorFlow cannot be imported (issue 36).

``python flax_optimizer_cases.py DIR [CASE ...]``: for every TF1 run in ``DIR`` (written by
``tests/tf1_optimizer_runs.py``) named in ``CASES``, build the Flax NNX twin of its net and an
``nnx.Optimizer`` with the optax optimizer of the same hyper-parameters, restore weights and
optimizer state with ``scan(..., optimizer=)`` + ``restore``, continue 20 steps on the same
batches, and print the losses (and those of a warm start with fresh optimizer state, the
control) as one ``RESULT {json}`` line.
"""

import json
import os
import sys

import numpy as np

from tf1_optimizer_runs import AFTER, BEFORE, RUNS, batches

# TF1 run -> the optax optimizer of its hyper-parameters
CASES = {
    "adam": lambda optax, a: optax.adam(a["learning_rate"]),
    "adam_eps": lambda optax, a: optax.adam(a["learning_rate"], b1=a["beta1"], b2=a["beta2"], eps=a["epsilon"]),
    "momentum": lambda optax, a: optax.sgd(a["learning_rate"], momentum=a["momentum"]),
    "nesterov": lambda optax, a: optax.sgd(a["learning_rate"], momentum=a["momentum"], nesterov=True),
    "rmsprop": lambda optax, a: optax.rmsprop(a["learning_rate"], decay=a["decay"], eps=a["epsilon"],
                                              momentum=a["momentum"], initial_scale=1.0),
    "rmsprop_centered": lambda optax, a: optax.rmsprop(a["learning_rate"], decay=a["decay"], eps=a["epsilon"],
                                                       momentum=a["momentum"], centered=True, initial_scale=1.0),
}


def twin(classes: int = 3):
    """The net of tf1_optimizer_runs in Flax NNX: fc1 (8 -> 16), relu, fc2 (16 -> classes); TF's names by path."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc1, self.fc2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, classes, rngs=rngs)

        def __call__(self, x):
            return self.fc2(nnx.relu(self.fc1(x)))

    return Net(nnx.Rngs(0))


def continue_run(model, optimizer) -> list:
    """``AFTER`` steps on the batches TF continued on; the loss before each step, as TF's ``sess.run`` gives it."""
    import optax
    from flax import nnx

    xs, ys = batches()

    # eager: a jit compile per case costs more than 20 steps of this net
    def step(model, optimizer, x, y):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer, xs[i], ys[i].astype(np.int32))) for i in range(BEFORE, BEFORE + AFTER)]


def resume(directory: str, case: str, *, carry: bool) -> tuple:
    import optax
    from flax import nnx

    import restorekit

    model = twin()
    optimizer = nnx.Optimizer(model, CASES[case](optax, RUNS[case][1]), wrt=nnx.Param)
    report = restorekit.scan(os.path.join(directory, case, "model.ckpt"), model, rules=restorekit.FLAX_FROM_TF,
                             optimizer=optimizer if carry else None)
    restorekit.restore(report)
    return continue_run(model, optimizer), report


def _leaves(tree) -> dict:
    from flax import nnx

    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(tree)}


def changed_head(directory: str) -> dict:
    """fc2 with 5 classes: its weights mismatched, its slots reported reset and left fresh; fc1's carried."""
    import optax
    from flax import nnx

    import restorekit

    model = twin(classes=5)
    optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
    report = restorekit.scan(os.path.join(directory, "adam", "model.ckpt"), model, optimizer=optimizer)
    restorekit.restore(report)
    adam = optimizer.opt_state[0]
    slot = restorekit.Checkpoint(os.path.join(directory, "adam", "model.ckpt")).read("fc1/kernel/Adam")
    mu = _leaves(adam.mu)
    out = {"section": report.to_dict()["optimizer"], "text": str(report), "count": int(adam.count.get_value()),
           "step": int(optimizer.step.get_value()),
           "head_fresh": bool(not mu["fc2/kernel"].any() and not mu["fc2/bias"].any()),
           "fc1_carried": bool(np.array_equal(mu["fc1/kernel"], slot))}
    return out


def refusals(directory: str) -> dict:
    """Chains and optimizers the target does not take: the error class, and whether anything was written."""
    import optax
    from flax import nnx

    import restorekit

    out = {}
    for name, tx, case in [("adagrad", optax.adagrad(0.1), "adam"), ("sgd_for_adam", optax.sgd(0.1, momentum=0.9), "adam"),
                           ("lion", optax.lion(0.1), "adam"), ("nadam", optax.nadam(0.1), "adam")]:
        model = twin()
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        before = _leaves(nnx.state(model))
        try:
            restorekit.scan(os.path.join(directory, case, "model.ckpt"), model, optimizer=optimizer)
            out[name] = ["none", ""]
        except Exception as e:  # noqa: BLE001  (its class and message are the result)
            out[name] = [type(e).__name__, str(e)]
        out[name].append(all(np.array_equal(v, before[k]) for k, v in _leaves(nnx.state(model)).items()))
    return out


def main(directory: str, cases: list) -> None:
    out: dict = {"losses": {}, "fresh": {}, "reports": {}}
    for case in cases:
        out["losses"][case], report = resume(directory, case, carry=True)
        out["reports"][case] = report.to_dict()["optimizer"]
        out["fresh"][case], _ = resume(directory, case, carry=False)
    if "adam" in cases:  # both read the adam run's checkpoint
        out["changed_head"] = changed_head(directory)
        out["refusals"] = refusals(directory)
    out["tensorflow_imported"] = "tensorflow" in sys.modules
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(CASES))
