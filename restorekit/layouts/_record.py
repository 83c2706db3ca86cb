"""LayoutRecord: what an export did to each tensor, stored in the file, so that an import undoes it exactly."""

from __future__ import annotations

import base64
import json
import warnings
from dataclasses import dataclass, field

import numpy as np

from restorekit._bundle.objectgraph import ObjectGraph
from restorekit.errors import CorruptCheckpointError, InvalidArgumentError, NameCollisionError, RestoreKitWarning
from restorekit.layouts import _ops as _ops
from restorekit.layouts._names import LAYOUTS, dotted, invert, restore_dtype, torch_name, torch_permutation

# Version 1 records know name, perm and dtype; version 2 adds ops, sum, drop and
# unmapped. A record that uses none of them is still written as version 1.
_VERSIONS = (1, 2)
_NEW_KEYS = ("ops", "sum", "drop")


@dataclass
class LayoutRecord:
    """What an export did to each tensor, so that an import can undo it exactly.

    ``tensors`` maps a stored name to a dict with any of ``name`` (the TF name, when
    it differs), ``dtype`` (the TF dtype, when the stored dtype does not say it, such
    as ``qint8`` stored as int8 or ``complex128`` stored as float64 pairs), ``perm``
    (the axes permutation applied) and the steps of ``restorekit.layouts._ops``
    (``ops``, ``sum``, ``drop``). ``strings`` holds string tensors, which neither
    safetensors nor torch can store, as base64. ``unmapped`` maps each TF name that
    layout 'torch' could not map to the reason; those tensors are stored with their TF
    names (dotted) and axes. ``graph``, the object graph of an object-based checkpoint
    (``Checkpoint.object_graph``), makes ``plan`` work from readable paths; it is not
    stored, since every stored name maps back to its key.
    """

    layout: str | None = None
    tensors: dict = field(default_factory=dict)
    strings: dict = field(default_factory=dict)
    graph: ObjectGraph | None = field(default=None, repr=False, compare=False)
    _owners: dict = field(default_factory=dict, repr=False)
    _kept: list = field(default_factory=list, repr=False)
    unmapped: dict = field(default_factory=dict)
    _planned: dict = field(default_factory=dict, repr=False)

    @classmethod
    def for_checkpoint(cls, checkpoint, layout: str | None, **hints) -> "LayoutRecord":
        """An empty record for exporting ``checkpoint``; with layout 'torch', planned layer by layer.

        A ``restorekit.layouts.TorchView`` brings its own record. For a plain
        ``Checkpoint`` the record maps what a renaming and an axes permutation can
        express; tensors whose mapping needs more (gate reordering, splits, reshapes,
        added tensors) are stored in TF layout and listed in ``unmapped``: export
        through ``torch_view(checkpoint)`` to map them too. ``hints``: as ``torch_view``.

        Raises:
            CorruptCheckpointError: layout 'torch' and an unreadable object graph.
        """
        record = getattr(checkpoint, "layout_record", None)
        if layout == "torch" and record is not None:
            return record
        if layout != "torch":
            return cls(layout)
        from restorekit.layouts._plan import plan_checkpoint

        plan = plan_checkpoint(checkpoint, **hints)
        record = cls(layout, graph=checkpoint.object_graph)
        record.unmapped.update(plan.unmapped)
        record._kept.extend(plan.kept)
        for key, parts in plan.by_key().items():
            if len(parts) == 1 and parts[0].key == key and set(parts[0].ops) <= {"perm"} and not parts[0].extra:
                record._planned[key] = (parts[0].stored, parts[0].ops.get("perm"))
            elif parts[0].key is not None and key not in record.unmapped:
                record.unmapped[key] = (
                    f"{parts[0].kind} needs {'more tensors' if len(parts) > 1 else 'a reshape'} than this writer makes; "
                    "export through restorekit.layouts.torch_view"
                )
        record.warn_unmapped()
        return record

    @property
    def kept(self) -> tuple:
        """TF names of the optimizer state that layout 'torch' left in TF axes (object-based checkpoints)."""
        return tuple(self._kept)

    # -- export side
    def plan(self, name: str, shape: tuple, layout: str | None = None) -> tuple[str, tuple | None]:
        """Decide the stored name and permutation of one tensor and record them.

        Raises:
            NameCollisionError: two TF names map to one stored name.
        """
        layout = self.layout if layout is None else layout
        if layout == "torch" and name in self._planned:
            out, perm = self._planned[name]
            if out in self._owners:
                raise self._collision(layout, name, out)
            self._owners[out] = name
            if perm is not None or name in self.unmapped:
                self.note_tensor(out, name, perm)
            elif out != name and out not in self.tensors:
                self.note_tensor(out, name, None)
            return out, perm
        if layout == "torch" and name in self.unmapped:
            out, perm = self._unmapped_name(name), None
        else:
            out, perm = self._plan_by_name(name, shape, layout)
        if out in self._owners:
            raise self._collision(layout, name, out)
        self._owners[out] = name
        self.note_tensor(out, name, perm)
        return out, perm

    def _plan_by_name(self, name: str, shape: tuple, layout: str | None) -> tuple[str, tuple | None]:
        """Without a plan of the whole checkpoint (a stream of tensors): by leaf name and rank,
        refusing what only the layer could tell (see ``plan.name_only_refusal``)."""
        from restorekit.layouts._plan import name_only_refusal, readable_path

        tracked = self.graph.by_key.get(name) if layout == "torch" and self.graph is not None else None
        if layout != "torch":
            return name, None
        if tracked is not None and tracked.kind != "variable":  # optimizer state and save_counter
            if tracked.kind == "optimizer":
                self._kept.append(name)
            return dotted(tracked.path), None
        path = readable_path(tracked) if tracked is not None else name
        why = name_only_refusal(path, shape)
        if why is not None:
            self.unmapped[name] = why
            warnings.warn(f"layout 'torch' stores {name!r} with its TF name and axes: {why}", RestoreKitWarning, stacklevel=4)
            return dotted(path), None
        return torch_name(path), torch_permutation(path, len(shape))

    def _unmapped_name(self, name: str) -> str:
        from restorekit.layouts._plan import readable_path

        tracked = self.graph.by_key.get(name) if self.graph is not None else None
        return dotted(readable_path(tracked) if tracked is not None else name.removesuffix("/.ATTRIBUTES/VARIABLE_VALUE"))

    def _collision(self, layout, name, out) -> NameCollisionError:
        return collision(layout, self._owners[out], name, out)

    def warn_unmapped(self, stacklevel: int = 3) -> None:
        """One RestoreKitWarning naming every tensor that layout 'torch' left in TF layout, and why."""
        if not self.unmapped:
            return
        lines = [f"  {name!r}: {why}" for name, why in list(self.unmapped.items())[:20]]
        more = f"\n  ... and {len(self.unmapped) - 20} more" if len(self.unmapped) > 20 else ""
        warnings.warn(
            f"layout 'torch' could not map {len(self.unmapped)} tensor(s); they are stored with their TF names "
            f"(dotted) and axes:\n" + "\n".join(lines) + more,
            RestoreKitWarning,
            stacklevel=stacklevel,
        )

    def note_tensor(self, stored: str, name: str, perm) -> None:
        """Record that ``stored`` holds TF tensor ``name``, permuted by ``perm`` (None: not)."""
        note: dict[str, object] = {}
        if stored != name:
            note["name"] = name
        if perm is not None:
            note["perm"] = list(perm)
        if note:
            self.tensors[stored] = note

    def note_dtype(self, stored_name: str, tf_dtype: str) -> None:
        self.tensors.setdefault(stored_name, {})["dtype"] = tf_dtype

    def add_string(self, name: str, array: np.ndarray) -> None:
        flat = [v.encode() if isinstance(v, str) else bytes(v) for v in np.asarray(array, dtype=object).ravel()]
        self.strings[name] = {
            "shape": list(np.shape(array)),
            "values": [base64.b64encode(v).decode("ascii") for v in flat],
        }

    def to_json(self) -> str:
        new = bool(self.unmapped) or any(k in note for note in self.tensors.values() for k in _NEW_KEYS)
        data = {"version": 2 if new else 1, "layout": self.layout, "tensors": self.tensors, "strings": self.strings}
        if self.unmapped:
            data["unmapped"] = self.unmapped
        return json.dumps(data, separators=(",", ":"), sort_keys=True)

    # -- import side
    @classmethod
    def from_json(cls, text: str, where: str = "file") -> "LayoutRecord":
        """Parse a record written by :meth:`to_json` (any version so far).

        Raises:
            CorruptCheckpointError: the text is not a restorekit layout record.
        """
        try:
            data = json.loads(text)
            record = cls(data.get("layout"), dict(data.get("tensors", {})), dict(data.get("strings", {})))
            record.unmapped = dict(data.get("unmapped", {}))
            if data.get("version") not in _VERSIONS or record.layout not in LAYOUTS:
                raise ValueError(f"version {data.get('version')!r}, layout {record.layout!r}")
            if not all(isinstance(note, dict) for note in record.tensors.values()):
                raise ValueError("a tensor note is not an object")
        except (ValueError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{where}: unreadable restorekit layout record ({e})") from None
        return record

    def tf_name(self, stored: str) -> str:
        return self.tensors.get(stored, {}).get("name", stored)

    def permuted(self) -> tuple:
        """The TF names of the tensors whose axes this record permutes (what an export's result lists)."""
        return tuple(self.tf_name(n) for n, note in self.tensors.items() if "perm" in note)

    def restore(self, stored: str, array: np.ndarray) -> tuple[str, np.ndarray, str | None]:
        """Undo the export of one tensor: (TF name, array in TF layout, TF dtype or None).

        Raises:
            InvalidArgumentError: the tensor is one part of several (an LSTM bias split in
                two, an added ``num_batches_tracked``): use :meth:`restore_all`.
        """
        note = self.tensors.get(stored, {})
        if "drop" in note or "sum" in note or "take" in note.get("ops", {}):
            raise InvalidArgumentError(f"{stored!r} is one part of a TF tensor; read the file with LayoutRecord.restore_all")
        return note.get("name", stored), self._backward(stored, note, array), note.get("dtype")

    def _backward(self, stored: str, note: dict, array: np.ndarray) -> np.ndarray:
        if "ops" in note:
            return _ops.backward(note["ops"], array, stored)
        perm = note.get("perm")
        if perm is not None:
            array = np.ascontiguousarray(np.transpose(array, invert(perm)))
        return array

    def restore_all(self, arrays):
        """Undo the export of a whole file: yield (TF name, array in TF layout, TF dtype or None).

        ``arrays`` are the file's ``(stored name, array)`` pairs in any order. Tensors
        stored whole come out at once; the parts of one TF tensor (``ops.take``, ``sum``)
        are held until the last one arrives; added tensors (``drop``) are left out.

        Raises:
            CorruptCheckpointError: a part is missing or does not fit its siblings.
        """
        expected: dict[str, int] = {}
        for stored, note in self.tensors.items():
            if "drop" not in note and ("sum" in note or "take" in note.get("ops", {})):
                expected[note.get("name", stored)] = 0
        for stored, note in self.tensors.items():
            if note.get("name", stored) in expected and "drop" not in note:
                expected[note.get("name", stored)] += 1
        held: dict[str, list] = {}
        for stored, array in arrays:
            note = self.tensors.get(stored, {})
            if "drop" in note:
                continue
            name = note.get("name", stored)
            if name not in expected:
                yield name, self._backward(stored, note, array), note.get("dtype")
                continue
            held.setdefault(name, []).append((stored, note, array))
            if len(held[name]) == expected[name]:
                yield name, self._join(name, held.pop(name)), self._dtype_of(name)
        if held:
            missing = ", ".join(repr(n) for n in held)
            raise CorruptCheckpointError(f"the file holds only some of the parts of {missing}")

    def _dtype_of(self, name: str) -> str | None:
        return next((n.get("dtype") for s, n in self.tensors.items() if n.get("name", s) == name and "dtype" in n), None)

    def _join(self, name: str, parts: list) -> np.ndarray:
        pieces = {}
        sums = []
        for stored, note, array in parts:
            take = note.get("ops", {}).get("take")
            key = tuple(take) if take is not None else None
            if "sum" in note:
                residual = array - _ops.constants(note["sum"], array)
                sums.append((key, self._backward(stored, note, residual)))
            else:
                pieces[key] = self._backward(stored, note, array)
        for key, residual in sums:
            if key not in pieces:
                raise CorruptCheckpointError(f"{name!r}: an added part has no main part")
            pieces[key] = _ops.add_residual(pieces[key], residual)
        return _ops.assemble([(list(k) if k is not None else None, a) for k, a in pieces.items()], name)

    def object_graph(self):
        """The object graph among the string tensors carried along, or None.

        Raises:
            CorruptCheckpointError: it is there but does not decode.
        """
        from restorekit._checkpoint import OBJECT_GRAPH_KEY
        from restorekit._bundle.objectgraph import decode_object_graph

        for name, array in self.string_tensors():
            if name == OBJECT_GRAPH_KEY and array.shape == ():
                return decode_object_graph(array.item())
        return None

    def string_tensors(self):
        """Yield (TF name, object array of bytes) for the string tensors carried along."""
        for name, item in self.strings.items():
            values = [base64.b64decode(v) for v in item["values"]]
            out = np.empty(len(values), dtype=object)
            out[:] = values
            yield name, out.reshape(item["shape"])


def collision(layout, first: str | None, second: str | None, out: str) -> NameCollisionError:
    """Two TF keys (None: a tensor the layout adds for PyTorch) would be stored under one name."""
    def shown(key: str | None) -> str:
        return "a tensor added for PyTorch" if key is None else repr(key)

    return NameCollisionError(
        f"layout {layout!r} maps both {shown(first)} and {shown(second)} to {out!r}; "
        f"rename one first (CheckpointEditor.rename) or export without layout"
    )


def tf_tensors(arrays, record: LayoutRecord):
    """(TF name, array, TF dtype name or None) for every tensor of a file read with ``record``, strings last.

    What ``restorekit.export._conversions`` feeds the TF writer on import: the parts of
    a split tensor are joined and added tensors left out (``LayoutRecord.restore_all``).
    """
    for name, array, dtype in record.restore_all(arrays):
        yield name, restore_dtype(array, dtype), dtype
    for name, array in record.string_tensors():
        yield name, array, "string"
