"""The demo's two tasks on scikit-learn's digits, its networks, and how each is trained."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from restorekit._tensorflow import import_tensorflow
from restorekit.errors import MissingDependencyError

DEFAULT_SEEDS = 10
DEFAULT_STEPS = 100
DEFAULT_SHOTS = 5  # task B training images per class: 25 in all
DEFAULT_OUT = "restorekit-demo"

PRETRAIN_STEPS = 1000
EVAL_EVERY = 5
LEARNING_RATE = 3e-3  # Adam, times each group's multiplier
A_DIGITS = (0, 1, 2, 3, 4)
B_DIGITS = (5, 6, 7, 8, 9)
FILTERS = (32, 64)  # the two convolutions
CLASSES = 5  # both tasks: which of five digits

# The three ways to learn task B: group multipliers, and whether the backbone is restored.
ARMS = {
    "cold": ({"backbone": 1.0, "head": 1.0}, False),
    "probe": ({"backbone": 0.0, "head": 1.0}, True),
    "warm": ({"backbone": 0.1, "head": 1.0}, True),
}
DESCRIPTIONS = {
    "cold": "the same network from scratch, every layer at 1x",
    "probe": "backbone restored (EMA) and frozen (0x), new head at 1x",
    "warm": "backbone restored (EMA) at 0.1x, new head at 1x",
}

# The libraries of the `demo` extra: module -> distribution name.
LIBRARIES = {"sklearn": "scikit-learn", "matplotlib": "matplotlib"}


def missing_libraries(names, *, tensorflow: bool = False) -> MissingDependencyError:
    """The error for demo libraries that are not installed: which ones, and the pip extras that bring them.

    ``tensorflow=True`` adds TensorFlow to the list and the `tf` extra to the command, so
    a fresh environment learns the whole fix at once.
    """
    names = ["TensorFlow", *names] if tensorflow else list(names)
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    verb = "is" if len(names) == 1 else "are"
    extras = "tf,demo" if tensorflow else "demo"
    return MissingDependencyError(f"the demo needs {listed}, which {verb} not installed: pip install 'restorekit[{extras}]'")


def _installed(module: str) -> bool:
    if module in sys.modules:  # None there means: blocked from importing
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def check_libraries() -> None:
    """Raise ``missing_libraries`` naming every library of the `demo` extra that is not installed.

    Looks the modules up without importing them. TensorFlow alone missing is left to
    ``import_tensorflow``, whose message names the TensorFlow builds to choose from.
    """
    missing = [name for module, name in LIBRARIES.items() if not _installed(module)]
    if missing:
        raise missing_libraries(missing, tensorflow=not _installed("tensorflow"))


# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class Tasks:
    """The two tasks as (images, labels) pairs, labels 0-4 in both.

    Task A's label is the digit (0-4); task B's is the digit minus 5 (5-9 -> 0-4).
    Each seed draws task B's few training images from ``b_pool``; ``b_test`` is fixed,
    so every run is scored on the same images.
    """

    a_train: tuple
    a_test: tuple
    b_pool: tuple
    b_test: tuple

    def b_train(self, seed: int, shots: int) -> tuple:
        """``shots`` training images per class of task B, drawn with ``seed``."""
        import numpy as np

        x, y = self.b_pool
        rng = np.random.RandomState(seed)
        picked = np.concatenate([rng.choice(np.flatnonzero(y == c), shots, replace=False) for c in range(CLASSES)])
        return x[picked], y[picked]


def load_tasks() -> Tasks:
    """Split scikit-learn's digits into the two tasks (a fixed split, seed 0).

    Task A gets every image of 0-4: four fifths to train on, one fifth to test. Task B
    gets every image of 5-9: half is the pool its few training images come from, half
    its test set.

    Raises:
        MissingDependencyError: scikit-learn is not installed.
    """
    import numpy as np

    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise missing_libraries(["scikit-learn"]) from None
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.RandomState(0).permutation(len(y))
    x, y = x[order], y[order]
    a, b = y < 5, y >= 5
    xa, ya, xb, yb = x[a], y[a], x[b], y[b] - 5
    a_cut, b_cut = len(ya) * 4 // 5, len(yb) // 2
    return Tasks(
        a_train=(xa[:a_cut], ya[:a_cut]),
        a_test=(xa[a_cut:], ya[a_cut:]),
        b_pool=(xb[:b_cut], yb[:b_cut]),
        b_test=(xb[b_cut:], yb[b_cut:]),
    )


# ---------------------------------------------------------------- the networks


def _linear(x, units: int, scope: str):
    tf = import_tensorflow()

    tf1 = tf.compat.v1
    with tf1.variable_scope(scope):
        weights = tf1.get_variable("weights", [x.shape[-1], units], initializer=tf1.glorot_uniform_initializer())
        biases = tf1.get_variable("biases", [units], initializer=tf1.zeros_initializer())
    return tf.matmul(x, weights) + biases


def _conv(x, filters: int, scope: str, *, stride: int = 1):
    tf = import_tensorflow()

    tf1 = tf.compat.v1
    with tf1.variable_scope(scope):
        weights = tf1.get_variable(
            "weights", [3, 3, x.shape[-1], filters], initializer=tf1.glorot_uniform_initializer()
        )
        biases = tf1.get_variable("biases", [filters], initializer=tf1.zeros_initializer())
    return tf.nn.relu(tf.nn.conv2d(x, weights, strides=stride, padding="SAME") + biases)


def _backbone(x):
    """The part both tasks share: two 3x3 convolutions (the second with stride 2), flattened."""
    tf = import_tensorflow()

    with tf.compat.v1.variable_scope("backbone"):
        h = _conv(tf.reshape(x, [-1, 8, 8, 1]), FILTERS[0], "conv1")
        h = _conv(h, FILTERS[1], "conv2", stride=2)
        return tf.reshape(h, [-1, 4 * 4 * FILTERS[1]])


def _task_a_logits(images):
    """Task A's network: the backbone and a 5-way head, ``digits``."""
    return _linear(_backbone(images), CLASSES, "digits")


