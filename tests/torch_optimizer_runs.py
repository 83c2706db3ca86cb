"""The runs of tests/test_optimizer_state_torch.py: a torch run stopped and saved, and Keras 3 resuming it.

``python torch_optimizer_runs.py torch OUT``: the torch twin of ``tf1_optimizer_runs``'s net
trained ``BEFORE`` steps per optimizer in ``RUNS``, saved as a training checkpoint
(``{'model': ..., 'optimizer': ..., 'epoch': ...}`` with ``torch.save``), then continued ``AFTER``
steps by torch itself: the oracle, in ``OUT/losses.json``.

``python torch_optimizer_runs.py resume OUT`` (``KERAS_BACKEND=jax``, TensorFlow blocked): each
run restored into the Keras twin from ``OUT/NAME.pt:model`` with ``optimizer=`` (and, the control,
without), continued on the same batches; losses and reports in ``OUT/<backend>.json``.
``python torch_optimizer_runs.py flax OUT``: the same into the Flax NNX twin with an
``nnx.Optimizer`` over optax; ``OUT/flax.json``.
"""

import json
import os
import sys

from tf1_optimizer_runs import AFTER, BEFORE, batches, initial_weights

# name: (torch.optim class and arguments, the Keras optimizer class and arguments that resume it)
RUNS = {
    "adam": (("Adam", {"lr": 0.01}), ("Adam", {"learning_rate": 0.01})),
    "momentum": (("SGD", {"lr": 0.05, "momentum": 0.9}), ("SGD", {"learning_rate": 0.05, "momentum": 0.9})),
}


def torch_run(name: str, out: str, optimizer: tuple | None = None) -> list:
    """Run ``name`` (its torch optimizer ``RUNS[name][0]``, or ``optimizer``: (class, arguments)), saved after
    ``BEFORE`` steps as ``OUT/NAME.pt``; torch's losses of the ``AFTER`` steps after."""
    import numpy as np
    import torch

    net = torch.nn.Sequential()
    net.add_module("fc1", torch.nn.Linear(8, 16))
    net.add_module("relu", torch.nn.ReLU())
    net.add_module("fc2", torch.nn.Linear(16, 3))
    weights = initial_weights()
    with torch.no_grad():
        for layer in ("fc1", "fc2"):
            getattr(net, layer).weight.copy_(torch.from_numpy(weights[f"{layer}/kernel"].T.copy()))
            getattr(net, layer).bias.copy_(torch.from_numpy(weights[f"{layer}/bias"]))
    cls, kwargs = optimizer or RUNS[name][0]
    optimizer = getattr(torch.optim, cls)(net.parameters(), **kwargs)
    xs, ys = batches()
    losses = []
    for i in range(BEFORE + AFTER):
        if i == BEFORE:
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1},
                       os.path.join(out, f"{name}.pt"))
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(xs[i])), torch.from_numpy(ys[i]))
        loss.backward()
        optimizer.step()
        if i >= BEFORE:
            losses.append(float(np.float32(loss.item())))
    return losses


def resume(out: str, name: str, carry: bool, classes: int = 3):
    import keras

    import restorekit
    from keras_optimizer_runs import compiled, continue_run

    cls, kwargs = RUNS[name][1]
    keras.utils.set_random_seed(1)
    opt = getattr(keras.optimizers, cls)(**kwargs)
    net = compiled(keras, opt, classes, eager=True)
    report = restorekit.scan(os.path.join(out, f"{name}.pt:model"), net, layout="torch",
                             optimizer=opt if carry else None)
    restorekit.restore(report)
    return continue_run(net), report


# name: the optax optimizer of the torch run's hyper-parameters
OPTAX = {"adam": lambda optax: optax.adam(0.01), "momentum": lambda optax: optax.sgd(0.05, momentum=0.9)}


def resume_flax(out: str, name: str, carry: bool):
    """Run ``name`` restored into the Flax NNX twin with an ``nnx.Optimizer`` (state carried, or fresh), then 20 steps."""
    import optax
    from flax import nnx

    import restorekit
    from flax_optimizer_cases import continue_run as flax_continue, twin

    model = twin()
    opt = nnx.Optimizer(model, OPTAX[name](optax), wrt=nnx.Param)
    report = restorekit.scan(os.path.join(out, f"{name}.pt:model"), model, layout="torch",
                             optimizer=opt if carry else None)
    restorekit.restore(report)
    return flax_continue(model, opt), report


def main(mode: str, out: str) -> None:
    if mode == "torch":
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump({name: torch_run(name, out) for name in RUNS}, f)
        return
    run = resume_flax if mode == "flax" else resume
    found: dict = {"losses": {}, "fresh": {}, "reports": {}}
    for name in RUNS:
        found["losses"][name], report = run(out, name, True)
        found["reports"][name] = report.to_dict()["optimizer"]
        found["fresh"][name], _ = run(out, name, False)
    found["tensorflow_imported"] = "tensorflow" in sys.modules
    if mode != "flax":
        import keras

        mode = keras.config.backend()
    with open(os.path.join(out, f"{mode}.json"), "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], sys.argv[2])
