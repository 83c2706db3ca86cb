"""Resume or warm-start (TF2, Keras 3): a run's own checkpoint wins; otherwise restore what fits from a pretrained one.

``resume_or_warm_start`` serves custom training loops with ``tf.train.CheckpointManager``;
``WarmStart`` is the same decision as a ``keras.callbacks.Callback`` for ``model.fit``,
beside ``keras.callbacks.BackupAndRestore``. Both are compositions: ``scan`` plans,
``restorekit.restore`` assigns, ``tf.train.Checkpoint`` (or Keras' backup) resumes.
This module imports Keras; ``import restorekit`` loads it on first use.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import keras

from restorekit._tensorflow import import_tensorflow
from restorekit._checkpoint import Checkpoint
from restorekit._distribute import is_sharded
from restorekit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteRestoreError,
    InvalidArgumentError,
    format_names,
)
from restorekit._report import RestoreReport
from restorekit._rundir import resume_point
from restorekit._scan import scan
from restorekit._sources import source_paths
from restorekit._tf2 import restore
from restorekit._trackables import object_graph_keys, tf_variable

__all__ = ["Start", "WarmStart", "resume_or_warm_start"]

_log = logging.getLogger("restorekit")

RESUMED = "resumed"
WARM_STARTED = "warm_started"

# What keras.callbacks.BackupAndRestore (Keras 3) writes in its backup_dir; the
# '.bkp' copy is the previous backup (double_checkpoint=True), its fallback.
_BACKUP_FILES = ("latest.weights.h5", "latest.weights.h5.bkp")


@dataclass(frozen=True)
class Start:
    """How a run started: ``how`` is ``'resumed'`` or ``'warm_started'``.

    ``checkpoint`` is what was restored from (the run's latest checkpoint or backup,
    or the pretrained file); ``report`` the warm start's RestoreReport (None on
    resume); ``step`` the restored step (optimizer iterations) on resume, else None.
    """

    how: str
    checkpoint: str
    report: RestoreReport | None = None
    step: int | None = None

    @property
    def resumed(self) -> bool:
        return self.how == RESUMED

    def __str__(self) -> str:
        if self.resumed:
            at = f" at step {self.step}" if self.step is not None else ""
            return f"restorekit: resumed from {self.checkpoint!r}{at}; the pretrained checkpoint was not read"
        matched = len(self.report.matched) if self.report is not None else 0
        total = self.report.num_variables if self.report is not None else 0
        return f"restorekit: warm-started from {self.checkpoint!r} ({matched} of {total} variables restored)"


def _step_of(step, optimizer) -> int | None:
    for counter in (step, getattr(optimizer, "iterations", None)):
        if counter is not None:
            try:
                return int(counter.numpy())
            except (AttributeError, TypeError, ValueError):
                continue
    return None


def resume_or_warm_start(directory, pretrained, *, model, optimizer=None, step=None, strict: bool = False,
                         **scan_options) -> Start:
    """Resume a custom training loop from ``directory``, or warm-start ``model`` from ``pretrained``.

    * ``directory`` holds a checkpoint (as ``tf.train.CheckpointManager`` writes it for
      ``tf.train.Checkpoint(model=model, optimizer=optimizer[, step=step])``): restore
      model, optimizer and step from its newest complete and readable one (see
      ``restorekit._rundir.resume_point``: not only what the ``checkpoint`` state file
      names; a RestoreKitWarning lists newer ones that are missing or damaged);
      ``pretrained`` is not read (it may be gone).
    * ``directory`` holds no checkpoint and no state file naming one: warm start,
      ``restorekit.scan(pretrained, model, **scan_options)`` and ``restorekit.restore``;
      the optimizer stays fresh.
    * ``directory`` holds checkpoints but none is readable, or its state file names
      one outside it: RunDirectoryError. Warm-starting there would let the next save
      overwrite the run's checkpoints; restorekit never does that silently.

    Pass the run's ``tf.train.CheckpointManager`` as ``directory`` and the resume goes
    through its own ``tf.train.Checkpoint``: everything it tracks is restored, its
    ``save_counter`` included, so ``manager.save()`` continues the numbering
    (``ckpt-2``, ``ckpt-3``, ...) instead of writing ``ckpt-1`` again on every restart.

    Call it after the model is built, inside the strategy's scope when there is one
    (``MirroredStrategy`` variables are restored on every replica). An optimizer
    that is not built yet receives its state when it is built. Under
    ``ParameterServerStrategy`` with a partitioner, ShardedVariables (which TF's own
    restore cannot fill inside Keras 3 objects) are restored by restorekit, shard by
    shard, every tracked variable or none (an unbuilt optimizer is built first).

    Args:
        directory: the run's ``tf.train.CheckpointManager`` (recommended), or its
            checkpoint directory (may not exist yet).
        pretrained: any checkpoint or Keras file ``restorekit.Checkpoint`` opens, or several
            (a list or ``{pattern: source}``, as ``restorekit.scan`` takes them).
        model: the Keras model or tf.Module being trained.
        optimizer: its optimizer, restored on resume.
        step: a step variable saved beside them as ``step``, restored on resume.
        strict: on a warm start, raise IncompleteRestoreError when anything is missing
            or mismatched (nothing is assigned then).
        **scan_options: passed to ``restorekit.scan`` (include, exclude, rules,
            shape_policy, dtype_policy, ...).

    Returns:
        A ``Start``: ``how``, ``checkpoint``, ``report`` (None on resume), ``step``.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: no checkpoint in ``directory``
            and ``pretrained`` cannot be read.
        RunDirectoryError: ``directory`` holds checkpoints but none is complete and
            readable, or its state file names a checkpoint outside it.
        IncompleteRestoreError: ``strict`` and the warm start is incomplete; or a
            sharded resume finds no value for some tracked variable.

    Example:
        >>> manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=m, optimizer=o), 'run/', 3)
        >>> start = restorekit.resume_or_warm_start(manager, 'pretrained.weights.h5', model=m, optimizer=o)
        >>> print(start)
    """
    tf = import_tensorflow()
    manager = directory if isinstance(directory, tf.train.CheckpointManager) else None
    run = manager.directory if manager is not None else directory
    point = resume_point(run, pretrained=source_paths(pretrained)) if run is not None else None
    if point is not None:
        if manager is not None:
            checkpoint = manager.checkpoint
            step = step if step is not None else getattr(checkpoint, "step", None)
        else:
            objects = {"model": model, "optimizer": optimizer, "step": step}
            checkpoint = tf.train.Checkpoint(**{k: v for k, v in objects.items() if v is not None})
        _resume(tf, checkpoint, point.prefix, model, optimizer)
        start = Start(RESUMED, point.prefix, None, _step_of(step, optimizer))
    else:
        report = scan(pretrained, model, **scan_options)
        restore(report, strict=strict)
        start = Start(WARM_STARTED, report.checkpoint, report)
    _log.info("%s", start)
    return start


def _tracked_variables(tf, root) -> list:
    """Every variable ``root`` (a tf.train.Checkpoint) reaches through its children, its save counter included."""
    def is_variable(obj) -> bool:  # a Keras optimizer has an 'assign' method too, so ask by type
        return isinstance(obj, (tf.Variable, keras.Variable)) or is_sharded(obj)

    found, seen = [], set()
    for child in [root.save_counter, *tf.train.TrackableView(root).children(root).values()]:
        for var in [child] if is_variable(child) else list(getattr(child, "variables", ())):
            if id(var) not in seen:
                seen.add(id(var))
                found.append(var)
    return found


def _resume(tf, checkpoint, prefix: str, model, optimizer) -> None:
    """Restore everything ``checkpoint`` tracks from ``prefix``.

    TF's own restore does it, except for ShardedVariables (ParameterServerStrategy
    with a partitioner), which TF cannot save or restore inside Keras 3 objects
    ('ShardedVariable' object has no attribute 'device'). Those go through restorekit
    as a warm start does, matched by the checkpoint's object graph as TF matches them,
    and strictly: every variable is restored, or none is.
    """
    variables = _tracked_variables(tf, checkpoint)
    if not any(is_sharded(tf_variable(v)) for v in variables):
        checkpoint.restore(prefix).assert_existing_objects_matched().expect_partial()
        return
    if optimizer is not None and model is not None and getattr(optimizer, "built", True) is False:
        optimizer.build(model.trainable_variables)  # its slots must exist to receive their state, as Keras does
        variables = _tracked_variables(tf, checkpoint)
    source = Checkpoint(prefix)
    keys = object_graph_keys(checkpoint, source.object_graph, variables)
    by_id = {}
    for var in variables:
        by_id[id(var)] = var
        by_id.setdefault(id(tf_variable(var)), var)
    unmatched = [getattr(v, "path", v.name) for v in variables
                 if id(v) not in keys and id(tf_variable(v)) not in keys]
    if unmatched:
        raise IncompleteRestoreError(
            f"cannot resume from {prefix!r}: its object graph holds nothing for {len(unmatched)} of the "
            f"{len(variables)} variables being resumed: {format_names(unmatched)}. Was the model or optimizer "
            f"changed since the run saved it?"
        )
    mapping = {key: by_id[i] for i, key in keys.items()}
    restore(scan(source, mapping, skip_optimizer_slots=False, include_global_step=True), strict=True)


def _opens(path: str) -> bool:
    """True when h5py opens ``path``: Keras' ``load_weights`` fails with OSError exactly when it does not."""
    import h5py

    try:
        with h5py.File(path, "r"):
            return True
    except OSError:
        return False