def _task_b_logits(images):
    """Task B's network: the same backbone and a new 5-way head, ``head/logits``."""
    tf = import_tensorflow()

    features = _backbone(images)
    with tf.compat.v1.variable_scope("head"):
        return _linear(features, CLASSES, "logits")


def _inputs():
    tf = import_tensorflow()

    tf1 = tf.compat.v1
    return tf1.placeholder(tf.float32, [None, 64], name="images"), tf1.placeholder(tf.int64, [None], name="labels")


def _loss_and_accuracy(logits, labels):
    tf = import_tensorflow()

    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, axis=1), labels), tf.float32))
    return loss, accuracy


# ---------------------------------------------------------------- task A


def pretrain(tasks: Tasks, directory, *, steps: int = PRETRAIN_STEPS, seed: int = 0) -> tuple[str, float]:
    """Train the backbone and a 5-way head on task A; save weights, Momentum slots and EMA shadows.

    Args:
        tasks: from ``load_tasks``.
        directory: where the checkpoint goes (created).
        steps: Momentum steps on minibatches of 32.
        seed: graph and minibatch seed.

    Returns:
        (checkpoint prefix, task A test accuracy of the EMA weights).
    """
    import numpy as np
    tf = import_tensorflow()

    tf1 = tf.compat.v1
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with tf.Graph().as_default():
        tf1.set_random_seed(seed)
        images, labels = _inputs()
        loss, _ = _loss_and_accuracy(_task_a_logits(images), labels)
        global_step = tf1.train.get_or_create_global_step()
        ema = tf1.train.ExponentialMovingAverage(0.99, num_updates=global_step)
        minimize = tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss, global_step=global_step)
        with tf.control_dependencies([minimize]):
            train_op = ema.apply(tf1.trainable_variables())

        # Score the EMA weights, the ones task B will restore: the same network again,
        # reading each variable's shadow instead (the TF1 idiom for evaluating with EMA).
        def shadow(getter, name, *args, **kwargs):
            return ema.average(getter(name, *args, **kwargs))

        with tf1.variable_scope(tf1.get_variable_scope(), reuse=True, custom_getter=shadow):
            _, ema_accuracy = _loss_and_accuracy(_task_a_logits(images), labels)

        saver = tf1.train.Saver()  # every global variable: weights, slots, shadows, global_step
        x, y = tasks.a_train
        rng = np.random.RandomState(seed)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            for _ in range(steps):
                batch = rng.choice(len(y), 32, replace=False)
                session.run(train_op, {images: x[batch], labels: y[batch]})
            accuracy = session.run(ema_accuracy, {images: tasks.a_test[0], labels: tasks.a_test[1]})
            prefix = saver.save(session, str(directory / "model.ckpt"), global_step=global_step)
    return prefix, float(accuracy)


