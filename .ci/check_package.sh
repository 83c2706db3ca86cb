#!/usr/bin/env bash
# The package as a user gets it: build the wheel and the sdist from the files git tracks
# (plus new, unignored ones), check what they hold, install ONLY the wheel into a fresh
# venv (no system site packages: numpy and the other hard dependencies come from the
# package index, TensorFlow does not come at all) and use it there: the CLI, a
# checkpoint written and read back, `inspect`, and `demo` refusing without its extra.
# Leaves nothing behind (one temp dir, removed on exit). Under a minute on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH  # the installed wheel, never the source tree, is under test
PYTHON=${PYTHON:-python3}

TMP=$(mktemp -d "${TMPDIR:-/tmp}/restorekit-package.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
fail() { echo "check_package: FAIL: $*" >&2; exit 1; }
step() { echo "check_package: $*"; }

# -- build from a clean copy, so the source tree gets no build/ or *.egg-info
mkdir "$TMP/src" "$TMP/dist" "$TMP/work"
git ls-files -z --cached --others --exclude-standard \
    | tar --null --files-from=- --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$TMP/src"
"$PYTHON" -m venv "$TMP/build-env"
"$TMP/build-env/bin/pip" install --quiet build
step "building the wheel and the sdist"
if ! "$TMP/build-env/bin/python" -m build --outdir "$TMP/dist" "$TMP/src" >"$TMP/build.log" 2>&1; then
    cat "$TMP/build.log" >&2
    fail "python -m build failed"
fi
# setuptools' warnings about the license metadata (PEP 639) or anything else deprecated
if grep -n -i "deprecat\|license.*warn\|warn.*license" "$TMP/build.log" >&2; then
    fail "the build printed the warnings above"
fi

# -- what the archives hold
"$TMP/build-env/bin/python" - "$TMP/dist" <<'PY'
import email.parser, pathlib, sys, tarfile, zipfile

dist = pathlib.Path(sys.argv[1])
(wheel,), (sdist,) = dist.glob("*.whl"), dist.glob("*.tar.gz")
with zipfile.ZipFile(wheel) as z:
    wheel_names = z.namelist()
    (metadata,) = [n for n in wheel_names if n.endswith(".dist-info/METADATA")]
    meta = email.parser.Parser().parsestr(z.read(metadata).decode("utf-8"))
with tarfile.open(sdist) as t:
    sdist_names = [n.split("/", 1)[1] for n in t.getnames() if "/" in n]  # below restorekit-X.Y.Z/

problems = []
def need(cond, what):
    if not cond:
        problems.append(what)

need(any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel_names), "wheel: no dist-info/licenses/LICENSE")
need("restorekit/py.typed" in wheel_names, "wheel: no restorekit/py.typed")
need("restorekit/cli/__init__.py" in wheel_names, "wheel: no restorekit/cli")
need("LICENSE" in sdist_names, "sdist: no LICENSE")
need("restorekit/py.typed" in sdist_names, "sdist: no restorekit/py.typed")
for kind, names in (("wheel", wheel_names), ("sdist", sdist_names)):
    for top in ("tests", "benchmarks", "examples", "docs", "site", ".ci"):
        stray = [n for n in names if n == top or n.startswith(top + "/") or f"/{top}/" in n]
        need(not stray, f"{kind}: holds {top}/ ({', '.join(stray[:3])} ...)")
    need(not [n for n in names if "__pycache__" in n or n.endswith(".pyc")], f"{kind}: holds compiled files")
need(meta["License-Expression"] == "Apache-2.0", f"metadata: License-Expression is {meta['License-Expression']!r}")
need(meta.get_all("License-File") == ["LICENSE"], f"metadata: License-File is {meta.get_all('License-File')!r}")
need(not [c for c in meta.get_all("Classifier", []) if c.startswith("License ::")], "metadata: a License classifier")
need(meta["Author"] and meta["Summary"] and meta.get_all("Classifier"), "metadata: no author, summary or classifiers")
if problems:
    sys.exit("check_package: FAIL:\n  " + "\n  ".join(problems))
