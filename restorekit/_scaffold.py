"""easy_going_scaffold: a MonitoredTrainingSession Scaffold that restores what fits and initializes the rest.

Composed from the smaller pieces: ``scan`` plans, ``partial_saver`` (or ``warm_start``)
restores, a ``variables_initializer`` over the rest initializes.
"""

from __future__ import annotations

import logging

from restorekit._tensorflow import import_tensorflow
from restorekit._report import live_handles, nothing_matched
from restorekit._rundir import name_in_state_file, resume_point
from restorekit._scan import scan
from restorekit._targets import collect, flat_variables
from restorekit._sources import source_paths
from restorekit._tf1 import build_initializer, restore_ops, source_savers

__all__ = ["easy_going_scaffold"]

_log = logging.getLogger("restorekit")


def easy_going_scaffold(
    checkpoint, variables=None, *, strict: bool = False, saver=None, checkpoint_dir=None, **scan_options
):
    """A ``tf.compat.v1.train.Scaffold`` that warm-starts a new graph from ``checkpoint``.

    * Fresh start (no checkpoint in the session's ``checkpoint_dir``): the chief
      initializes only the variables that will not be restored, then restores the
      matched ones from ``checkpoint``.
    * Restart: an existing checkpoint in ``checkpoint_dir`` wins and ``checkpoint``
      is not read again (the standard MonitoredTrainingSession behaviour). Pass the
      session's ``checkpoint_dir`` here too and, when it holds a checkpoint,
      ``checkpoint`` is not even opened (it may be gone): the Scaffold is a plain one,
      ``restore_report`` is None, and one log line says "resumed from ...".
      The checkpoint resumed from is the newest complete and readable one
      (``restorekit._rundir.resume_point``, as for ``resume_or_warm_start``): when the
      ``checkpoint`` state file names another (vanished, damaged) or none, it is
      rewritten to name the one chosen, since the session restores what it names; a
      RestoreKitWarning lists what was passed over.
    * Non-chief workers wait until the chief's variables are ready; ``ready_op``
      covers every global, local and scanned variable.

    The scan happens now, while the graph is built (it reads only the index), so
    ``scaffold.restore_report`` is available before the session starts. In a
    ps/worker cluster the restore ops run on the parameter servers, which must be
    able to read ``checkpoint``.

    Args:
        checkpoint: a Checkpoint or path (prefix, directory, SavedModel, ...), or several
            sources as ``restorekit.scan`` takes them (a list, or ``{pattern: source}``):
            one initializer, and one Saver per TF source, each file read once.
        variables: as ``restorekit.scan`` takes; None means global variables.
        strict: raise IncompleteRestoreError (carrying the report) when anything is
            missing or mismatched.
        saver: the Saver for ``checkpoint_dir`` (default: the Scaffold's own).
        checkpoint_dir: the MonitoredTrainingSession's ``checkpoint_dir``, to resume
            from without reading ``checkpoint``.
        **scan_options: passed to ``restorekit.scan`` (assignment_map, include,
            exclude, ema, skip_optimizer_slots, include_global_step).

    Returns:
        A Scaffold with an extra attribute ``restore_report``.

    Raises:
        NoMatchError: nothing in ``checkpoint`` matched (the message holds the report
            and its hints, such as an ``assignment_map`` for a scope that differs).
            Not raised when resuming from ``checkpoint_dir``.
        IncompleteRestoreError: strict=True and the restore cannot be complete.
        RunDirectoryError: ``checkpoint_dir`` holds checkpoints but none is complete
            and readable, or its state file names a checkpoint outside it (starting
            from scratch would overwrite the run; resuming would read another run).

    Example:
        >>> scaffold = restorekit.easy_going_scaffold('pretrained/', exclude=['logits'])
        >>> with tf.compat.v1.train.MonitoredTrainingSession(scaffold=scaffold, checkpoint_dir=d) as s: ...
    """
    tf = import_tensorflow()

    tf1 = tf.compat.v1
    point = resume_point(checkpoint_dir, pretrained=source_paths(checkpoint)) if checkpoint_dir is not None else None
    if point is not None:
        # The session restores everything from the prefix the state file names and runs
        # no init op or init_fn; so the state file must name the one decided here.
        name_in_state_file(point)
        _log.info("resumed from %r; the pretrained checkpoint %r was not read", point.prefix, str(checkpoint))
        scaffold = tf1.train.Scaffold(saver=saver)
        scaffold.restore_report = None
        return scaffold
    report = scan(checkpoint, variables, **scan_options)
    if strict:
        report.assert_complete()
    if not report.matched:
        # A warm start that restores nothing would train from scratch without a word.
        raise nothing_matched(report)
    ops = restore_ops(report)
    with tf1.name_scope("restorekit"):
        for record in ops.initialized:
            build_initializer(report, record)
        init_fn = _restore_fn(report, ops.saved)
        init_op, ready_op, ready_for_local_init_op = _init_and_ready_ops(tf1, report, variables, ops.saved)
    scaffold = tf1.train.Scaffold(
        init_op=init_op,
        init_fn=init_fn,
        ready_op=ready_op,
        ready_for_local_init_op=ready_for_local_init_op,
        saver=saver,
    )
    scaffold.restore_report = report
    return scaffold


def _restore_fn(report, saved):
    """The Scaffold's ``init_fn``: a Saver per source over exactly ``saved`` restores them; None when there are none."""
    if not saved:
        return None
    savers = source_savers(report, saved)

    def init_fn(scaffold, session):
        for prefix, restore_saver in savers.items():
            restore_saver.restore(session, prefix)

    return init_fn


def _init_and_ready_ops(tf1, report, variables, saved):
    """Initialize every variable the Saver does not restore; ready when all scanned and global ones are."""
    scanned = flat_variables(collect(variables))
    all_globals = list(tf1.global_variables())
    known = {id(v) for v in all_globals}
    everything = all_globals + [v for v in scanned if id(v) not in known]
    handles = live_handles(report)
    restored = {id(v) for v in flat_variables(handles[r.variable_name] for r in saved)}
    init_op = tf1.variables_initializer([v for v in everything if id(v) not in restored], name="init_not_restored")
    ready_op = tf1.report_uninitialized_variables(everything + list(tf1.local_variables()))
    ready_for_local_init_op = tf1.report_uninitialized_variables(everything)
    return init_op, ready_op, ready_for_local_init_op
