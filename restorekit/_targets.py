"""Targets: the variables a restore writes into, normalized to name, full shape, dtype, handle.

TF1 ref and resource variables, partitioned variables (grouped under their full name,
with the full shape from their save-slice info), TF2 ``ShardedVariable``s (one logical
variable, its shards as parts), Saver-style dicts, Keras 3 variables and ``tf.Module``s
all become the same ``Target`` records, so ``scan`` never needs to know where a
variable came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from restorekit._tensorflow import import_tensorflow
from restorekit.errors import InvalidArgumentError
from restorekit._names import strip_output_index, strip_partition
from restorekit import _flax_target as flax_target
from restorekit._torch_target import foreign_file_hint, is_torch_module, module_items
from restorekit._trackables import is_keras_variable, keras_backend, layer_paths, live_paths, tf_variable

__all__ = [
    "Target",
    "collect",
    "flat_variables",
    "is_keras_variable",
    "is_partitioned",
    "is_sharded",
    "sharded_container",
    "shards",
    "slice_info",
    "target_hints",
    "tf_variable",
    "variable_name",
]


@dataclass
class Target:
    """One restorable thing: a variable, all partitions of a partitioned variable, or a sharded one.

    A ``ShardedVariable`` (ParameterServerStrategy) is one Target named by its logical
    name, with the ShardedVariable as ``handle`` and its shards as ``parts``.
    """

    variable_name: str
    shape: tuple | None  # None: the rank is unknown (a TF1 variable of unknown shape)
    dtype: str
    handle: object
    # Fixed by a Saver-style {checkpoint_name: variable} dict; else derived by scan.
    checkpoint_name: str | None = None
    parts: list = field(default_factory=list)
    trainable: bool | None = None  # a Keras variable's own flag (enable_lora clears it; its tf.Variable keeps True)

    @property
    def partitioned(self) -> bool:
        return bool(self.parts)


def is_partitioned(obj) -> bool:
    """True for a TF1 ``PartitionedVariable`` (the whole, not one of its parts)."""
    # tf.compat.v1 exports no PartitionedVariable class to isinstance against.
    return type(obj).__name__ == "PartitionedVariable" and hasattr(obj, "_get_variable_list")


# ------------------------------------------------------------------ sharded variables (TF2)

def is_sharded(obj) -> bool:
    """True for a TF2 ``ShardedVariable`` (ParameterServerStrategy with a ``variable_partitioner``)."""
    # The class is exported only under tf.__internal__; its public marker is this property.
    # Read it on the type: shard wrappers forward unknown attributes to the variable they hold.
    return getattr(type(obj), "is_sharded_variable", None) is not None and getattr(obj, "is_sharded_variable", False) is True


def shards(obj) -> list:
    """The shard variables of a ShardedVariable, in order along axis 0; [] for anything else."""
    return list(obj.variables) if is_sharded(obj) else []


def sharded_container(var):
    """The ShardedVariable that shard ``var`` belongs to, or None."""
    # TF keeps the container only in the shard's private weakref '_sharded_container'
    # (set by ShardedVariable itself); tf.Module.variables lists the shards, not the container.
    ref = vars(var).get("_sharded_container") if hasattr(var, "__dict__") else None
    container = ref() if callable(ref) else None
    return container if is_sharded(container) else None


def _sharded_target(container, checkpoint_name=None, name=None) -> Target:
    parts = shards(container)
    logical = name or strip_partition(variable_name(parts[0]))
    return Target(logical, _shape(container), _dtype(container), container, checkpoint_name, parts=parts)


def _check_all_shards(container, given: list) -> None:
    missing = [variable_name(p) for p in shards(container) if all(p is not g for g in given)]
    if missing:
        raise InvalidArgumentError(
            f"{strip_partition(variable_name(given[0]))!r} is a ShardedVariable of {len(shards(container))} shards "
            f"but {missing} {'is' if len(missing) == 1 else 'are'} not among the variables; pass the model, the "
            "ShardedVariable or all its shards"
        )


def variable_name(var) -> str:
    """Graph name without ':0' (Keras 3 variables: their ``path``)."""
    if is_keras_variable(var):
        return var.path
    return strip_output_index(var.name)


def slice_info(var):
    """A partition's save-slice info (full name, full shape, offset), or None for a whole variable."""
    # The full name and shape of a partition live only here; tf.Variable exposes
    # no public accessor for it.
    return getattr(var, "_save_slice_info", None)


def _shape(var) -> tuple | None:
    shape = var.shape
    if hasattr(shape, "as_list"):
        if shape.rank is None:
            return None
        return tuple(shape.as_list())
    return tuple(shape)


def _dtype(var) -> str:
    dtype = var.dtype
    base = getattr(dtype, "base_dtype", None)
    if base is not None:
        return base.name
    return str(dtype).replace("<dtype: '", "").rstrip("'>")