print(f"check_package: {wheel.name}: {len(wheel_names)} files, {sdist.name}: {len(sdist_names)} files; "
      "LICENSE in both, no tests/benchmarks/examples/docs/.ci")
PY

# -- a fresh venv with the wheel alone
step "installing the wheel into a fresh venv"
"$PYTHON" -m venv "$TMP/venv"
"$TMP/venv/bin/pip" install --quiet "$TMP/dist/"*.whl
cd "$TMP/work"  # nothing importable from the current directory
PY="$TMP/venv/bin/python"
RK="$TMP/venv/bin/restorekit"
"$PY" -c 'import importlib.util as u, sys, restorekit
assert restorekit.__file__.startswith(sys.prefix), restorekit.__file__
missing = [m for m in ("tensorflow", "torch", "sklearn") if u.find_spec(m) is None]
assert missing == ["tensorflow", "torch", "sklearn"], f"the fresh venv has {missing}"'

"$RK" --help >"$TMP/help.txt" || fail "restorekit --help exited $?"
grep -q "^  *inspect" "$TMP/help.txt" && grep -q "exit codes:" "$TMP/help.txt" || fail "restorekit --help: $(cat "$TMP/help.txt")"
step "restorekit --help: $(grep -c '^    [a-z]' "$TMP/help.txt") commands listed"

# a TF-format checkpoint written by restorekit's own writer, read back without TensorFlow
"$PY" - <<'PY'
import sys

import numpy as np

import restorekit
from restorekit._bundle.writer import BundleWriter

values = {
    "dense/kernel": np.arange(12, dtype=np.float32).reshape(4, 3) / 7,
    "dense/bias": np.array([1.5, -2.0, 0.25], dtype=np.float32),
    "embedding": np.arange(10, dtype=np.int32).reshape(5, 2),
    "global_step": np.int64(42),
}
with BundleWriter("ckpt/model.ckpt") as writer:
    for name, value in values.items():
        writer.add(name, value)
ckpt = restorekit.Checkpoint("ckpt/model.ckpt")
assert sorted(ckpt) == sorted(values), sorted(ckpt)
for name, value in values.items():
    got = ckpt.read(name)
    assert got.dtype == value.dtype and got.shape == np.shape(value) and np.array_equal(got, value), name
assert ckpt.verify().ok, ckpt.verify()
assert "tensorflow" not in sys.modules
print(f"check_package: wrote and read back {len(values)} tensors with restorekit {restorekit.__version__}, no TensorFlow")
PY

"$RK" inspect ckpt/model.ckpt >"$TMP/inspect.txt" || fail "restorekit inspect exited $?"
for name in dense/kernel dense/bias embedding global_step; do
    grep -q "^$name " "$TMP/inspect.txt" || fail "restorekit inspect does not list $name: $(cat "$TMP/inspect.txt")"
done
"$RK" inspect ckpt/model.ckpt --json | "$PY" -c 'import json, sys
data = json.load(sys.stdin)
shapes = {t["name"]: t["shape"] for t in data["entries"]}
assert shapes == {"dense/bias": [3], "dense/kernel": [4, 3], "embedding": [5, 2], "global_step": []}, shapes'
step "restorekit inspect: the 4 tensors with their shapes"

# `demo` needs the demo extra (and TensorFlow): one error line, exit 3, nothing written
rc=0
"$RK" demo --out demo-out >"$TMP/demo.out" 2>"$TMP/demo.err" || rc=$?
expected="restorekit: error: the demo needs TensorFlow, scikit-learn and matplotlib, which are not installed: pip install 'restorekit[tf,demo]'"
[ "$rc" = 3 ] || fail "restorekit demo exited $rc, not 3: $(cat "$TMP/demo.err")"
[ "$(cat "$TMP/demo.err")" = "$expected" ] || fail "restorekit demo printed: $(cat "$TMP/demo.err")"
[ ! -s "$TMP/demo.out" ] && [ ! -e demo-out ] || fail "restorekit demo wrote output"
step "restorekit demo without its extra: exit 3, $expected"
step "OK"
