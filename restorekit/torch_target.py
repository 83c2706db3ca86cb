"""torch.nn.Module targets: a module's ``state_dict`` (parameters and buffers) as scan Targets, and TF checkpoints seen with torch names.

``scan(checkpoint, module, layout='torch')`` reads the checkpoint through the same
per-layer layouts the torch export uses (``restorekit.export.layouts``): TF names and
axes become the ``state_dict`` keys and axes of the module's ``torch.nn`` twin, so a
restore copies what ``export_checkpoint(..., layout='torch')`` would have written.
torch itself is never imported here: the module and its tensors are only read.
"""

from __future__ import annotations

from restorekit.errors import InvalidArgumentError

__all__ = ["LayoutSource", "is_torch_module", "is_torch_tensor", "layout_source", "module_items"]


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

    def __init__(self, checkpoint, layout: str):
        # Imported here: restorekit.export's package imports scan, which imports this module.
        from restorekit.export.layouts.view import TorchView

        self.checkpoint = checkpoint
        self.layout = layout
        self.view = TorchView(checkpoint)
        self.prefix = checkpoint.prefix
        self.entries = self.view.entries

    def check_shards(self) -> None:
        self.checkpoint.check_shards()

    def readable_name(self, name: str) -> str:
        return name

    def read(self, name: str):
        return self.view.read(name)

    def __repr__(self) -> str:
        return f"LayoutSource({self.prefix!r}, layout={self.layout!r})"


def layout_source(checkpoint, layout):
    """``checkpoint`` as scan sees it under ``layout`` (None: itself).

    Raises:
        InvalidArgumentError: a layout other than None or 'torch'.
    """
    if layout is None:
        return checkpoint
    if layout != "torch":
        raise InvalidArgumentError(f"layout is None or 'torch', got {layout!r}")
    return LayoutSource(checkpoint, layout)
