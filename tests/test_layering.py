"""The package's shape: imports go one way (bottom to top), modules stay small.

Every import counts, including those inside functions (they are how a cycle hides).
"""

import ast
import os
from collections import defaultdict

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "restorekit")

# Bottom to top. A module may import modules of its own layer or below, never above;
# within a layer the imports must still form no cycle. Names are module paths below
# `restorekit.`; a name also covers its package's modules (`graph` covers `graph.freeze`).
LAYERS = [
    ["errors"],
    ["_names", "_tensorflow"],
    ["_bundle", "_registry"],  # the Source protocol and the registry know no format: Checkpoint asks them
    ["_checkpoint", "keras_files"],
    ["_report", "_ema", "_rundir"],
    # The views a conversion reads a source through: layout='torch' and its record of TF <-> torch names and
    # axes (also what torch_target reads a checkpoint through), a checkpoint seen through a plan (layouts._planned).
    ["layouts"],
    # The formats: one package or module each, reader and writer side by side (safetensors, torch, npz, tf),
    # behind the one registry; files holds what the file readers share, _sink what the writers share.
    ["formats"],
    # Conversions (open -> view -> write) and the ready rule sets of export._hf.
    ["export"],
    ["_trackables", "_targets", "_torch_target", "_flax_target", "rules", "_policies", "_assignment", "_hints", "_array_values"],
    ["_optim"],  # optimizer state paired through the weights' records (issue 36); _optim._torch writes torch.optim
    ["_sources"],  # several sources: scanned one by one (scan passes itself in) and merged
    ["_scan"],
    ["_remap", "_tf1", "_tf2", "_restore_keras", "_restore_torch", "_restore_flax", "_initializers", "_distribute"],
    ["_scaffold", "finetune", "_resume"],
    ["_compare", "edit", "graph", "compress", "_averaging", "_merging", "_lora"],
    ["demo"],
    ["cli", "__main__", ""],  # "" is the package's own __init__ (the public face)
]

MAX_LINES = 650


def _modules(root: str = ROOT) -> dict[str, str]:
    found = {}
    for directory, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                rel = "" if rel == "__init__" else rel.removesuffix(".__init__")
                found[rel] = path
    return found


MODULES = _modules()


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if module else []
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(["restorekit", *base, *([node.module] if node.module else [])])


def _known(name: str, modules: dict) -> str | None:
    """The restorekit module ``name`` is or lives in (longest known prefix), None outside restorekit."""
    if name != "restorekit" and not name.startswith("restorekit."):
        return None
    parts = name.split(".")[1:]
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts)


def _imports(module: str, path: str, modules: dict = MODULES) -> set[str]:
    """restorekit modules that ``module`` imports, anywhere in its body (function-level imports too)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    is_package = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(_known(a.name, modules) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            for a in node.names:
                # `from restorekit._bundle import files` imports the module files, not bundle's __init__
                full = f"{base}.{a.name}"
                out.add(_known(full, modules) if full[len("restorekit."):] in modules else _known(base, modules))
    out.discard(None)
    # Importing `restorekit.a.b.c` runs `a/__init__` and `a/b/__init__` first: they count as imported too,
    # except the importing module's own packages (their __init__ is running, or ran, already).
    own = {".".join(module.split(".")[:i]) for i in range(len(module.split(".")))} if module else set()
    for name in list(out):
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in modules and parent not in own:
                out.add(parent)
    return {m for m in out if m != module}


def _graph(modules: dict) -> dict[str, set[str]]:
    return {m: _imports(m, p, modules) for m, p in modules.items()}


GRAPH = _graph(MODULES)


def _layer(module: str) -> int:
    best, best_len = None, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or (name and module.startswith(name + "."))) and len(name) > best_len:
                best, best_len = i, len(name)
    return best


def test_every_module_has_a_layer():
    assert [m for m in MODULES if _layer(m) is None] == []


def test_imports_never_go_up():
    upward = []
    for module, imported in GRAPH.items():
        for other in imported:
            # a package's __init__ may gather its own modules (re-exports)
            if other.startswith(module + ".") and module:
                continue
            if _layer(other) > _layer(module):
                upward.append(f"{module or 'restorekit'} -> {other or 'restorekit'}")
    assert sorted(upward) == []


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every import cycle found by a depth-first walk. A package's ``__init__`` importing its own modules is an
    edge like any other, so a module that imports its package's ``__init__`` back closes a cycle."""
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "active"
        for other in sorted(graph.get(node, ())):
            if state.get(other) == "active":
                cycles.append(" -> ".join((m or "restorekit") for m in stack[stack.index(other):] + [other]))
            elif other not in state:
                visit(other, stack + [other])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_imports_form_no_cycle():
    assert _cycles(GRAPH) == []


def test_a_package_init_and_its_module_importing_each_other_is_a_cycle(tmp_path):
    # The shape keras_files once had: __init__ imports its module at the top, the module imports
    # __init__ back inside a function (and a sibling by its full name, which is no cycle).
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (tmp_path / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from restorekit.pkg.sub import Sub\n\nclass Base:\n    pass\n")
    (pkg / "sub.py").write_text("from restorekit.pkg import other\n\n\ndef make():\n"
                                "    from restorekit.pkg import Base\n\n    return Base\n")
    (pkg / "other.py").write_text("")
    graph = _graph(_modules(str(tmp_path)))
    assert graph["pkg"] == {"pkg.sub"} and graph["pkg.sub"] == {"pkg", "pkg.other"}
    assert _cycles(graph) == ["pkg -> pkg.sub -> pkg"]


def test_importing_a_submodule_counts_its_packages_init(tmp_path):
    # `from restorekit.pkg.sub import x` runs pkg/__init__ first: an import there above the importer's layer
    # is an import of the importer's too. The importer's own packages are not counted.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (tmp_path / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from restorekit import top\n")
    (pkg / "sub.py").write_text("")
    (pkg / "inner.py").write_text("from restorekit.pkg.sub import x\n")
    (tmp_path / "top.py").write_text("")
    (tmp_path / "low.py").write_text("from restorekit.pkg.sub import x\n")
    graph = _graph(_modules(str(tmp_path)))
    assert graph["low"] == {"pkg", "pkg.sub"}
    assert graph["pkg.inner"] == {"pkg.sub"}


@pytest.mark.parametrize("module", sorted(MODULES), ids=lambda m: m or "__init__")
def test_module_is_small(module):
    with open(MODULES[module], encoding="utf-8") as f:
        assert sum(1 for _ in f) <= MAX_LINES


def test_import_restorekit_does_not_import_tensorflow_torch_or_jax():
    import subprocess
    import sys

    code = ("import restorekit, sys; print(sorted(m for m in ('tensorflow', 'torch', 'safetensors', 'h5py', 'jax', 'flax', "
            "'optax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(ROOT)).stdout.strip()
    assert out == "[]"


def test_the_lists_are_what_the_check_reads():
    # A sanity check that the walk sees real edges (a walk that finds nothing passes vacuously).
    assert "errors" in GRAPH["_checkpoint"] and "_checkpoint" in GRAPH["_scan"]
    assert defaultdict(set, GRAPH)["errors"] == set()
