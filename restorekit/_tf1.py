"""TF1 graph-mode restore machinery from a RestoreReport: a Saver over the matches, warm-start initializers.

The eager (TF2, Keras 3) counterpart is ``restorekit._tf2.restore``.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from restorekit._tensorflow import import_tensorflow
from restorekit import _remap as remap
from restorekit.errors import AssignmentMapError, InvalidArgumentError, format_names
from restorekit.formats import detect
from restorekit._report import RestoreReport, live_handles, nothing_matched, plain_records, policy_of

__all__ = [
    "RestoreOps",
    "assign_from_checkpoint_fn",
    "build_initializer",
    "partial_saver",
    "plain_records",
    "restore_ops",
    "source_savers",
    "warm_start",
]


def _shared_tensors(records) -> list[str]:
    """Checkpoint names that feed more than one of ``records`` (a Saver cannot restore those)."""
    counts = Counter(r.checkpoint_name for r in records)
    return sorted(name for name, n in counts.items() if n > 1)


@dataclass(frozen=True)
class RestoreOps:
    """How a report is restored in a TF1 graph, decided once.

    ``saved``: records a Saver restores (plain copies, one variable per tensor);
    ``initialized``: records whose initializers read the checkpoint (shape policies,
    vocabularies, casts, and every record when one tensor feeds several variables).
    """

    saved: tuple
    initialized: tuple


def restore_ops(report: RestoreReport) -> RestoreOps:
    """Decide which matched records a Saver restores and which get checkpoint-reading initializers.

    Per source (a report may restore from several): a Saver for a TF bundle's plain copies;
    from another format, or where one tensor feeds several variables, reading initializers.
    """
    saved = []
    for source, plain in report.by_source(plain_records(report)).items():
        # a Saver reads TF bundles only: from another format every record gets a reading initializer
        if not _shared_tensors(plain) and detect(source) == "tf":
            saved.extend(plain)
    ids = {id(r) for r in saved}
    return RestoreOps(tuple(saved), tuple(r for r in report.matched if id(r) not in ids))


def build_initializer(report: RestoreReport, record) -> None:
    """Make ``record``'s variable initializer read its value from the checkpoint (through its policy, if any)."""
    tf = import_tensorflow()

    source = report.source_of(record)
    if policy_of(report, record.variable_name) is not None:
        remap.tf1_initializer(report, record)
    elif os.path.isdir(source) or detect(source) != "tf":
        # init_from_checkpoint would take this prefix for a directory holding a 'checkpoint' file,
        # and reads TF bundles only
        remap.tf1_copy_initializer(report, record)
    else:
        tf.compat.v1.train.init_from_checkpoint(
            source, {record.checkpoint_name: live_handles(report)[record.variable_name]}
        )


def _same_graph_handles(report: RestoreReport) -> dict:
    """The report's variables, checked to live in the default graph (a Saver or initializer is built there)."""
    tf = import_tensorflow()

    handles = live_handles(report)
    if tf.executing_eagerly():
        return handles
    graph = tf.compat.v1.get_default_graph()
    for name, handle in handles.items():
        for variable in handle if isinstance(handle, (list, tuple)) else [handle]:
            if getattr(variable, "graph", graph) is not graph:
                raise InvalidArgumentError(
                    f"the report's variable {name!r} belongs to another graph than the default one; call "
                    "restorekit.scan and build the restore inside the same `with graph.as_default():` block"
                )
    return handles


def _saver_var_list(report: RestoreReport, plain: list) -> dict:
    handles = _same_graph_handles(report)
    shared = _shared_tensors(plain)
    if shared:
        feeding = [r.variable_name for r in plain if r.checkpoint_name == shared[0]]
        raise AssignmentMapError(
            f"a Saver restores each checkpoint tensor into one variable, but {shared[0]!r} feeds "
            f"{format_names(feeding)}" + (f" (and {len(shared) - 1} more shared tensors)" if len(shared) > 1 else "")
            + ". Use restorekit.warm_start(report), which lets one tensor initialize several variables."
        )
    return {r.checkpoint_name: handles[r.variable_name] for r in plain}


