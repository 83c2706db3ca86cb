"""The few group and dataset verbs the Keras 3 walk asks of an HDF5 file, over h5py's low-level API.

h5py's high-level ``Group`` and ``Dataset`` cost ~25 us an object (a ``File`` back-reference,
property lists, a Python-level mapping per lookup); a BERT-sized ``.weights.h5`` has ~300
objects, so opening it spent more in building them than in HDF5. These nodes answer what
``layouts.Keras3Walk`` asks (children by name, ``get``, ``items``, ``attrs.get``, ``shape``,
``dtype``) with the same answers: the same name order, encodings, link resolution (soft
links followed, a dangling one is missing) and the same exceptions.

Below them, the checks that keep every read inside the file: no external link
(``check_links``, once per file), no dataset whose data lie in another file
(``check_storage``, on each dataset as the walk opens it, before its shape is asked),
and no dataset type that is not a tensor (``check_dataset``, before a read).
"""

from __future__ import annotations

from types import SimpleNamespace

from restorekit.errors import CorruptCheckpointError, ExternalDataError

__all__ = ["NODES", "check_contained", "check_dataset", "check_links", "check_storage", "root"]


def _encode(name):
    """As h5py encodes a name: bytes as given, str as ASCII when it can be, else UTF-8."""
    if isinstance(name, bytes):
        return name
    if isinstance(name, str):
        try:
            return name.encode("ascii")
        except UnicodeEncodeError:
            return name.encode("utf8")
    raise TypeError(f"A name should be string or bytes, not {type(name)}")


def _decode(name: bytes):
    """As h5py decodes a member name: UTF-8 when it is, else the bytes."""
    if isinstance(name, str):
        return name
    try:
        return name.decode("utf8")
    except UnicodeDecodeError:
        return name


def _exists(exists, *args) -> bool:
    """``exists(*args)``, or True when HDF5 cannot say (damage): the open that follows reports it as h5py would."""
    try:
        return exists(*args)
    except (RuntimeError, OSError, KeyError, ValueError):
        return True


class _Attrs:
    """``attrs.get(name)`` of one object: None when absent, else the value h5py's ``attrs[name]`` reads."""

    __slots__ = ("id", "_h5py")

    def __init__(self, oid, h5py):
        self.id, self._h5py = oid, h5py

    def get(self, name, default=None):
        # exists() first: a missing attribute read through h5a.open costs an HDF5 error stack.
        if not _exists(self._h5py.h5a.exists, self.id, _encode(name)):
            return default
        try:
            return self._h5py.AttributeManager(self)[name]
        except KeyError:  # what h5py's attrs.get answers when HDF5 cannot open it
            return default


class Group:
    """An HDF5 group: member names in h5py's order, each member opened once, on demand."""

    __slots__ = ("id", "_h5py", "_names", "_members", "_path")

    def __init__(self, gid, h5py, path: str = ""):
        self.id, self._h5py, self._path = gid, h5py, path
        self._names: tuple[list[str], int] | None = None
        self._members: dict = {}  # the walk asks for some members twice (``vars``, the containers)

    @property
    def attrs(self) -> _Attrs:
        return _Attrs(self.id, self._h5py)

    def __iter__(self):
        if self._names is None:
            self._names = self._list()
        names, count = self._names
        yield from names[:count]
        if count > len(names):  # a damaged member count: h5py's iterator runs off its list
            raise IndexError("list index out of range")

    def _list(self) -> tuple[list, int]:
        """Member names in h5py's order (by creation where the group tracks it, else by name), and the count
        HDF5 gives; listed in one H5Literate call, as h5py does, and not at all when the count is 0."""
        h5py = self._h5py
        names: list[bytes] = []
        count = self.id.get_num_objs()
        if count:
            tracked = self.id.get_create_plist().get_link_creation_order() & h5py.h5p.CRT_ORDER_TRACKED
            self.id.links.iterate(names.append, idx_type=h5py.h5.INDEX_CRT_ORDER if tracked else h5py.h5.INDEX_NAME)
        return [_decode(name) for name in names], count

    def __getitem__(self, name):
        found = self._members.get(name)
        if found is None:
            found = self._members[name] = self._open(name)
        return found

    def _open(self, name):
        h5py = self._h5py
        encoded = _encode(name)
        # A member with no link by that name is missing: said without an HDF5 error stack (~10x cheaper).
        if b"/" not in encoded and encoded not in (b"", b".") and not _exists(self.id.links.exists, encoded):
            # HDF5's own words for it, as h5py would raise them
            raise KeyError(f"Unable to synchronously open object (object '{encoded.decode('utf-8', 'replace')}' "
                           f"doesn't exist)")
        oid = h5py.h5o.open(self.id, encoded)  # follows soft and external links; KeyError when they lead nowhere
        kind = h5py.h5i.get_type(oid)
        if kind == h5py.h5i.GROUP:
            return Group(oid, h5py, self._path)
        if kind == h5py.h5i.DATASET:
            plist = oid.get_create_plist()
            check_storage(plist, h5py, lambda: h5py.h5i.get_name(oid), self._path)  # before its shape is asked
            return Dataset(oid, h5py, plist)
        if kind == h5py.h5i.DATATYPE:
            return oid  # a named datatype: neither a group nor a dataset to the walk
        raise TypeError("Unknown object type")

    def get(self, name, default=None):
        try:
            return self[name]
        except KeyError:
            return default

    def items(self):
        for name in self:
            yield name, self.get(name)