def _backup(backup_dir) -> str | None:
    """The file ``keras.callbacks.BackupAndRestore`` will resume from in ``backup_dir``, or None.

    Keras 3 loads ``latest.weights.h5`` when it exists; only when that fails with an
    OSError (a file h5py cannot open) does it copy ``latest.weights.h5.bkp`` over it
    and load that. A ``.bkp`` without ``latest.weights.h5`` is never loaded: the run
    trains from whatever weights the model has, so it is not a backup to resume from.

    Raises:
        CorruptCheckpointError: ``latest.weights.h5`` cannot be opened and there is no
            ``.bkp``; Keras' BackupAndRestore would fail with an OSError.
    """
    if backup_dir is None:
        return None
    latest = os.path.join(os.fspath(backup_dir), _BACKUP_FILES[0])
    previous = os.path.join(os.fspath(backup_dir), _BACKUP_FILES[1])
    if not os.path.exists(latest):
        return None
    if _opens(latest):
        return latest
    if os.path.exists(previous):
        return previous
    raise CorruptCheckpointError(
        f"the backup {latest!r} is not a readable HDF5 file and there is no {os.path.basename(previous)!r} to fall "
        f"back to, so keras.callbacks.BackupAndRestore cannot resume from it. Move {latest!r} aside to start "
        f"afresh (warm-starting from the pretrained file), or restore a copy of it."
    )


