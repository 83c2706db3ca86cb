"""Distributed variables and strategies: assigning a restored value to sharded and mirrored variables.

Under ``ParameterServerStrategy`` with a ``variable_partitioner`` a variable is a
``ShardedVariable``: ``restorekit._targets`` collects it as one target under its logical
name, and here its full value from the checkpoint is cut along axis 0, each shard
getting its slice on its own parameter server. The checkpoint side needs nothing:
``tf.train.Checkpoint`` saves a ShardedVariable as one logical tensor (its shards as
slices), so a checkpoint written with any number of shards, or none, reads whole.

Under ``MirroredStrategy`` / ``MultiWorkerMirroredStrategy`` every local replica is
assigned the same value; each worker reads the checkpoint itself, so all end equal
without a collective. ``is_chief`` and ``write_directory`` give the usual rule that
only the chief writes.
"""

from __future__ import annotations

import os

from restorekit._tensorflow import import_tensorflow
from restorekit.errors import InvalidArgumentError
from restorekit._names import strip_output_index, strip_partition
from restorekit._targets import is_sharded, sharded_container, shards

__all__ = [
    "assign",
    "is_chief",
    "is_sharded",
    "logical_name",
    "shard_bounds",
    "sharded_container",
    "shards",
    "write_directory",
]


def shard_bounds(handle) -> list[tuple[int, int]]:
    """[start, stop) along axis 0 of each shard of a ShardedVariable, in order."""
    bounds, start = [], 0
    for part in shards(handle):
        stop = start + int(part.shape[0])
        bounds.append((start, stop))
        start = stop
    return bounds


def _replicas(handle) -> list:
    """Every local copy of a variable: the replicas of a mirrored variable, else itself."""
    values = getattr(handle, "values", None)
    if isinstance(values, tuple) and values:
        return list(values)
    return [handle]


def assign(handle, value) -> None:
    """Assign a full (logical) value to a variable, whatever its distribution.

    A ShardedVariable gets ``value[start:stop]`` in each shard (the slice is cut on the
    coordinator, so each parameter server receives only its part); a mirrored variable
    gets ``value`` in every local replica; anything else is assigned directly.

    Raises:
        InvalidArgumentError: a value whose shape does not cover the sharded variable.
    """
    if not is_sharded(handle):
        for replica in _replicas(handle):
            replica.assign(value, read_value=False)
        return
    tf = import_tensorflow()

    value = tf.convert_to_tensor(value)
    bounds = shard_bounds(handle)
    if value.shape.rank is None or value.shape.rank == 0 or value.shape[0] != bounds[-1][1]:
        raise InvalidArgumentError(
            f"a value of shape {value.shape.as_list() if value.shape.rank is not None else '?'} cannot fill the "
            f"sharded variable {logical_name(handle)!r} of shape {handle.shape.as_list()}"
        )
    for part, (start, stop) in zip(shards(handle), bounds):
        part.assign(value[start:stop], read_value=False)


def logical_name(handle) -> str:
    """The logical name of a ShardedVariable: its first shard's name without '/part_0:0'."""
    parts = shards(handle)
    return strip_partition(strip_output_index(parts[0].name)) if parts else getattr(handle, "name", "?")


# ------------------------------------------------------------------ who writes

def is_chief(strategy=None) -> bool:
    """True on the one task that writes checkpoints and summaries.

    ``strategy`` defaults to the current one (``tf.distribute.get_strategy()``).
    Single-machine strategies and ParameterServerStrategy's coordinator are the chief;
    under MultiWorkerMirroredStrategy it is the task TF_CONFIG names ``chief``, or
    worker 0 when there is no chief job.
    """
    tf = import_tensorflow()

    strategy = strategy or tf.distribute.get_strategy()
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type in (None, "chief"):
        return True
    if task_type == "worker":
        return task_id == 0 and "chief" not in resolver.cluster_spec().jobs
    return False


def write_directory(directory: str, strategy=None) -> str:
    """Where this task saves: ``directory`` on the chief, a private scratch directory elsewhere.

    Under MultiWorkerMirroredStrategy every worker must take part in a save (the
    variables' values are gathered collectively), but only the chief's files are
    kept; the others write under ``directory/.worker-<type>-<id>`` and delete it
    afterwards (``tf.io.gfile.rmtree``), so the chief's checkpoint is the only one.
    """
    if is_chief(strategy):
        return directory
    tf = import_tensorflow()

    resolver = (strategy or tf.distribute.get_strategy()).cluster_resolver
    return os.path.join(directory, f".worker-{resolver.task_type}-{resolver.task_id}")
