"""The TensorFlow side of tests/test_optimizer_state.py: TF1 runs that stop, save, and continue.

Run as a script in its own process (``python tests/tf1_optimizer_runs.py OUT [RUN ...]``, every run by default), so the torch
side of the test restores into ``torch.optim`` and compares with TensorFlow's own numbers
without sharing a process with TensorFlow's graph mode. For every optimizer in ``RUNS``: a tiny
net (Dense 8 -> 16, relu, Dense 16 -> 3, softmax cross-entropy) trained ``BEFORE`` steps on fixed
batches, saved with ``tf.compat.v1.train.Saver``, then continued ``AFTER`` steps; the losses of
the continuation are TensorFlow's own, the oracle the torch run must meet.

``python tests/tf1_optimizer_runs.py resume JOBS.json`` goes the other way (``tf1_training``): each
job's TF1 checkpoint, written from a torch run, restored and continued by TF1 (:func:`resume`).
"""

import json
import os
import sys

import numpy as np

BEFORE, AFTER, BATCH = 5, 20, 16
# name: (optimizer class in tf.compat.v1.train, its arguments), as the torch side builds its twin
RUNS = {
    "adam": ("AdamOptimizer", {"learning_rate": 0.01}),
    "adam_eps": ("AdamOptimizer", {"learning_rate": 0.01, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-3}),
    "momentum": ("MomentumOptimizer", {"learning_rate": 0.05, "momentum": 0.9}),
    "nesterov": ("MomentumOptimizer", {"learning_rate": 0.05, "momentum": 0.9, "use_nesterov": True}),
    "rmsprop": ("RMSPropOptimizer", {"learning_rate": 0.01, "decay": 0.9, "momentum": 0.5, "epsilon": 1e-10}),
    "rmsprop_centered": ("RMSPropOptimizer", {"learning_rate": 0.01, "decay": 0.9, "momentum": 0.5, "epsilon": 1e-6,
                                              "centered": True}),
    "rmsprop_plain": ("RMSPropOptimizer", {"learning_rate": 0.01, "decay": 0.9, "epsilon": 1e-10}),
    "adagrad": ("AdagradOptimizer", {"learning_rate": 0.1, "initial_accumulator_value": 0.1}),
    # google-research BERT's optimizer (adam_m / adam_v slots, no bias correction, decoupled decay but on biases)
    "bert_adamw": ("AdamWeightDecayOptimizer", {"learning_rate": 0.01, "weight_decay_rate": 0.1, "epsilon": 1e-6}),
}


def bert_optimizer(tf, **kwargs):
    """BERT's ``AdamWeightDecayOptimizer`` (google-research/bert ``optimization.py``, Apache 2.0), as it is there
    but for ``tf.compat.v1`` names and the step count it increments (``run_pretraining.py`` does that beside it)."""
    import re

    tf1 = tf.compat.v1

    class AdamWeightDecayOptimizer(tf1.train.Optimizer):
        def __init__(self, learning_rate, weight_decay_rate=0.0, beta_1=0.9, beta_2=0.999, epsilon=1e-6,
                     exclude_from_weight_decay=("LayerNorm", "layer_norm", "bias"), name="AdamWeightDecayOptimizer"):
            super().__init__(False, name)
            self.learning_rate, self.weight_decay_rate = learning_rate, weight_decay_rate
            self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
            self.exclude_from_weight_decay = exclude_from_weight_decay

        def apply_gradients(self, grads_and_vars, global_step=None, name=None):
            assignments = []
            for grad, param in grads_and_vars:
                param_name = re.match("^(.*):\\d+$", param.name).group(1)
                m = tf1.get_variable(param_name + "/adam_m", shape=param.shape.as_list(), dtype=tf.float32,
                                     trainable=False, initializer=tf1.zeros_initializer())
                v = tf1.get_variable(param_name + "/adam_v", shape=param.shape.as_list(), dtype=tf.float32,
                                     trainable=False, initializer=tf1.zeros_initializer())
                next_m = self.beta_1 * m + (1.0 - self.beta_1) * grad
                next_v = self.beta_2 * v + (1.0 - self.beta_2) * tf.square(grad)
                update = next_m / (tf.sqrt(next_v) + self.epsilon)
                if self.weight_decay_rate and not any(re.search(r, param_name) for r in self.exclude_from_weight_decay):
                    update += self.weight_decay_rate * param
                assignments.extend([param.assign(param - self.learning_rate * update), m.assign(next_m),
                                    v.assign(next_v)])
            if global_step is not None:
                assignments.append(global_step.assign_add(1))
            return tf.group(*assignments, name=name)

    return AdamWeightDecayOptimizer(**kwargs)