class WarmStart(keras.callbacks.Callback):
    """A ``model.fit`` callback: warm-start from ``pretrained`` on a fresh run, stay out of a resumed one.

    On a fresh start it restores what fits from ``pretrained`` before the first batch
    (``on_train_begin``) and prints the report once. Used beside
    ``keras.callbacks.BackupAndRestore(backup_dir)`` with the same ``backup_dir``, a
    restarted run resumes from the backup: ``WarmStart`` then neither reads
    ``pretrained`` (it may be gone) nor overwrites the resumed weights, whatever the
    order of the callbacks. One line says which path was taken.

        model.fit(data, epochs=10, callbacks=[
            keras.callbacks.BackupAndRestore('backup/'),
            restorekit.WarmStart('pretrained.weights.h5', backup_dir='backup/', exclude=['head']),
        ])

    Args:
        pretrained: any checkpoint or Keras file ``restorekit.Checkpoint`` opens, or several
            (a list or ``{pattern: source}``, as ``restorekit.scan`` takes them).
        backup_dir: the ``BackupAndRestore`` directory, if one is used.
        strict: raise IncompleteRestoreError when the warm start is incomplete.
        verbose: 1 prints the line and the report (as Keras callbacks print); 0 logs
            them to the ``restorekit`` logger.
        **scan_options: passed to ``restorekit.scan``.

    Attributes:
        start: the ``Start`` once training began (None before).

    A backup counts exactly when Keras' ``BackupAndRestore`` resumes from it: a
    ``latest.weights.h5`` (or, when that cannot be opened, its ``.bkp``). A lone
    ``.bkp`` is not loaded by Keras, so the run warm-starts.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: ``pretrained`` cannot be read
            and ``backup_dir`` holds no backup (checked when made and again at the start).
        CorruptCheckpointError: ``latest.weights.h5`` cannot be opened and has no
            ``.bkp`` (BackupAndRestore would fail on it too).
    """

    def __init__(self, pretrained, *, backup_dir=None, strict: bool = False, verbose: int = 1, **scan_options):
        super().__init__()
        if pretrained is None:
            raise InvalidArgumentError("WarmStart needs a pretrained checkpoint or Keras file, got None")
        self.pretrained = os.fspath(pretrained) if isinstance(pretrained, os.PathLike) else pretrained
        self.backup_dir = backup_dir
        self.strict = strict
        self.verbose = verbose
        self.scan_options = scan_options
        self.start: Start | None = None
        if _backup(backup_dir) is None:
            self._check_pretrained()

    def _check_pretrained(self) -> None:
        for pretrained in source_paths(self.pretrained):
            self._check_one(pretrained)

    def _check_one(self, pretrained) -> None:
        if isinstance(pretrained, Checkpoint):
            return
        try:
            Checkpoint(pretrained)
        except (CheckpointNotFoundError, CorruptCheckpointError) as e:
            where = f"backup_dir {os.fspath(self.backup_dir)!r} holds no backup" if self.backup_dir is not None else (
                "no backup_dir was given")
            message = (
                f"WarmStart cannot start: pretrained {pretrained!r} is not readable ({e}) and {where}. "
                f"Pass an existing checkpoint or Keras file as pretrained, or the backup_dir of a run to resume."
            )
            if isinstance(e, CheckpointNotFoundError):
                raise CheckpointNotFoundError(message, str(pretrained)) from None
            raise CorruptCheckpointError(message) from None

    def _say(self, text: str) -> None:
        if self.verbose:
            print(text)
        else:
            _log.info("%s", text)

    def on_train_begin(self, logs=None):
        if self.start is not None:  # a second fit() with the same callback: the weights are the run's own
            return
        backup = _backup(self.backup_dir)
        if backup is not None:
            self.start = Start(RESUMED, backup)
            self._say(f"restorekit: resumed from backup {backup!r}; pretrained {self.pretrained!r} was not read")
            return
        self._check_pretrained()
        report = scan(self.pretrained, self.model, **self.scan_options)
        restore(report, strict=self.strict)
        self.start = Start(WARM_STARTED, report.checkpoint, report)
        self._say(f"{self.start}\n{report}")
