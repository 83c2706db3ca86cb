"""TF1 slots again, for going back (issue 36): a torch training checkpoint as a TF1 checkpoint that resumes training.

``tf1_training('train.pt:model', 'tf/model.ckpt', optimizer='adam')`` writes the model's weights
under TF names and axes, as ``convert(..., layout='torch')`` does, and beside them the slots
``tf.compat.v1.train.AdamOptimizer`` or ``MomentumOptimizer`` restores with a ``Saver``:

| torch.optim | TF1 optimizer | written | arguments |
| --- | --- | --- | --- |
| ``Adam(lr, betas, eps)``, ``step = t`` | ``AdamOptimizer`` | ``var/Adam = exp_avg``, ``var/Adam_1 = exp_avg_sq``, ``beta1_power = b1^(t+1)``, ``beta2_power = b2^(t+1)`` (TF1 multiplies after each step, :func:`~restorekit._optim._convert.adam_steps` reads them so), ``global_step = t`` | ``epsilon = eps sqrt(1-b2^(t+1))``: TF1's epsilon hat, equal to torch's at the next step, the drift after reported |
| ``SGD(lr, momentum, nesterov)``: ``buf = mu buf + g``, ``p -= lr buf`` | ``MomentumOptimizer``: ``a = mu a + g``, ``var -= lr a`` | ``var/Momentum = buf`` (no step count: torch's SGD keeps none, no ``global_step`` is written) | ``momentum``, ``use_nesterov``: exact |

A slot is read in TF1's terms (``_torch_state``, which refuses ``amsgrad`` and ``dampening``)
and put through the layout record exactly as its weight is (transposed, permuted, split parts
joined); a weight TF joins by a sum (two torch biases) has no slot that sums and is refused.
Everything is checked before the one commit of the weights and slots together.
"""

from __future__ import annotations

import os

import numpy as np

from restorekit._optim._tf1 import SLOT_LEAVES
from restorekit._optim._torch_state import (
    _BUFFERS, check_groups, epsilon_hat_notes, is_torch_training_file, torch_state)
from restorekit._report import OptimizerNote, OptimizerRecord, OptimizerSection
from restorekit.errors import InvalidArgumentError
from restorekit.export import _from_files as from_files, _sources as sources
from restorekit.export._conversions import open_source
from restorekit.export._request import request
from restorekit.formats import _sinks as formats
from restorekit.formats._sink import ExportResult
from restorekit._bundle.files import check_parent, output_prefix

__all__ = ["TF1_OPTIMIZERS", "tf1_training"]

# optimizer= -> (the tf.compat.v1.train class, the TF1 slot kind it restores)
TF1_OPTIMIZERS = {"adam": ("AdamOptimizer", "Adam"), "momentum": ("MomentumOptimizer", "Momentum")}


def tf1_training(src, out, *, optimizer: str, overwrite: bool = False, progress: bool = False) -> ExportResult:
    """Write the torch training checkpoint ``src`` (``FILE:GROUP``, ``{'model': ..., 'optimizer': ...}``) as the TF1
    checkpoint ``out``: the weights in TF names and axes (``layout='torch'`` reversed) and the slots ``optimizer``
    (``'adam'``, ``'momentum'``: the ``tf.compat.v1.train`` optimizer that resumes it) restores.

    ``result.optimizer`` is the report's optimizer section: what was carried, and ``arguments``,
    the hyper-parameters to build the TF1 optimizer with so its next update is torch's
    (``tf.compat.v1.train.AdamOptimizer(**result.optimizer.arguments)``).

        result = tf1_training('train.pt:model', 'tf/model.ckpt', optimizer='adam')

    Raises:
        InvalidArgumentError: ``optimizer`` is not one of :data:`TF1_OPTIMIZERS`; the file holds no torch
            optimizer state, or another optimizer's (or state TF1 has no term for: ``amsgrad``, ``dampening``,
            hyper-parameters that differ between param groups); a weight TF joins by a sum. Nothing is written.
        OutputExistsError: the output exists (without overwrite) or is the source.
    """
    if optimizer not in TF1_OPTIMIZERS:
        raise InvalidArgumentError(f"optimizer={optimizer!r}: TF1 slots are written for "
                                   f"{', '.join(repr(k) for k in TF1_OPTIMIZERS)} (torch Adam, SGD with momentum)")
    cls, kind = TF1_OPTIMIZERS[optimizer]
    source, fmt = open_source(src)
    state = torch_state(source) if fmt == "torch" and is_torch_training_file(source) else None
    if state is None or not state.kinds:
        raise InvalidArgumentError(f"{getattr(source, 'prefix', src)!r} holds no torch optimizer state beside its "
                                   f"model: write a training checkpoint ({{'model': model.state_dict(), 'optimizer': "
                                   f"optimizer.state_dict()}}) and name its model group (FILE:model)")
    held = "Adam" if "Adam" in state.kinds else "Momentum"
    if held != kind:
        raise InvalidArgumentError(f"the checkpoint holds torch {'Adam' if held == 'Adam' else 'SGD (momentum)'} "
                                   f"state; tf.compat.v1.train.{cls} takes {kind} slots: pass optimizer="
                                   f"{'adam' if held == 'Adam' else 'momentum'}")
    arguments, settings, differences = _arguments(state, kind)
    options = request("torch")
    options.check(formats.TF, fmt)
    out = output_prefix(os.fspath(out), os.path.splitext(os.path.basename(source.prefix.rpartition(":")[0]))[0])
    check_parent(out)

    def slots(reader, record) -> tuple:
        tensors, carried, reset = _slots(reader, record, state, kind)
        if kind == "Adam":
            tensors += _powers(arguments, state.global_step)
        section = OptimizerSection(f"tf.compat.v1.train.{cls}", state.label, state.global_step,
                                   "step" if state.global_step is not None else "no step", tuple(carried),
                                   tuple(reset), settings, differences, arguments)
        return tensors, {"optimizer": section}

    return from_files.write_tf_checkpoint(sources.of_view(source), out, options, overwrite=overwrite,
                                          progress=progress, max_output_bytes=None, extra=slots)