# ---------------------------------------------------------------- task B


@dataclass(frozen=True)
class Run:
    """One fine-tuning run: its test-accuracy curve and what it started from.

    ``arm`` is ``'cold'``, ``'probe'`` or ``'warm'``. ``images`` holds the training
    images it saw; ``initial`` and ``final`` map each trainable variable's name to its
    value at step 0 (after the restore, before any training) and after the last step.
    ``report`` and ``groups`` are the restore report (None for cold) and the variable groups.
    """

    seed: int
    arm: str
    steps: tuple
    accuracy: tuple
    images: object = field(default=None, compare=False, repr=False)
    initial: dict = field(default_factory=dict, compare=False, repr=False)
    final: dict = field(default_factory=dict, compare=False, repr=False)
    report: object = field(default=None, compare=False, repr=False)
    groups: object = field(default=None, compare=False, repr=False)

    @property
    def final_accuracy(self) -> float:
        return self.accuracy[-1]


def finetune(
    tasks: Tasks,
    pretrained: str | None,
    *,
    arm: str,
    seed: int,
    steps: int = DEFAULT_STEPS,
    shots: int = DEFAULT_SHOTS,
    eval_every: int = EVAL_EVERY,
) -> Run:
    """Train the task B network one way (``arm``, a key of ``ARMS``).

    The network is the task A backbone and a new 5-way head. ``probe`` and ``warm``
    restore the backbone with ``easy_going_scaffold(pretrained, ema=True)``; ``cold``
    starts every layer fresh. Each arm's multipliers (``ARMS``) go to a
    ``GroupedOptimizer`` of Adams, trained on full batches of the ``shots`` images per
    class drawn with ``seed``, in a ``MonitoredTrainingSession`` with a fresh
    checkpoint directory. The graph seed is ``seed`` for every arm, so the new head
    starts from the same values in all three.

    Args:
        tasks: from ``load_tasks``.
        pretrained: the task A checkpoint (unused by ``cold``).
        arm: ``'cold'``, ``'probe'`` or ``'warm'``.
        seed: draws the training images and the initial weights.
        steps: training steps.
        shots: training images per class.
        eval_every: score the test set every this many steps (and at the end).

    Returns:
        A Run.
    """
    tf = import_tensorflow()

    from restorekit.finetune import GroupedOptimizer, group_variables
    from restorekit._scaffold import easy_going_scaffold

    tf1 = tf.compat.v1
    rules, restore = ARMS[arm]
    x_train, y_train = tasks.b_train(seed, shots)
    with tf.Graph().as_default():
        tf1.set_random_seed(seed)
        images, labels = _inputs()
        loss, accuracy = _loss_and_accuracy(_task_b_logits(images), labels)

        global_step = tf1.train.get_or_create_global_step()
        trainable = tf1.trainable_variables()
        groups = group_variables(rules, trainable)
        optimizer = GroupedOptimizer(lambda multiplier: tf1.train.AdamOptimizer(LEARNING_RATE * multiplier), groups)
        train_op = optimizer.minimize(loss, global_step=global_step)
        # Built last, so it sees every variable: the Adam slots are skipped, the new head
        # is reported missing and initialized, the old head is reported unused.
        scaffold = easy_going_scaffold(pretrained, ema=True) if restore else tf1.train.Scaffold()

        train = {images: x_train, labels: y_train}
        test = {images: tasks.b_test[0], labels: tasks.b_test[1]}
        names = [v.op.name for v in trainable]
        curve_steps, curve = [], []
        with tempfile.TemporaryDirectory() as checkpoint_dir:
            with tf1.train.MonitoredTrainingSession(
                checkpoint_dir=checkpoint_dir,
                scaffold=scaffold,
                save_summaries_steps=None,
                save_summaries_secs=None,
                log_step_count_steps=None,
                save_checkpoint_secs=None,
            ) as session:
                initial = dict(zip(names, session.run(trainable)))
                for step in range(steps + 1):
                    if step % eval_every == 0 or step == steps:
                        curve_steps.append(step)
                        curve.append(float(session.run(accuracy, test)))
                    if step < steps:
                        session.run(train_op, train)
                final = dict(zip(names, session.run(trainable)))
    return Run(
        seed, arm, tuple(curve_steps), tuple(curve), x_train, initial, final,
        scaffold.restore_report if restore else None, groups,
    )
