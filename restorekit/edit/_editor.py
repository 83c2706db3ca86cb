"""CheckpointEditor: the one public class of restorekit.edit; each method checks its arguments and updates the plan."""

from __future__ import annotations

import builtins
import os
import shlex
import re
import warnings

import numpy as np

from restorekit._bundle import files
from restorekit._bundle.locking import output_lock
from restorekit._bundle.format import dtype_name
from restorekit._checkpoint import Checkpoint, Entry, resolve_prefix, state_file_points_outside
from restorekit.edit import _keras_renames as keras_renames, _renames as renames, _save_keras as save_keras, _values as values
from restorekit.edit._plan import FLOATS, Item, check_new_name, initial_plan, lookup, select
from restorekit.edit._save_export import save_export, with_options
from restorekit.edit._save_remote import save_remote
from restorekit.edit._save_shards import save_shards, splits
from restorekit.edit._save_tf import missing_directories, remove_if_empty, save_tf
from restorekit.edit._source import Source
from restorekit.formats import _sinks as formats
from restorekit.formats import detect
from restorekit._bundle.ranks import splittable
from restorekit.export._request import KERAS_LEGACY, KERAS_SHARDED, check, given, renamed_keywords, request
from restorekit.export._targets import target_format
from restorekit.keras_files._legacy_writer import is_legacy_name
from restorekit.keras_files._reader import KerasCheckpoint
from restorekit.errors import (
    CorruptCheckpointError,
    EditError,
    InvalidArgumentError,
    NoMatchError,
    OutputError,
    OutputExistsError,
    RestoreKitWarning,
    format_names,
)
from restorekit._names import PatternSet, optimizer_slot_kind


