"""torch.nn.Module targets: a module's ``state_dict`` (parameters and buffers) as scan Targets, and TF checkpoints seen with torch names.

``scan(checkpoint, module, layout='torch')`` reads the checkpoint through the same
per-layer layouts the torch export uses (``restorekit.layouts``): TF names and
axes become the ``state_dict`` keys and axes of the module's ``torch.nn`` twin, so a
restore copies what ``export_checkpoint(..., layout='torch')`` would have written.
torch itself is never imported here: the module and its tensors are only read.
"""

from __future__ import annotations

from typing import Mapping

from restorekit.errors import InvalidArgumentError
from restorekit._names import optimizer_slot_kind

__all__ = ["LayoutSource", "RuleSetSource", "is_torch_module", "is_torch_tensor", "layout_source", "module_items", "stored_tensor"]


def _from_torch(obj) -> bool:
    return any(c.__module__ == "torch" or c.__module__.startswith("torch.") for c in type(obj).__mro__)


def is_torch_module(obj) -> bool:
    """True for a ``torch.nn.Module`` (a Hugging Face model too), but not a Keras model on the torch backend."""
    # Keras layers on the torch backend are nn.Modules too; they restore as Keras models, by path.
    if any(c.__module__.startswith("keras") for c in type(obj).__mro__):
        return False
    return _from_torch(obj) and callable(getattr(obj, "state_dict", None)) and hasattr(obj, "named_parameters")


def is_torch_tensor(obj) -> bool:
    """True for a torch tensor or Parameter."""
    return _from_torch(obj) and hasattr(obj, "copy_") and hasattr(obj, "detach")


def module_items(module) -> list:
    """(state_dict key, shape, dtype name, live tensor) for every parameter and buffer of ``module``.

    ``state_dict(keep_vars=True)`` names each tensor as ``load_state_dict`` does and hands
    out the live Parameters and buffers (not detached copies), so a copy into them is a
    copy into the module; tied weights appear once, under their first name.
    """
    items, seen = [], set()
    for key, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        items.append((key, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), tensor))
    return items


class LayoutSource:
    """A checkpoint seen through ``layout='torch'``: the verbs scan and restore read of a source, with torch names."""

    is_object_based = False
    object_graph = None
    object_paths: dict = {}
    entries: Mapping  # name -> Entry, under the layout's (or rule set's) names

    def __init__(self, checkpoint, layout: str):
        # Imported here: restorekit.export's package imports scan, which imports this module.
        from restorekit.layouts._view import TorchView

        # A torch_view brings its hints (model=, flatten_channels=, layer_kinds=); a checkpoint gets a plain one.
        self.view = checkpoint if isinstance(checkpoint, TorchView) else TorchView(checkpoint)
        self.checkpoint = self.view.checkpoint
        self.layout = layout
        self.prefix = checkpoint.prefix
        self.entries = self.view.entries

    def check_shards(self) -> None:
        self.checkpoint.check_shards()

    def readable_name(self, name: str) -> str:
        return name

    def stored_name(self, name: str) -> str:
        """The checkpoint's own key that view name ``name`` is read from (``conv1/weights`` of ``conv1.weight``)."""
        return self.view.readable_name(name)

    def stored_entry(self, name: str) -> tuple | None:
        """(the checkpoint's key, its stored shape) that view name ``name`` is read from; None for an added tensor."""
        return self.view.stored_entry(name)

    def read(self, name: str):
        return self.view.read(name)

    def like(self, name: str, array):
        """``array`` (a tensor shaped as the checkpoint's tensor behind ``name``: an optimizer slot of that weight)
        through the same names-and-axes steps as ``name``; None where the view adds or sums instead."""
        return self.view.like(name, array)

    def __repr__(self) -> str:
        return f"LayoutSource({self.prefix!r}, layout={self.layout!r})"