def _partition_target(name: str | None, parts: list, checkpoint_name=None) -> Target:
    info = slice_info(parts[0])
    full_shape: tuple | None
    if info is not None:
        full_shape = tuple(info.full_shape)
        full_name = info.full_name
    else:
        full_name = strip_partition(variable_name(parts[0]))
        full_shape = _shape(parts[0])
    return Target(name or full_name, full_shape, _dtype(parts[0]), parts, checkpoint_name, parts=list(parts))


def _from_object(obj, checkpoint_name=None) -> list[Target]:
    if is_sharded(obj):
        return [_sharded_target(obj, checkpoint_name)]
    if is_partitioned(obj):
        parts = list(obj)
        return [_partition_target(strip_output_index(obj.name), parts, checkpoint_name)]
    if isinstance(obj, (list, tuple)) and obj and all(slice_info(v) is not None for v in obj):
        return [_partition_target(None, list(obj), checkpoint_name)]
    if is_keras_variable(obj):
        if is_sharded(obj.value):
            return [_sharded_target(obj.value, checkpoint_name, name=obj.path)]
        # On TensorFlow the tf.Variable inside is assigned (distributed and sharded ones too);
        # on another backend the Keras variable itself, through its own assign.
        handle = obj.value if keras_backend(obj) == "tensorflow" else obj
        return [Target(obj.path, _shape(obj), _dtype(obj), handle, checkpoint_name, trainable=bool(obj.trainable))]
    if not hasattr(obj, "dtype") or not hasattr(obj, "shape") or not hasattr(obj, "name"):
        raise InvalidArgumentError(f"expected a variable, got {type(obj).__name__}: {obj!r}")
    return [Target(variable_name(obj), _shape(obj), _dtype(obj), obj, checkpoint_name)]


def _is_single_variable(obj) -> bool:
    return is_keras_variable(obj) or (hasattr(obj, "dtype") and hasattr(obj, "shape") and hasattr(obj, "name"))


def collect(variables=None) -> list[Target]:
    """Normalize the ``variables`` argument of scan and friends into Targets.

    Args:
        variables: None (the default graph's global variables), a list of variables
            (ref, resource, Keras 3, or PartitionedVariable), a dict
            ``{checkpoint_name: variable or list of partitions}`` as a Saver takes,
            or an object with a ``variables`` attribute (Keras model, tf.Module),
            or a ``torch.nn.Module`` (its ``state_dict`` keys, parameters and buffers),
            or a Flax ``nnx.Module`` (its Variables' paths joined with '/', ``layers/0/kernel``).

    Raises:
        InvalidArgumentError: an element that is not a variable, or no variables at all
            in eager mode with ``variables=None``.
    """
    if is_torch_module(variables):
        return [Target(key, shape, dtype, tensor) for key, shape, dtype, tensor in module_items(variables)]
    if flax_target.is_flax_module(variables):
        return [Target(name, shape, dtype, variable, trainable=trainable)
                for name, shape, dtype, variable, trainable in flax_target.module_items(variables)]
    if variables is None:
        tf = import_tensorflow()

        if tf.executing_eagerly():
            raise InvalidArgumentError(
                "variables=None means the default graph's global variables, but TensorFlow is executing "
                "eagerly; pass a Keras model, a tf.Module or a list of variables"
            )
        variables = tf.compat.v1.global_variables()
    if isinstance(variables, dict):
        targets = []
        for key, value in variables.items():
            if not isinstance(key, str) or not key:
                raise InvalidArgumentError(f"a variables dict maps checkpoint names (str) to variables, got key {key!r}")
            targets.extend(_from_object(value, checkpoint_name=key))
        return targets
    root = None
    if is_sharded(variables):  # one variable, like a PartitionedVariable (it also has a 'variables' list)
        variables = [variables]
    elif not isinstance(variables, (list, tuple)) and hasattr(variables, "variables"):
        root = variables
        variables = list(variables.variables)
    if is_partitioned(variables):
        variables = [variables]
    elif isinstance(variables, (str, bytes)) or not hasattr(variables, "__iter__") or _is_single_variable(variables):
        # A lone variable would be iterated element by element (eager) or fail (graph).
        raise InvalidArgumentError(
            f"variables is a list of variables, a {{checkpoint_name: variable}} dict, a Keras model or a tf.Module; "
            f"got {type(variables).__name__}: {variables!r}" + ("; pass [variable]" if _is_single_variable(variables) else "")
        )
    targets = _gather(variables)
    if root is not None:
        _unique_names(targets, root)
    return targets


