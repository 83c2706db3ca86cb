"""restorekit/errors.py: the tree drawn in its docstring is the class tree, every error is public."""

import inspect
import pickle
import re

import pytest

import restorekit
from restorekit import errors

_ROW = re.compile(r"^(?P<indent>[\s│]*)(?:[├└]── )?(?P<name>[A-Z]\w+)\s*(?:\((?P<extra>\w+)\))?")


def _drawn_tree():
    """(name, parent, extra base) for every row of the tree drawn in the module docstring."""
    rows, stack = [], []
    for line in errors.__doc__.splitlines():
        if not line.strip().startswith("RestoreKitError") and "──" not in line:
            continue
        m = _ROW.match(line)
        depth = (len(m.group("indent")) - 4) // 4 + (1 if "──" in line else 0)
        del stack[depth:]
        rows.append((m.group("name"), stack[-1] if stack else None, m.group("extra")))
        stack.append(m.group("name"))
    return rows


def _error_classes():
    return {name: cls for name, cls in vars(errors).items()
            if inspect.isclass(cls) and issubclass(cls, errors.RestoreKitError)}


def test_drawn_tree_lists_every_error_class_once():
    drawn = [name for name, _, _ in _drawn_tree()]
    assert len(drawn) == len(set(drawn))
    assert sorted(drawn) == sorted(_error_classes())


@pytest.mark.parametrize("name,parent,extra", _drawn_tree(), ids=[row[0] for row in _drawn_tree()])
def test_drawn_parent_and_builtin_are_the_real_bases(name, parent, extra):
    cls = getattr(errors, name)
    if parent is not None:
        assert cls.__bases__[0] is getattr(errors, parent)
    if extra is not None:
        extra_cls = getattr(errors, extra, None) or getattr(__builtins__, extra, None) or __builtins__[extra]
        assert issubclass(cls, extra_cls)


def test_every_error_is_exported_from_the_package_and_errors_all():
    names = set(_error_classes()) | {"RestoreKitWarning"}
    assert names <= set(errors.__all__)
    assert names <= set(restorekit.__all__)
    assert all(getattr(restorekit, n) is getattr(errors, n) for n in names)


def test_no_match_error_finds_its_own_near_misses():
    e = errors.NoMatchError("no entry 'dense/kernl'.", name="dense/kernl", candidates=["dense/kernel", "other/bias"])
    assert e.closest == ("dense/kernel",)
    assert str(e) == "no entry 'dense/kernl'. Closest: 'dense/kernel'."
    quiet = errors.NoMatchError("no entry 'zzz'.", name="zzz", candidates=["dense/kernel"])
    assert str(quiet) == "no entry 'zzz'." and quiet.closest == ()


@pytest.mark.parametrize("is_source,words", [(True, "is the source checkpoint"), (False, "exists; pass overwrite=True")],
                         ids=["source", "existing"])
def test_output_exists_error_words_itself_from_its_fields(is_source, words):
    e = errors.OutputExistsError(path="out/model", is_source=is_source)
    assert e.path == "out/model" and e.is_source is is_source
    assert words in str(e) and "'out/model'" in str(e)
    assert isinstance(e, FileExistsError)


def test_checkpoint_not_found_is_a_file_not_found_error_and_pickles():
    e = errors.CheckpointNotFoundError("no checkpoint at 'x'", path="x")
    assert isinstance(e, FileNotFoundError)
    assert str(pickle.loads(pickle.dumps(e))) == "no checkpoint at 'x'"


def test_format_names_cuts_long_lists():
    assert errors.format_names(["a", "b", "c"], limit=2) == "'a', 'b', ... and 1 more"