class RuleSetSource(LayoutSource):
    """A checkpoint seen through a ready rule set (``'bert-tf-to-hf'``): its weights under the target's names and axes.

    Entries no rule covers (optimizer slots, global_step, anything else) keep their own
    names, so scan reports them skipped or unused instead of the rule set refusing them.
    """

    def __init__(self, checkpoint, ruleset):
        from restorekit._checkpoint import Entry

        self.checkpoint = checkpoint
        self.layout = ruleset.name
        self.prefix = checkpoint.prefix
        covered = {}
        for name, entry in checkpoint.entries.items():
            target, _, why = ruleset.target_of(name)
            if target is not None and why is None:
                covered[name] = entry.shape
        self.plan = ruleset.plan(covered)
        self._source_of = {new: old for old, new in self.plan.names.items()}
        # A covered weight's own moving average ('.../kernel/ExponentialMovingAverage', any suffix: ema= picks it)
        # goes with it, under its new name and through its transform, so scan(..., ema=...) finds it there.
        self._base_of = {}
        for name, entry in checkpoint.entries.items():
            base, _, tail = name.rpartition("/")
            if (name not in self.plan.names and base in self.plan.names and optimizer_slot_kind(name) is None
                    and entry.shape == checkpoint.entries[base].shape):
                self._base_of[name] = base
                self._source_of[f"{self.plan.names[base]}/{tail}"] = name
        entries = {}
        for name, entry in checkpoint.entries.items():
            base = self._base_of.get(name, name)
            new = self.plan.names.get(base)
            if new is not None and base != name:
                new = f"{new}/{name.rpartition('/')[2]}"
            entries[new or name] = entry if new is None else Entry(new, self.plan.shapes[self.plan.names[base]],
                                                                    entry.dtype, entry.nbytes)
        self.entries = entries

    def _transform(self, source: str):
        return self.plan.transforms.get(self._base_of.get(source, source))

    def readable_name(self, name: str) -> str:
        return self._source_of.get(name, name)

    def stored_name(self, name: str) -> str:
        return self._source_of.get(name, name)

    def stored_entry(self, name: str) -> tuple | None:
        source = self._source_of.get(name, name)
        entry = self.checkpoint.entries.get(source)
        return None if entry is None else (source, tuple(entry.shape))

    def stored(self, name: str):
        """``(checkpoint, key, transposed)`` when the value of ``name`` is the checkpoint's tensor ``key`` as stored
        (``squeeze0`` and ``unsqueeze0`` only reshape it) or, ``transposed``, its 2-D transpose; None otherwise."""
        source = self._source_of.get(name, name)
        transform = self._transform(source)
        if transform not in (None, "transpose", "squeeze0", "unsqueeze0"):
            return None
        return self.checkpoint, source, transform == "transpose"

    def like(self, name: str, array):
        """``array`` (an optimizer slot of the weight behind ``name``) through the rule set's transform of ``name``."""
        source = self._source_of.get(name)
        return array if source is None else self.plan.apply(self._base_of.get(source, source), array)

    def read(self, name: str):
        source = self._source_of.get(name)
        if source is None:
            return self.checkpoint.read(name)
        array = self.checkpoint.read(source)
        if self._transform(source) == "transpose" and array.ndim == 2:
            # The rule set's own transpose makes the array contiguous (its writers need the bytes);
            # a restore copies into a tensor anyway, and torch's strided copy is ~3x faster than numpy's.
            return array.T
        return self.plan.apply(self._base_of.get(source, source), array)


def stored_tensor(source, name: str):
    """``(checkpoint, key, transposed)`` when a restore may read the value of ``name`` straight from a TF checkpoint's
    bytes (as stored, or transposed for 2-D); None when it must be computed (a layout's axes, a Keras file, ...)."""
    if isinstance(source, RuleSetSource):
        found = source.stored(name)
    elif isinstance(source, LayoutSource):
        return None
    else:
        found = source, name, False
    checkpoint = found[0] if found else None
    # read_into and check: a TF checkpoint's reader (not a Keras file's or another format's).
    if checkpoint is None or not (hasattr(checkpoint, "read_into") and hasattr(checkpoint, "check")):
        return None
    key = checkpoint.key(found[1])  # a TF2 readable path -> its key
    if checkpoint.stored_range(key) is None:  # partitioned: its slices are assembled by read
        return None
    return checkpoint, key, found[2]