def _gather(variables) -> list[Target]:
    """Targets for a list of variables: partitions and shards grouped into one target each, in first-seen order."""
    targets: list[Target] = []
    groups: dict[str, list] = {}
    sharded: dict[int, list] = {}
    seen: set[int] = set()
    for obj in variables:
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        container = sharded_container(obj)
        if container is not None:
            _add_shard(container, obj, sharded, targets)
            continue
        info = slice_info(obj) if not is_partitioned(obj) else None
        if info is not None:
            if info.full_name not in groups:
                groups[info.full_name] = []
                targets.append(info.full_name)  # placeholder keeps order
            groups[info.full_name].append(obj)
            continue
        targets.extend(_from_object(obj))
    return [_placed(t, groups, sharded) for t in targets]


def _add_shard(container, shard, sharded: dict, targets: list) -> None:
    """Group a shard under its ShardedVariable (listed once, where its first shard was)."""
    if id(container) not in sharded:
        sharded[id(container)] = [container]
        targets.append(id(container))  # placeholder keeps order
    sharded[id(container)].append(shard)


def _placed(t, groups: dict, sharded: dict) -> Target:
    """A Target for each ordering placeholder left by ``collect``."""
    if isinstance(t, str):
        return _partition_target(t, groups[t])
    if isinstance(t, int):
        container, *given = sharded[t]
        _check_all_shards(container, given)
        return _sharded_target(container)
    return t


def _unique_names(targets: list[Target], root) -> None:
    """Rename variables whose names repeat to their path in ``root``: through the named layers that hold them
    (``block_a/fc/kernel`` for two nested blocks' ``fc/kernel``), else their attribute path (tf.Module's 'Variable')."""
    counts: dict[str, int] = {}
    for t in targets:
        counts[t.variable_name] = counts.get(t.variable_name, 0) + 1
    if all(n == 1 for n in counts.values()):
        return

    paths = {**live_paths(root), **layer_paths(root)}
    for t in targets:
        if counts[t.variable_name] > 1 and id(t.handle) in paths:
            t.variable_name = paths[id(t.handle)]


def target_hints(found, variables, layout, rules) -> tuple:
    """Hints that depend on what the targets are, from what a scan ``found`` (its ``ckpt``, ``matched``,
    ``missing``, ``unused``): TF leaf names for a Flax module (``rules=FLAX_FROM_TF``); a PyTorch file
    scanned by name into TF or Keras variables pairs nothing (``layout='torch'``)."""
    if flax_target.is_flax_module(variables):
        return flax_target.flax_hints(rules, found.missing, found.unused)
    if layout is not None or found.matched or is_torch_module(variables):
        return ()
    return foreign_file_hint(found.ckpt, found.unused)


def flat_variables(handles) -> list:
    """Every tf.Variable behind Targets or report handles: partitions as their parts."""
    out = []
    for h in handles:
        if isinstance(h, Target):
            h = h.parts or [h.handle]
        elif is_sharded(h):
            h = shards(h)
        out.extend(h if isinstance(h, list) else [h])
    return out


# ------------------------------------------------------------------ Keras LoRA (layer.enable_lora)

LORA_LEAVES = ("lora_kernel_a", "lora_kernel_b")
LORA_NEW = "LoRA adapter (new)"


def is_lora_adapter(t: Target) -> bool:
    """True for a Keras ``lora_kernel_a`` / ``lora_kernel_b`` (what ``layer.enable_lora(rank)`` adds)."""
    return t.variable_name.rsplit("/", 1)[-1] in LORA_LEAVES


def absent_record(t: Target, checkpoint_name: str | None):
    """The record of a variable with no entry: a LoRA adapter skipped as new, anything else missing."""
    from restorekit._report import Record

    if is_lora_adapter(t):
        return Record(t.variable_name, None, t.shape, t.dtype, reason=LORA_NEW, how=("lora_adapter",))
    return Record(t.variable_name, checkpoint_name, t.shape, t.dtype)


def lora_notes(targets: list) -> tuple:
    """One line for a model with LoRA layers: which base kernels ``enable_lora`` froze (restored, trainable=False)."""
    scopes = {t.variable_name.rsplit("/", 1)[0] for t in targets if is_lora_adapter(t)}
    frozen = [t.variable_name for t in targets if t.variable_name.rsplit("/", 1)[0] in scopes
              and not is_lora_adapter(t) and t.trainable is False]
    if not scopes:
        return ()
    shown = ", ".join(frozen[:4]) + (f", ... and {len(frozen) - 4} more" if len(frozen) > 4 else "")
    return (f"{len(scopes)} LoRA layer(s): base {'kernels' if len(frozen) != 1 else 'kernel'} {shown or '(none)'} "
            f"frozen (trainable=False); their lora_kernel_a/lora_kernel_b are new, left as Keras initialized them "
            f"(skipped: {LORA_NEW}).",)