class Dataset:
    """An HDF5 dataset: its shape, numpy dtype and attributes (no data read), and its creation properties
    (``plist``, read once: the storage check and ``stored_range`` both need them)."""

    __slots__ = ("id", "_h5py", "plist")

    def __init__(self, did, h5py, plist=None):
        self.id, self._h5py, self.plist = did, h5py, plist

    @property
    def shape(self):
        return self.id.shape

    @property
    def dtype(self):
        return self.id.dtype

    @property
    def attrs(self) -> _Attrs:
        return _Attrs(self.id, self._h5py)


# What Keras3Walk tells groups from datasets by (it is given h5py's classes, or these).
NODES = SimpleNamespace(Group=Group, Dataset=Dataset)


def root(f, h5py, path: str = "") -> Group:
    """The root group of the open h5py file ``f`` (the file ``path``, for messages) as a node.

    Every dataset the walk opens is checked with ``check_storage``; ``check_links`` must have
    checked the file first (an external link is followed when a member is opened)."""
    return Group(f.id, h5py, path)


# ---------------------------------------------------------------- what a file may hold before anything is read

_REFUSE = "restorekit reads only what is inside the file it is given; refused before anything was read"


def check_links(f, h5py, path: str) -> None:
    """Refuse an HDF5 file holding an external link (or a link of a user-defined type) anywhere.

    Keras never writes one. Listed with H5Lvisit, which follows no link: run before anything
    opens a member, since opening a path through an external link opens the other file (a
    FIFO there would block). Soft links stay inside the file and are allowed.

    Raises:
        ExternalDataError: names the link and the file it points at.
    """
    found: list = []

    def link(name, info):
        if info.type not in (h5py.h5l.TYPE_HARD, h5py.h5l.TYPE_SOFT):
            found.append((name, info.type))
            return True  # stops the visit
        return None

    f.id.links.visit(link, info=True)
    if found:
        name, kind = found[0]
        target = "a link of a user-defined type"
        if kind == h5py.h5l.TYPE_EXTERNAL:
            other, inside = f.id.links.get_val(name)
            target = f"an external link to {_decode(inside)!r} in {_decode(other)!r}"
        raise ExternalDataError(f"{path!r}: {_decode(name)!r} is {target}; {_REFUSE}")


def check_storage(plist, h5py, name, path: str) -> None:
    """Refuse a dataset (given by its creation property list) whose data lie in another file: external
    storage or a virtual dataset. Checked before the dataset's shape is asked for (a virtual dataset's
    shape can open its source files). ``name`` is the dataset's name, or a function giving it.

    Raises:
        ExternalDataError: names the dataset and the other file.
    """
    if plist.get_layout() == h5py.h5d.VIRTUAL:
        sources = plist.get_virtual_count()
        other = _decode(plist.get_virtual_filename(0)) if sources else "no file"
        more = f" and {sources - 1} more" if sources > 1 else ""
        raise ExternalDataError(f"{path!r}: {_name(name)!r} is a virtual dataset whose data lie in {other!r}{more}; "
                                f"{_REFUSE}")
    if plist.get_external_count():
        other = _decode(plist.get_external(0)[0])
        raise ExternalDataError(f"{path!r}: {_name(name)!r} keeps its data in the external file {other!r}; {_REFUSE}")


def check_contained(f, h5py, path: str) -> None:
    """``check_links``, then ``check_storage`` of every dataset in the file (for readers that do not walk
    through these nodes; ~40 us a dataset, which the node walk saves by checking what it opens)."""
    check_links(f, h5py, path)
    datasets: list = []
    h5py.h5o.visit(f.id, lambda name, info: datasets.append(name) if info.type == h5py.h5o.TYPE_DATASET else None,
                   info=True)
    for name in datasets:
        check_storage(h5py.h5d.open(f.id, name).get_create_plist(), h5py, name, path)


def _name(name) -> str:
    return _decode(name() if callable(name) else name).lstrip("/")


def check_dataset(ds, h5py, key: str, path: str, *, bfloat16: bool = False) -> None:
    """Refuse a dataset whose value is not a tensor restorekit can hold: a null dataspace (no value), a
    compound, array or non-string variable-length type, object or region references, or opaque bytes
    other than Keras' bfloat16. ``ds`` is an h5py Dataset; nothing is read.

    Raises:
        CorruptCheckpointError: names the dataset and its type.
    """
    why = None
    dt = ds.dtype
    if ds.shape is None:
        why = "has a null dataspace (no value at all)"
    elif h5py.check_ref_dtype(dt) is not None:
        why = f"holds {'region' if h5py.check_ref_dtype(dt) is h5py.RegionReference else 'object'} references"
    elif dt.names is not None and dt.kind != "c":
        why = f"has a compound type ({dt})"
    elif dt.subdtype is not None:
        why = f"has an array type ({dt})"
    elif dt.kind == "O" and h5py.check_string_dtype(dt) is None:
        why = f"has a variable-length type that is not a string ({h5py.check_vlen_dtype(dt) or dt})"
    elif dt.kind == "V" and not (bfloat16 and dt.itemsize == 2):
        why = f"holds opaque {dt.itemsize}-byte values"
    if why is not None:
        raise CorruptCheckpointError(f"{path!r}: dataset {key!r} {why}, which no Keras weight has; "
                                     f"restorekit cannot read it as a tensor")