class CheckpointEditor:
    """Edit a TensorFlow checkpoint and save the result, streaming and atomically.

        ed = CheckpointEditor('ckpt/model.ckpt-1000')
        ed.rename_all([(r'^bert/', 'encoder/')])
        ed.set('cls/bias', np.zeros(2, np.float32))
        ed.strip_optimizer_slots()
        ed.save('out/model.ckpt')

    Nothing is read until needed: edits are checked against the index at once (a bad
    argument raises at that call and queues nothing) and applied when saving.
    ``get`` and ``list`` show the checkpoint as it would be saved.

    Saving streams one tensor at a time: unchanged tensors are never decoded. Without
    ``compact=True`` the source data shards are reused (hard-linked, or copied across
    filesystems) and only the index plus one extra shard with the changed tensors is
    written; ``compact=True`` writes one new shard with only the kept tensors' bytes.
    Either way every byte taken from the source is crc32c checked before the output
    is committed. Files are written under temporary names in the target directory and
    renamed into place, the ``.index`` last; a crash leaves no output or a complete one.

    Partitioned (sliced) variables keep their slices when renamed or copied; an edit of
    their values (``set``, ``cast``, ...) stores them as one full tensor, which TF's
    readers slice on restore.

    TF2 object-based checkpoints: ``set``, ``add`` and ``cast`` leave the object graph
    (``_CHECKPOINTABLE_OBJECT_GRAPH``) as it is. ``delete`` keeps it consistent (the
    deleted tensor's attribute is removed from the graph). ``rename`` keeps it
    consistent while new names keep their ``/.ATTRIBUTES/...`` part: the graph's
    ``checkpoint_key`` is updated, so ``tf.train.Checkpoint.restore`` still restores each
    value *to the object it came from* (a rename does not move a value to another
    object; ``get`` it and ``set`` it on the other key for that). A rename that drops
    ``/.ATTRIBUTES/`` converts the output to a name-based checkpoint: the graph entry is
    left out and a ``RestoreKitWarning`` says so. The graph is rewritten by restorekit's
    own codec (``restorekit._bundle.objectgraph``), without TensorFlow.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``path``.
        InvalidArgumentError: ``path`` holds another format (safetensors, .pt, .npz): convert it first.
    """

    def __init__(self, path):
        fmt = detect(path) if isinstance(path, (str, os.PathLike)) else "tf"
        if fmt not in ("tf", "keras") and os.path.exists(path):
            name = os.fspath(path)
            raise InvalidArgumentError.worded(lambda w: (
                f"{w.either('CheckpointEditor edits', 'restorekit rename, strip and cast edit')} TF checkpoints and "
                f"Keras files, and {name!r} is a {fmt} file; convert it first ("
                + w.either(f"restorekit.convert({name!r}, 'model.ckpt')", f"restorekit convert {shlex.quote(name)} model.ckpt")
                + ") and edit the result"))
        self._keras = fmt == "keras"
        self._source: Source | None = None
        self._opened: tuple | None = None
        if self._keras:
            self.prefix = os.fspath(path)
            self._through_outside_state = None
            # Opened now (CheckpointNotFoundError, CorruptCheckpointError here, not at the first edit), and kept:
            # every edit and save reads this one open file.
            self._opened = _fingerprint(self.prefix)
            self._source = Source(Checkpoint(self.prefix))
        else:
            self.prefix = resolve_prefix(path)
            self._through_outside_state = state_file_points_outside(path)
        self._items: dict[str, Item] | None = None
        self._layer_names: dict[str, str] = {}  # Keras 3 files: '<group>/vars' -> its layer's new name

    def __repr__(self) -> str:
        return f"CheckpointEditor({self.prefix!r})"

    # ------------------------------------------------------------------ state
    @property
    def checkpoint(self) -> Checkpoint:
        """The source checkpoint (its index is read on first use)."""
        return self._reader.checkpoint

    @property
    def _keras_file(self) -> KerasCheckpoint:
        """The source as the Keras file it is (an editor of a Keras file)."""
        ckpt = self.checkpoint
        assert isinstance(ckpt, KerasCheckpoint), "only an editor of a Keras file has one"
        return ckpt

    @property
    def _reader(self) -> Source:
        if self._source is None:
            self._opened = _fingerprint(self.prefix)  # what save_in_place must still find
            self._source = Source(Checkpoint(self.prefix))
        return self._source

    @property
    def _plan(self) -> dict[str, Item]:
        if self._items is None:
            self._items = initial_plan(self.checkpoint)
        return self._items

    def _key(self, name):
        """``name``, or in a TF2 checkpoint the key its readable path ``name`` is stored under.

        Keras 3 keys often name no layer (``optimizer/_trainable_variables/0/.ATTRIBUTES/
        VARIABLE_VALUE``); ``set('fc1/kernel', ...)`` means the entry ``Checkpoint.
        object_paths`` gives for that path, as long as it has not been renamed.
        """
        if isinstance(name, str) and name not in self._plan and self._layer_names:
            found = {path: key for key, path in self._keras_paths().items()}.get(name)
            return found if found in self._plan else name
        if isinstance(name, str) and name not in self._plan:
            try:
                key = self.checkpoint.object_paths.get(name)
            except CorruptCheckpointError:  # an unreadable object graph: raw keys only
                return name
            if key is not None and key in self._plan:
                return key
        return name

    def _keras_paths(self) -> dict:
        return keras_renames.readable_paths(self.checkpoint, self._layer_names)[0]

    def _by_layer(self, name) -> bool:
        """True when ``name`` is a readable path of a Keras 3 file: renamed as a layer, not as a key."""
        return self._keras and isinstance(name, str) and name not in self._plan and self._keras_file.is_weights_file

    def _item(self, name) -> Item:
        return lookup(self._plan, name, self.prefix)

    def _select(self, pattern, *, what: str) -> list[str]:
        return select(self._plan, pattern, what=what, prefix=self.prefix, key=self._key)

    # ------------------------------------------------------------------ reading
    def list(self, pattern=None) -> list[Entry]:
        """Entries (name, shape, dtype, nbytes) as they would be saved, in entry order.

        Args:
            pattern: keep the names this pattern takes, by the one rule every restorekit
                pattern follows (``restorekit._names``: a regex from the start of the name,
                ending at a scope boundary; ``'.*Adam'`` to match anywhere); None keeps all.

        Raises:
            NoMatchError: ``pattern`` takes no name (the error suggests the pattern meant).
        """
        names = list(self._plan)
        if pattern is not None:
            patterns = PatternSet([pattern], what="list pattern")
            names = [n for n in names if patterns.first_match(n) is not None]
            patterns.check_all_used(self._plan)
        return [Entry(n, tuple(self._plan[n].shape), dtype_name(self._plan[n].dtype), self._reader.nbytes(self._plan[n]))
                for n in names]

    def get(self, name: str) -> np.ndarray:
        """The value of ``name`` as it would be saved (a new array; crc checked).

        Raises:
            NoMatchError: no such entry.
            CorruptCheckpointError: the source bytes are truncated or fail their crc32c.
        """
        name = self._key(name)
        item = self._item(name)
        value = self._reader.value(item)
        # A value given to set/add is returned as a copy, so editing it changes nothing queued.
        return value.copy() if isinstance(item.base, np.ndarray) else value

    # ------------------------------------------------------------------ edits
    def rename(self, old: str, new: str) -> None:
        """Rename one entry (partitioned slices follow).

        In a Keras 3 file (``.weights.h5``, ``.keras``, a sharded set) ``old`` may be a
        readable path: a layer (``rename('enc1', 'enc9')``) is renamed whole, by its name
        attribute, so the file still loads with ``model.load_weights`` and its paths read
        ``enc9/...``. Keras names variables by position, so renaming one variable of a
        layer (``'enc1/kernel' -> 'enc9/kernel'`` when the layer has a bias too) is refused.

        Raises:
            NoMatchError: ``old`` does not exist.
            NameCollisionError: ``new`` already exists.
            EditError: a Keras rename that does not move whole layers (nothing changes).
        """
        if self._by_layer(old):
            if not isinstance(new, str) or not new:
                raise InvalidArgumentError(f"a new name is a non-empty str, got {new!r}")
            self._layer_names, _ = keras_renames.layer_renames(
                self.checkpoint, self._plan, self._layer_names, keras_renames.prefix_rule(old, new),
                asked=f"rename({old!r}, {new!r})", name=old)
            return
        old = self._key(old)
        self._item(old)
        if new == old:
            return
        check_new_name(self._plan, new, self.prefix)
        self._items = renames.renamed(self._plan, old, new)
        slots = [n for n in self._plan if n.startswith(old + "/") and optimizer_slot_kind(n)]
        if slots:
            # A TF1 slot is found by its variable's name plus a suffix: left behind, it no
            # longer belongs to anything the renamed variable's optimizer will look for.
            warnings.warn(
                f"renamed {old!r} to {new!r}; its optimizer slots {format_names(slots, 4)} keep the old name. "
                f"rename_all([('^{re.escape(old)}(?=/|$)', {new!r})]) moves them too, or strip_optimizer_slots() "
                "drops them",
                RestoreKitWarning,
                stacklevel=2,
            )

    def rename_all(self, rule) -> dict[str, str]:
        """Rename every entry by ``rule``: a callable, a mapping, a list of ``(regex, replacement)``,
        or a rule set of ``restorekit.export._hf`` (by name: ``'bert-tf-to-hf'``, ...).

        A rule set also puts each tensor in the target's axes (a transposed kernel,
        GPT-2's squeezed Conv1D weights), drops what it names as having no place in the
        target (tied copies, buffers; a RestoreKitWarning lists them), and must cover
        every entry (delete or ``strip_optimizer_slots`` the rest first).

        Returns:
            {old: new} for the names that changed.

        Raises:
            NameCollisionError: two names land on one (checked before anything changes).
            NoMatchError: the rule changes nothing, a mapping key is not an entry, or a
                regex of the list matches no name.
            InvalidArgumentError: a rule set that does not cover every entry.
        """
        from restorekit.export._hf import RULE_SETS, RuleSet

        if isinstance(rule, RuleSet) or (isinstance(rule, str) and rule in RULE_SETS):
            self._items, changed = renames.apply_rule_set(self._plan, rule)
            return changed
        if self._keras and self._keras_file.is_weights_file and not keras_renames.changes_keys(self._plan, rule):
            # No key of the file is named: the rule is about readable paths, so it renames whole layers.
            self._layer_names, changed = keras_renames.rename_all(self.checkpoint, self._plan, self._layer_names, rule)
            return changed
        self._items, changed = renames.rename_all(self._plan, rule, self.prefix)
        return changed

    def set(self, name: str, value, *, index=None, allow_dtype_change: bool = False,
            allow_shape_change: bool = False) -> None:
        """Replace a tensor's value, whole or at ``index`` (``set(name, rows, index=[3, 7])``).

        Args:
            name: an existing entry.
            value: the new value (copied now). Whole: same shape and dtype as the entry.
                With ``index``: broadcastable to ``tensor[index]``. Python numbers and
                lists take the entry's dtype.
            index: anything numpy accepts as an index: an int, a list of rows, slices.
            allow_dtype_change: store a whole value in its own dtype.
            allow_shape_change: store a whole value in its own shape.

        Raises:
            NoMatchError: unknown name.
            EditError: wrong shape, dtype or index.
        """
        name = self._key(name)
        item = self._item(name)
        if index is None:
            self._plan[name] = values.set_whole(name, item, value, allow_dtype_change=allow_dtype_change,
                                                allow_shape_change=allow_shape_change)
            return
        if allow_dtype_change or allow_shape_change:
            raise EditError(f"{name!r}: a set with index= keeps the entry's shape and dtype")
        self._plan[name] = values.set_indexed(name, item, value, index)

    def copy_rows(self, name: str, src_rows, dst_rows) -> None:
        """Copy rows (first axis) of ``name`` onto other rows: ``t[dst_rows] = t[src_rows]``.

        Raises:
            EditError: lengths differ, a row is out of range, or the tensor is a scalar.
        """
        name = self._key(name)
        self._plan[name] = values.copy_rows(name, self._item(name), src_rows, dst_rows)

    def add(self, name: str, value) -> None:
        """Add a new tensor (numpy incl. bfloat16, bool, complex, or strings).

        Raises:
            NameCollisionError: ``name`` exists.
            EditError: a value with no checkpoint dtype.
        """
        check_new_name(self._plan, name, self.prefix)
        self._plan[name] = values.new_item(name, value)

    def delete(self, pattern) -> builtins.list[str]:
        """Delete an entry by exact name, or every entry a pattern (``names.matches`` rule) takes.

        An exact name deletes only itself (``'dense/kernel'`` keeps ``'dense/kernel/Momentum'``).

        Returns:
            The deleted names.

        Raises:
            NoMatchError: nothing matches.
        """
        names = self._select(pattern, what="delete pattern")
        self._items = renames.without(self._plan, names)
        return names

    def concat(self, names, axis: int, new_name: str) -> None:
        """Add ``new_name`` holding the given entries concatenated along ``axis`` (inputs are kept).

        Raises:
            NoMatchError: an unknown name.
            EditError: dtypes or shapes that do not concatenate.
            NameCollisionError: ``new_name`` exists.
        """
        if isinstance(names, str) or not names:
            raise EditError(f"concat takes a non-empty list of names, got {names!r}")
        names = [self._key(n) for n in names]
        items = [self._item(n) for n in names]
        check_new_name(self._plan, new_name, self.prefix)
        self._plan[new_name] = values.concat_item(names, items, axis)

    def cast(self, pattern, dtype) -> builtins.list[str]:
        """Cast entries to ``dtype`` (e.g. float32 to ``'bfloat16'`` or ``'float16'``).

        An exact name is cast whatever its numeric dtype; a pattern casts only the
        floating-point entries it matches (so ``'.*'`` leaves ``global_step`` alone).
        Pure casts are streamed on save, one chunk at a time. Rounding floats to a
        narrower float is allowed; a cast that changes a value (a finite float that
        overflows to inf, an integer that wraps or that the target cannot hold exactly)
        is refused when the value is seen (on save, for stored tensors), nothing written.

        Returns:
            The names cast.

        Raises:
            EditError: an unknown dtype, an exact name that is a string or bool, or
                (possibly on save) a value the cast would change.
            NoMatchError: nothing to cast.
        """
        code = values.cast_code(dtype)
        plan = self._plan
        exact = isinstance(pattern, str) and pattern in plan
        names = self._select(pattern, what="cast pattern")
        if exact:
            values.check_cast(pattern, plan[pattern].dtype, code, exact=True)
        else:
            names = [n for n in names if plan[n].dtype in FLOATS]
        names = [n for n in names if plan[n].dtype != code]
        if not names:
            raise NoMatchError(f"cast pattern {pattern!r} matches no entry that is not already {dtype_name(code)}")
        for n in names:
            values.check_cast(n, plan[n].dtype, code, exact=False)
        ckpt = self.checkpoint
        for n in names:
            item = plan[n]
            streamable = item.stored and not ckpt.is_partitioned(item.read_name)
            plan[n] = values.cast_item(n, item, code, streamable=streamable)
        return names

    def strip_optimizer_slots(self) -> builtins.list[str]:
        """Delete optimizer slots and state (Adam m/v, Momentum, beta powers, TF2 optimizer objects).

        Returns:
            The deleted names (empty when there were none).
        """
        names = renames.optimizer_state(self._plan, self.checkpoint)
        self._items = renames.without(self._plan, names)
        return names

    # ------------------------------------------------------------------ saving
    @renamed_keywords(format="to")
    def save(self, out, *, to: str | None = None, layout: str | None = None, weights_only: bool = False, ema=None,
             compact: bool = False, num_shards: int | None = None, overwrite: bool = False,
             update_state_file: bool = False, progress: bool = False, check_kept: bool = True,
             max_shard_size=None, distributed: bool = False) -> str:
        """Write the edited checkpoint to ``out`` (created if needed), atomically.

        Args:
            out: a checkpoint prefix (``'out/model.ckpt'``), an existing directory (the
                source's file name is used there), or a file for other formats. A
                ``gs://`` (any ``tf.io.gfile``) path is written locally under ``$TMPDIR``
                first, then uploaded file by file, the ``.index`` last; it must not exist.
            to: ``'tf'``, or a format of ``restorekit.formats._sinks`` (``'torch'``,
                ``'safetensors'``, ``'npz'``); by default the one ``out``'s extension names
                (``x.safetensors``, ``x.pt``, ``x.npz``), else a TF checkpoint. Those keep what ``convert`` keeps: string
                tensors and the TF2 object graph (rewritten to the edits) travel in the
                file, so importing it back restores with ``tf.train.Checkpoint.read``.
                An edited Keras file saves as ``*.weights.h5`` (from a Keras 3 file) or, from a
                legacy Keras 2 ``.h5`` (tf-keras ``model.save`` or ``save_weights``), as ``*.h5`` /
                ``*.hdf5`` in its source's structure, which tf-keras loads: ``layer_names``,
                ``weight_names``, ``backend``, ``keras_version`` and ``model_config`` kept; without
                its optimizer (``strip_optimizer_slots``, ``weights_only``) ``optimizer_weights`` and
                ``training_config`` go, as ``model.save(include_optimizer=False)`` writes it.
            layout: for ``'torch'`` and ``'safetensors'``: None, or ``'torch'`` (PyTorch
                names and axes, see ``restorekit.layouts``).
            weights_only: leave out optimizer state, ``global_step`` and ``save_counter``.
            ema: True, a shadow suffix or an ``ExponentialMovingAverage``: save each
                weight's moving average as the weight (its key stays), the shadows left
                out; weights without a shadow keep their raw values (a RestoreKitWarning names them).
            compact: write one new shard holding only the kept tensors (``'tf'``).
            num_shards: write the kept tensors into this many new shards (``'tf'``; implies
                ``compact``), balanced by bytes in entry order, several written at once.
                (``to``'s old name ``format=`` still works, with a DeprecationWarning.)
            overwrite: replace an existing output (never the source: use save_in_place).
                Exactly the old output's files are replaced: its ``.index`` and its
                ``.data-NNNNN-of-MMMMM`` shards, matched by name literally.
            update_state_file: point the directory's ``checkpoint`` file at ``out``.
            progress: show a byte counter on stderr while writing (when it is a terminal).
            check_kept: read every tensor the output keeps from the source's shards and
                check its crc32c before anything is written (the default). False keeps a
                rename or delete index-only (milliseconds instead of one read of the
                checkpoint); the kept bytes are then checked when they are read, by
                ``Checkpoint.read`` and by TensorFlow's restore, not at save time.
            max_shard_size: the largest shard of the output, in bytes (or ``'500MB'``,
                ``'2GiB'``): for ``'tf'``, new data shards of at most this size (as
                ``num_shards``, implies ``compact``; a larger tensor gets a shard alone); for
                a Keras 3 file saved as ``NAME.weights.json``, a sharded set as
                ``model.save_weights(..., max_shard_size=)`` writes it (Keras' GB float 2 is
                ``'2GiB'``; from a sharded set it defaults to the largest shard of the source); for
                ``'safetensors'``, a Hugging Face shard set (``out`` a directory) as ``convert`` writes it.
            distributed: write that shard set across the ranks of a torch.distributed process group,
                as ``convert(distributed=True)`` (docs/cluster.md); call it on every rank alike.

        Returns:
            The output prefix (or file).

        Raises:
            OutputExistsError: ``out`` is the source, or exists and ``overwrite`` is False.
            InsufficientSpaceError: the disk cannot hold the output; nothing is written.
            OutputNameError: ``to`` contradicts ``out``'s extension, ``out`` has an
                extension restorekit does not write (``.onnx``, ``.st``), or ``out`` is a legacy
                Keras ``.h5`` and the source is not one; nothing is written.
            OptionNotApplicableError: an option the output format does not take (a layout for
                ``'tf'``, ``num_shards`` for a file, ``max_shard_size`` for a file; see
                ``restorekit.export._request.OPTIONS``); nothing is written.
            InvalidArgumentError: ``ema`` without shadows, ``num_shards`` that is not a positive int.
            ChecksumMismatchError: a source tensor the output keeps fails its crc32c;
                nothing is written.
            CorruptCheckpointError: a source tensor fails its other checks; nothing is written.
            RankFailedError: with ``distributed``, a rank failed or was killed (it is named); nothing is published.
        """
        if self._keras:
            return self._save_keras(out, to=to, layout=layout, weights_only=weights_only, ema=ema, overwrite=overwrite,
                                    progress=progress, max_shard_size=max_shard_size, distributed=distributed)
        format = target_format(out, to)  # before anything is read or written
        _check_options(format, "tf", layout=layout, num_shards=num_shards, max_shard_size=max_shard_size,
                       distributed=distributed)
        plan = with_options(self._reader, self._plan, weights_only=weights_only, ema=ema)
        if splits(format, max_shard_size, distributed):
            return save_shards(self._reader, plan, out, format, layout=layout, max_shard_size=max_shard_size,
                               overwrite=overwrite, progress=progress, distributed=distributed)
        out = os.fspath(out)
        if files.is_remote(out):
            return save_remote(out, source_prefix=self.prefix, format=format, overwrite=overwrite,
                               update_state_file=update_state_file,
                               write_local=lambda path: self._save_local(plan, path, format, layout=layout,
                                                                         compact=compact, overwrite=False,
                                                                         progress=progress, num_shards=num_shards,
                                                                         max_shard_size=max_shard_size))
        if format != "tf":
            return self._save_local(plan, os.path.abspath(out), format, layout=layout, compact=compact,
                                    overwrite=overwrite, progress=progress)
        prefix = out[: -len(".index")] if out.endswith(".index") else out
        prefix = os.path.abspath(files.output_prefix(prefix, os.path.basename(self.prefix)))
        files.check_parent(prefix)
        if not files.is_remote(self.prefix) and os.path.realpath(prefix) == os.path.realpath(self.prefix):
            raise OutputExistsError(path=out, is_source=True)
        # One writer per output: the lock is taken before the exists-check and held to the final rename.
        directory = os.path.dirname(prefix)
        made = missing_directories(directory)
        try:
            with output_lock(prefix):
                existing = os.path.exists(prefix + ".index")
                if existing and not overwrite:
                    raise OutputExistsError(path=prefix)
                return save_tf(self._reader, plan, prefix, compact=compact, in_place=False,
                               replacing=existing, update_state_file=update_state_file, progress=progress,
                               num_shards=num_shards, check_kept=check_kept, max_shard_size=max_shard_size)
        except BaseException:
            remove_if_empty(made)  # a refused or failed save leaves no directory behind either
            raise

    def _save_local(self, plan, path: str, format: str, *, layout, compact: bool, overwrite: bool,
                    progress: bool, num_shards: int | None = None, max_shard_size=None) -> str:
        if format == "tf":
            return save_tf(self._reader, plan, path, compact=compact, in_place=False, replacing=False,
                           update_state_file=False, progress=progress, num_shards=num_shards,
                           max_shard_size=max_shard_size)
        return save_export(self._reader, plan, path, format, overwrite=overwrite, layout=layout, progress=progress)

    def _save_keras(self, out, *, to: str | None, layout, weights_only: bool, ema, overwrite: bool, progress: bool,
                    max_shard_size=None, distributed: bool = False) -> str:
        """``save`` for a Keras file: a ``.weights.h5`` (Keras' own keys, checked to load) or another format."""
        out = os.fspath(out)
        if files.is_remote(out):
            raise OutputError(f"{out!r}: an edited Keras file is saved locally; copy it to remote storage after")
        if ema is not None and ema is not False:
            raise InvalidArgumentError("ema= reads TF moving-average shadows; a Keras file holds none by name")
        format = to
        if format is not None and format not in (formats.TF, save_keras.KERAS):
            formats.module(format)
        plan = save_keras.without_optimizer(self._plan) if weights_only else self._plan
        if os.path.realpath(out) in {os.path.realpath(f) for f in self._keras_file.files}:
            raise OutputExistsError(path=out, is_source=True)
        if format is None and is_legacy_name(out):  # a legacy Keras '.h5': from a legacy Keras 2 file only
            _check_options(KERAS_LEGACY, "keras", layout=layout, max_shard_size=max_shard_size, distributed=distributed)
            return save_keras.save_legacy_h5(self._reader, plan, os.path.abspath(out), overwrite=overwrite)
        if format is None:  # by the name, as for a TF source: a '.safetensors' is one
            format = formats.TF if save_keras.is_keras_output(out, formats.TF) else target_format(out, None)
        sharded = out.lower().endswith(save_keras.SHARDED)
        keras_output = save_keras.is_keras_output(out, format)
        target = (KERAS_SHARDED if sharded else save_keras.KERAS) if keras_output else format
        _check_options(target, "keras", layout=layout, max_shard_size=max_shard_size, distributed=distributed)
        if keras_output:
            if sharded:
                return save_keras.save_sharded(self._reader, plan, os.path.abspath(out), overwrite=overwrite,
                                               max_shard_size=max_shard_size, layer_names=self._layer_names)
            return save_keras.save_weights_h5(self._reader, plan, os.path.abspath(out), overwrite=overwrite,
                                              layer_names=self._layer_names)
        return save_keras.save_other(self._reader, plan, os.path.abspath(out), format, layout=layout,
                                     overwrite=overwrite, progress=progress, layer_names=self._layer_names,
                                     max_shard_size=max_shard_size, distributed=distributed)

    def save_in_place(self, *, compact: bool = False, update_state_file: bool = False,
                      progress: bool = False, check_kept: bool = True, max_shard_size=None) -> str:
        """Replace the source checkpoint with the edited one; the old one stays until the new one is complete.

        A Keras 3 ``.weights.h5`` is rewritten whole (temp file beside it, then renamed
        over it), checked first to load with ``model.load_weights``; so is a ``.keras``
        archive, its ``config.json``, ``metadata.json`` and assets copied as they are, and a
        legacy Keras 2 ``.h5``, its structure kept (see ``save``). A
        sharded Keras set is replaced whole: new shards (cut at ``max_shard_size``, by default
        the old set's largest shard), the new index last, then the old shards it no longer
        names are removed; a failure before the new index is in place leaves the old set.
        """
        if self._keras:
            return self._save_keras_in_place(max_shard_size)
        if files.is_remote(self.prefix):
            raise OutputError(
                f"{self.prefix!r}: a remote checkpoint cannot be replaced atomically (its files are separate "
                "objects); save() it under a new name instead"
            )
        if self._through_outside_state is not None:
            raise OutputError(
                f"this editor was opened through a 'checkpoint' state file naming {self.prefix!r}, outside the "
                "directory given; an in-place edit would change that checkpoint. Open CheckpointEditor with the "
                "exact prefix to edit it in place, or save() the copy under a new name"
            )
        reader, plan = self._reader, self._plan
        with output_lock(self.prefix):
            if _fingerprint(self.prefix) != self._opened:
                # Another writer replaced the source since this editor read it: saving now
                # would silently drop that writer's edit.
                raise OutputError(
                    f"{self.prefix!r} changed since this editor read it (another save_in_place or save?); "
                    "open a new CheckpointEditor and apply the edits again"
                )
            prefix = save_tf(reader, plan, os.path.abspath(self.prefix), compact=compact, in_place=True,
                             replacing=True, update_state_file=update_state_file, progress=progress,
                             check_kept=check_kept)
        self._source = None
        self._items = None
        return prefix

    def _save_keras_in_place(self, max_shard_size) -> str:
        reader, plan = self._reader, self._plan
        sharded = self.prefix.lower().endswith(save_keras.SHARDED)
        if max_shard_size is not None and not sharded:
            raise InvalidArgumentError(f"{self.prefix!r} is one Keras file; max_shard_size= applies to a sharded set")
        with output_lock(self.prefix):
            if _fingerprint(self.prefix) != self._opened:
                raise OutputError(
                    f"{self.prefix!r} changed since this editor read it (another save_in_place or save?); "
                    "open a new CheckpointEditor and apply the edits again"
                )
            # The new file is complete beside the old one before it replaces it; tensors are read from the old one.
            if sharded:
                save_keras.save_sharded(reader, plan, os.path.abspath(self.prefix), overwrite=True, in_place=True,
                                        max_shard_size=max_shard_size, layer_names=self._layer_names)
            elif not reader.checkpoint.is_weights_file:  # a legacy Keras 2 .h5
                save_keras.save_legacy_h5(reader, plan, os.path.abspath(self.prefix), overwrite=True)
            elif reader.checkpoint.is_archive:
                save_keras.save_archive_in_place(reader, plan, self._layer_names)
            else:
                save_keras.save_weights_h5(reader, plan, os.path.abspath(self.prefix), overwrite=True,
                                           layer_names=self._layer_names)
        self._source = None
        self._items = None
        self._layer_names = {}
        return self.prefix


def _fingerprint(prefix: str) -> tuple | None:
    """Identity of the checkpoint's index file (a Keras file itself): replaced or rewritten, it changes
    (None for remote files)."""
    if files.is_remote(prefix):
        return None
    st = os.stat(prefix if detect(prefix) == "keras" else prefix + ".index")
    return st.st_ino, st.st_size, st.st_mtime_ns


def _check_options(target: str, source: str, *, distributed: bool = False, **options) -> None:
    """``restorekit.export._request.check`` of a save's options (``OptionNotApplicableError``), before anything is read."""
    check(options, target=target, source=source)
    if distributed:  # before any rank joins a group: only a safetensors shard set is split across ranks
        splittable(target, sharded=given(options.get("max_shard_size")))
    if target == "tf":  # the values too: a shard count or size that cannot work, or both at once
        request(num_shards=options.get("num_shards"), max_shard_size=options.get("max_shard_size"))
