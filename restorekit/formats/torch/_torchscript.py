"""A TorchScript archive (``torch.jit.save``) read as the state_dict it holds, without running any of it.

``torch.jit.load`` compiles and runs the archive's code, and ``torch.load`` refuses the
archive, so neither is used. The archive's ``data.pkl`` is the module tree: each module a
``__torch__.*`` class (built here as an empty placeholder, never imported) whose state is
its attributes, the tensors among them persistent-id storages as in ``torch.save``'s zip
format. Which attributes are parameters and buffers (what ``module.state_dict()`` holds)
is declared in each class's source in ``code/`` (``__parameters__ = [...]``,
``__buffers__ = [...]``), which is read as text, never executed. The tensors are then
checked against their storage records like any ``.pt`` file (``_torchfile.check_views``).
"""

from __future__ import annotations

import ast
import collections
import io
import re

from restorekit.errors import CorruptCheckpointError, InvalidArgumentError
from restorekit.formats.torch import _torchfile as torchfile

__all__ = ["is_script", "scan_script"]

_DECLARED = re.compile(r"^  (__parameters__|__buffers__) = (\[.*?\])\s*$", re.M)


def is_script(prefix: str, names) -> bool:
    """True for a TorchScript archive: a ``torch.save`` zip layout plus its ``code/`` and ``constants.pkl``."""
    return prefix + "constants.pkl" in names and any(n.startswith(prefix + "code/") for n in names)


class ScriptModule:
    """A ``__torch__.*`` object of ``data.pkl``: its class name and the attributes its state sets."""

    qualname = ""

    def __init__(self, *args, **kwargs):
        self.state: dict = {}

    def __setstate__(self, state):
        self.state = state if isinstance(state, dict) else {}


class _Unpickler(torchfile._Unpickler):
    """The restricted reader of ``_torchfile``, also building ``__torch__`` classes as ScriptModules."""

    def __init__(self, file, itemsizes):
        super().__init__(file, itemsizes)
        self._classes: dict[str, type] = {}

    def find_class(self, module, name):
        if module == "__torch__" or module.startswith("__torch__."):
            qualname = f"{module}.{name}"
            if qualname not in self._classes:
                self._classes[qualname] = type(name, (ScriptModule,), {"qualname": qualname})
            return self._classes[qualname]
        if module == "torch.jit._pickle":
            if name.startswith("build_") and name.endswith("list"):
                return list
            if name == "restore_type_tag":
                return lambda value, tag=None: value
        return super().find_class(module, name)


def _declared(path: str, archive, prefix: str, qualname: str) -> tuple[list, list]:
    """The ``__parameters__`` and ``__buffers__`` a class's source in ``code/`` declares."""
    module, _, name = qualname.rpartition(".")
    source = prefix + "code/" + module.replace(".", "/") + ".py"
    try:
        text = archive.read(source).decode("utf-8")
    except KeyError:
        text = ""
    block = re.search(rf"^class {re.escape(name)}\(.*?\):\n((?:  .*\n?|\n)*)", text, re.M)
    found = dict(_DECLARED.findall(block.group(1))) if block else {}
    if set(found) != {"__parameters__", "__buffers__"}:
        raise InvalidArgumentError(
            f"{path!r}: TorchScript class {qualname!r} declares no __parameters__ and __buffers__ in {source!r}, so "
            "restorekit cannot tell its weights from its other attributes; load it with torch.jit.load where you "
            "trust it and save module.state_dict()"
        )
    try:
        return ast.literal_eval(found["__parameters__"]), ast.literal_eval(found["__buffers__"])
    except (ValueError, SyntaxError):
        raise InvalidArgumentError(f"{path!r}: TorchScript class {qualname!r} has unreadable declarations in {source!r}")


def _state(path: str, archive, prefix: str, module: ScriptModule, name: str, out: dict, seen: set) -> None:
    """``module.state_dict()``'s names: each module's parameters, then its buffers, then its submodules."""
    if id(module) in seen:  # a module shared by two parents: state_dict names it once, at its first path
        return
    seen.add(id(module))
    parameters, buffers = _declared(path, archive, prefix, module.qualname)
    for attr in (*parameters, *buffers):
        value = module.state.get(attr)
        if value is None:
            continue  # an optional parameter left unset (bias=False): state_dict leaves it out too
        full = f"{name}{attr}"
        if not isinstance(value, torchfile.View):
            raise InvalidArgumentError(f"{path!r}: TorchScript parameter or buffer {full!r} is not a tensor")
        out[full] = value
    for attr, value in module.state.items():
        if isinstance(value, ScriptModule):
            _state(path, archive, prefix, value, f"{name}{attr}.", out, seen)


def scan_script(path: str, archive) -> torchfile.Scan:
    """The parameters and buffers of a TorchScript archive as a flat state_dict of Views.

    Raises:
        CorruptCheckpointError: an unreadable ``data.pkl``.
        InvalidArgumentError: a class whose parameters cannot be told apart (named), a pickle
            building what a module tree does not hold (named).
    """
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise CorruptCheckpointError(f"{path!r} is a zip archive but not a TorchScript one: no single 'NAME/data.pkl'")
    prefix = pickles[0][: -len("data.pkl")]
    records = {}
    for info in archive.infolist():
        if info.filename.startswith(prefix + "data/"):
            if info.compress_type != 0:
                raise CorruptCheckpointError(f"{path!r}: record {info.filename!r} is compressed; torch stores its records as they are")
            records[info.filename[len(prefix + "data/"):]] = info.file_size
    unpickler = _Unpickler(io.BytesIO(archive.read(pickles[0])), torchfile._torch_itemsizes())
    try:
        root = torchfile.load_pickle(unpickler)
    except torchfile.ScanError as e:
        raise CorruptCheckpointError(f"{path!r}: its TorchScript data.pkl cannot be read ({e})") from None
    if unpickler.unknown:
        names = ", ".join(map(repr, dict.fromkeys(unpickler.unknown)))
        raise InvalidArgumentError(f"{path!r}: its TorchScript module tree calls {names}, which restorekit does not build")
    if not isinstance(root, ScriptModule):
        raise CorruptCheckpointError(f"{path!r}: its TorchScript data.pkl holds a {type(root).__name__}, not a module")
    state: collections.OrderedDict = collections.OrderedDict()
    _state(path, archive, prefix, root, "", state, set())
    if not state:
        raise InvalidArgumentError(f"{path!r}: the TorchScript module has no parameters or buffers to import")
    return torchfile.Scan(state, records, (), prefix)