def is_foreign_torch_file(source) -> bool:
    """True for a torch or safetensors file with PyTorch names that no restorekit export wrote (no layout record)."""
    from restorekit.formats.files import FileView

    return (isinstance(source, FileView) and source.format in ("torch", "safetensors")
            and source.record_layout is None)


def foreign_file_hint(source, unused) -> tuple:
    """The hint for a foreign PyTorch file whose entries nothing took by name: read it with ``layout='torch'``."""
    if not unused or not is_foreign_torch_file(source):
        return ()
    import os

    example = next((r for r in unused if len(r.checkpoint_shape or ()) > 1), unused[0])
    return (f"{source.prefix!r} holds PyTorch names and axes ({example.checkpoint_name!r} "
            f"{list(example.checkpoint_shape or ())}); pass layout='torch' to read it as the TF checkpoint it holds "
            f"(names, kernel axes, and Dense inputs behind a Flatten as the model's config shows them), as "
            f"'restorekit convert {os.path.basename(source.prefix)} OUT --layout torch' does.",)


def _as_tf(view, variables):
    """A foreign PyTorch-named file as the TF checkpoint it holds, for TF or Keras ``variables``."""
    from restorekit.layouts._flatten import flatten_inputs, model_config
    from restorekit.layouts._foreign import guess_tf_names
    from restorekit.formats.files import FileView

    config = model_config(variables) if variables is not None else None
    record = guess_tf_names(view.reader.read_shapes(), flatten=flatten_inputs(config) if config else None)
    return FileView(view.prefix, view.reader, record=record)


def _is_torch_view(checkpoint) -> bool:
    from restorekit.layouts._view import TorchView

    return isinstance(checkpoint, TorchView)


def _is_rule_set_name(rules) -> bool:
    return isinstance(rules, str) or (hasattr(rules, "target_of") and hasattr(rules, "plan"))


def layout_source(checkpoint, layout, rules=None, variables=None) -> tuple:
    """``checkpoint`` as scan sees it under ``layout`` or a ready rule set, and the ``rules`` left for naming.

    ``layout='torch'`` reads it through the export's per-layer layouts, for ``variables``
    of a torch module; a file in PyTorch names and axes that no restorekit export wrote
    (a ``.pth`` state dict) goes the other way for TF and Keras variables: read as the TF
    checkpoint it holds (``layouts.guess_tf_names``, as ``convert --layout torch`` reads
    it), Dense layers behind a Flatten reordered from the Keras model's config; into a
    torch module it is read as it is. A rule set name
    (``'bert-tf-to-hf'``) or ``RuleSet`` through that rule set. Anything else in ``rules``
    (``KERAS_FROM_TF1``, regex pairs) is returned for scan's naming step.

    Raises:
        InvalidArgumentError: a layout other than None or 'torch', both a layout and a
            rule set, or an unknown rule set name.
    """
    if layout is not None and layout != "torch":
        raise InvalidArgumentError(f"layout is None or 'torch', got {layout!r}")
    if layout == "torch" and rules is None and is_foreign_torch_file(checkpoint):
        return (checkpoint if is_torch_module(variables) else _as_tf(checkpoint, variables)), None
    if _is_torch_view(checkpoint):
        if layout not in (None, "torch") or rules is not None:
            raise InvalidArgumentError("a torch_view is read with layout 'torch' and no rules")
        return LayoutSource(checkpoint, "torch"), None
    if _is_rule_set_name(rules):
        if layout is not None:
            raise InvalidArgumentError(f"rule set {rules!r} sets names and axes itself; leave layout=None")
        from restorekit.export._hf import rule_set

        return RuleSetSource(checkpoint, rule_set(rules)), None
    return (checkpoint if layout is None else LayoutSource(checkpoint, layout)), rules