def partial_saver(report: RestoreReport, **saver_kwargs):
    """A ``tf.compat.v1.train.Saver`` over exactly the matched variables, keyed by checkpoint name.

    Call ``saver.restore(session, report.checkpoint)`` to restore them. Partitioned
    variables restore across different partitionings. Matches that need a shape
    policy or a vocabulary remap are left out: ``warm_start`` applies those.

    Args:
        report: from ``restorekit.scan`` in this graph.
        **saver_kwargs: passed to the Saver (``sharded``, ``name``, ...).

    Raises:
        AssignmentMapError: one checkpoint tensor feeds several variables (a Saver
            cannot); use ``warm_start`` for that.
        NoMatchError: nothing matched (an InvalidArgumentError, as before).
        InvalidArgumentError: the report lost its variables, or restores from several
            sources (a Saver reads one checkpoint: ``source_savers`` gives one per source).
    """
    if len(report.sources) > 1:
        raise InvalidArgumentError(
            f"a Saver restores from one checkpoint, and this report restores from {len(report.sources)}; use "
            "restorekit.source_savers(report) (a Saver per source), assign_from_checkpoint_fn(report), "
            "warm_start(report) or easy_going_scaffold"
        )
    savers = source_savers(report, plain_records(report), **saver_kwargs)
    if not savers:
        if report.matched:
            raise InvalidArgumentError(
                "every match goes through a shape policy or vocabulary remap, which a Saver cannot apply; "
                "use restorekit.warm_start(report) or restorekit.easy_going_scaffold"
            )
        raise nothing_matched(report)
    return next(iter(savers.values()))


def source_savers(report: RestoreReport, records=None, **saver_kwargs) -> dict:
    """``{checkpoint: Saver}``: one ``tf.compat.v1.train.Saver`` per source over its ``records``.

    ``records`` defaults to the plain copies (``plain_records``); a report from several
    sources restores with ``for path, saver in savers.items(): saver.restore(session, path)``,
    each file read once.

    Raises:
        InvalidArgumentError: a source is not a TF checkpoint (a Saver reads only those).
        AssignmentMapError: one checkpoint tensor feeds several variables.
    """
    tf = import_tensorflow()

    grouped = report.by_source(plain_records(report) if records is None else records)
    for source in grouped:
        fmt = detect(source)
        if fmt != "tf":
            raise InvalidArgumentError(
                f"a Saver restores TF checkpoints only, and {source!r} is a {fmt} file; use "
                "restorekit.warm_start(report) or restorekit.easy_going_scaffold, which read any format"
            )
    var_lists = {source: _saver_var_list(report, plain) for source, plain in grouped.items()}
    saver_kwargs.setdefault("name", "restorekit_partial_saver")
    return {source: tf.compat.v1.train.Saver(var_list=var_list, **saver_kwargs)
            for source, var_list in var_lists.items() if var_list}


def assign_from_checkpoint_fn(report: RestoreReport):
    """A callback ``fn(session)`` that restores the matched variables (tf-slim's word for it).

    Builds its Saver now (one per source of a several-source report), so the graph can
    be finalized afterwards.
    """
    savers = {report.checkpoint: partial_saver(report)} if len(report.sources) <= 1 else source_savers(report)

    def restore(session):
        for source, saver in savers.items():
            saver.restore(session, source)

    return restore


def warm_start(report: RestoreReport) -> None:
    """Make the matched variables' initializers read their values from the checkpoint.

    The ``init_from_checkpoint`` way, for code that never calls a Saver: after this,
    running ``tf.compat.v1.global_variables_initializer()`` (or a Scaffold's init
    op) loads the checkpoint values. One checkpoint tensor may feed several variables;
    shape policies and vocabulary remaps (``scan(shape_policy=..., vocab=...)``) apply.
    """
    _same_graph_handles(report)
    if not report.matched:
        raise nothing_matched(report, "warm-start")
    for record in report.matched:
        build_initializer(report, record)