def batches(seed: int = 0):
    """``BEFORE + AFTER`` fixed batches: inputs [BATCH, 8] and class labels [BATCH]."""
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((BEFORE + AFTER, BATCH, 8)).astype(np.float32)
    ys = rng.integers(0, 3, (BEFORE + AFTER, BATCH)).astype(np.int64)
    return xs, ys


def initial_weights(seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {"fc1/kernel": (rng.standard_normal((8, 16)) * 0.4).astype(np.float32),
            "fc1/bias": (rng.standard_normal(16) * 0.1).astype(np.float32),
            "fc2/kernel": (rng.standard_normal((16, 3)) * 0.4).astype(np.float32),
            "fc2/bias": np.zeros(3, np.float32)}


def run(name: str, out: str) -> list:
    """Train run ``name`` ``BEFORE`` steps, save under ``out/name/model.ckpt``, continue; return the losses."""
    import tensorflow as tf

    tf1 = tf.compat.v1
    cls, kwargs = RUNS[name]
    xs, ys = batches()
    with tf.Graph().as_default():
        x, y = tf1.placeholder(tf.float32, [None, 8]), tf1.placeholder(tf.int64, [None])
        weights = {k: tf1.get_variable(k, initializer=tf.constant(v)) for k, v in initial_weights().items()}
        hidden = tf.nn.relu(x @ weights["fc1/kernel"] + weights["fc1/bias"])
        logits = hidden @ weights["fc2/kernel"] + weights["fc2/bias"]
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        step = tf1.train.get_or_create_global_step()
        make = (lambda **kw: bert_optimizer(tf, **kw)) if cls == "AdamWeightDecayOptimizer" else getattr(tf1.train, cls)
        train = make(**kwargs).minimize(loss, global_step=step)
        saver = tf1.train.Saver()
        losses = []
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for i in range(BEFORE):
                sess.run(train, {x: xs[i], y: ys[i]})
            os.makedirs(os.path.join(out, name), exist_ok=True)
            saver.save(sess, os.path.join(out, name, "model.ckpt"), write_meta_graph=False)
            for i in range(BEFORE, BEFORE + AFTER):
                value, _ = sess.run([loss, train], {x: xs[i], y: ys[i]})
                losses.append(float(value))
    return losses


def resume(prefix: str, cls: str, kwargs: dict, carry: bool) -> list:
    """The TF1 net restored from ``prefix`` with a ``Saver`` (all of it; the control, ``carry=False``: the weights
    only, fresh slots) and continued ``AFTER`` steps with ``tf.compat.v1.train.<cls>(**kwargs)``; the losses.

    A checkpoint without ``global_step`` (torch's SGD keeps no count) is resumed by a graph without one."""
    import tensorflow as tf

    tf1 = tf.compat.v1
    xs, ys = batches()
    held = set(dict(tf.train.list_variables(prefix)))
    with tf.Graph().as_default():
        x, y = tf1.placeholder(tf.float32, [None, 8]), tf1.placeholder(tf.int64, [None])
        weights = {k: tf1.get_variable(k, initializer=tf.constant(v * 0)) for k, v in initial_weights().items()}
        hidden = tf.nn.relu(x @ weights["fc1/kernel"] + weights["fc1/bias"])
        logits = hidden @ weights["fc2/kernel"] + weights["fc2/bias"]
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        step = tf1.train.get_or_create_global_step() if "global_step" in held else None
        train = getattr(tf1.train, cls)(**kwargs).minimize(loss, global_step=step)
        saver = tf1.train.Saver(None if carry else list(weights.values()))
        losses = []
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            saver.restore(sess, prefix)
            for i in range(BEFORE, BEFORE + AFTER):
                value, _ = sess.run([loss, train], {x: xs[i], y: ys[i]})
                losses.append(float(value))
    return losses


def main(out: str, names: list) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    losses = {name: run(name, out) for name in names}
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump(losses, f)


if __name__ == "__main__":
    if sys.argv[1] == "resume":  # resume JOBS.json: [[prefix, cls, kwargs], ...] -> JOBS.out.json: [[carried, fresh]]
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        with open(sys.argv[2]) as f:
            jobs = json.load(f)
        with open(sys.argv[2] + ".out.json", "w") as f:
            json.dump([[resume(*job, carry=True), resume(*job, carry=False)] for job in jobs], f)
    else:
        main(sys.argv[1], sys.argv[2:] or list(RUNS))