def _one(state, key: str, default):
    """The one value of hyper-parameter ``key`` across the param groups: one TF1 optimizer has one."""
    found = {repr(g.get(key, default)): g.get(key, default) for g in state.groups}
    if len(found) > 1:
        raise InvalidArgumentError(f"the torch run's param groups have {key} {sorted(found)}; one TF1 optimizer "
                                   f"has one: not supported")
    value = next(iter(found.values()))
    return value.item() if hasattr(value, "item") else value


def _arguments(state, kind: str) -> tuple:
    """(the TF1 optimizer's arguments, settings, differences) from the torch run's param groups."""
    terms = check_groups(state, kind)  # refuses dampening; returns the coupled weight decay TF1 has no term for
    differences = [OptimizerNote(what, text, size) for what, text, size in terms]
    lr = float(_one(state, "lr", 1e-3))
    if kind == "Momentum":
        momentum, nesterov = float(_one(state, "momentum", 0.0)), bool(_one(state, "nesterov", False))
        return ({"learning_rate": lr, "momentum": momentum, "use_nesterov": nesterov},
                (OptimizerNote("momentum", "kept: TF1's accumulation a = mu a + g is torch's momentum_buffer"),),
                tuple(differences))
    beta1, beta2 = (float(b) for b in _one(state, "betas", (0.9, 0.999)))
    steps = int(state.global_step or 0)
    roots = [float(np.median(np.sqrt(state.values[keys["Adam_1"]] / (1 - beta2 ** (steps + 1)))))
             for keys in state.slots.values()]
    hat, setting, difference = epsilon_hat_notes(state, beta2, steps, float(np.median(roots)), "TF1")
    settings = (setting,)
    differences.append(difference)
    return ({"learning_rate": lr, "beta1": beta1, "beta2": beta2, "epsilon": hat}, settings, tuple(differences))


def _slots(reader, record, state, kind: str) -> tuple:
    """([(TF slot name, array, dtype)], carried, reset): each slot through the record as its weight goes; a parameter
    torch holds no state for (never stepped) gets zeros, TF1's fresh slot, and is reported reset."""
    shapes = dict(reader.read_shapes())
    params = [n for n in shapes if n.rpartition(".")[2] not in _BUFFERS]
    summed = [n for n in params if "sum" in record.tensors.get(n, {})]
    if summed:
        raise InvalidArgumentError(f"{', '.join(repr(n) for n in summed)}: TF joins these torch tensors by a sum "
                                   f"(one TF bias); their optimizer states do not add up: not supported")
    names = {n: record.tensors.get(n, {}).get("name", n) for n in params}
    tensors = []
    for leaf in SLOT_LEAVES[kind]:
        arrays = [(n, state.values[state.slots[n][leaf]] if n in state.slots else np.zeros(shapes[n], np.float32))
                  for n in params]
        tensors += [(f"{name}/{leaf}", np.ascontiguousarray(array), None)
                    for name, array, _ in record.restore_all(arrays)]
    carried = [OptimizerRecord(names[n], tuple(state.slots[n].values()), tuple(f"{names[n]}/{leaf}"
                                                                            for leaf in SLOT_LEAVES[kind]))
               for n in params if n in state.slots]
    reset = [OptimizerRecord(names[n], reason="torch's optimizer holds no state for it (never stepped): fresh TF1 "
                                              "slots", how="no_slots")
             for n in params if n not in state.slots]
    return tensors, carried, reset


def _powers(arguments: dict, steps) -> list:
    """TF1 Adam's beta powers after ``steps`` steps (``beta^(t+1)``: it multiplies after each step) and its step."""
    t = int(steps or 0)
    return [("beta1_power", np.float32(arguments["beta1"] ** (t + 1)).reshape(()), None),
            ("beta2_power", np.float32(arguments["beta2"] ** (t + 1)).reshape(()), None),
            ("global_step", np.int64(t).reshape(()), None)]

