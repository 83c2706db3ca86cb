"""Fuzz the Keras file reader: damaged .weights.h5, .keras and legacy .h5 files through restorekit.Checkpoint.

Each damaged file is opened with ``restorekit.Checkpoint(path)``, listed (``entries``,
readable paths) and every entry read: it must succeed or raise a RestoreKitError. The
damaged files go to HDF5's C library, which no in-process guard can stop from crashing,
so a worker process (this file run as a script, without TensorFlow) reads them and
prints one JSON line when a case starts and one with its outcome; when it dies, the
test names the case and starts a new worker after it. An alarm per case catches hangs,
and an address-space limit turns a runaway allocation into an error the test reports.
"""

from __future__ import annotations

import io
import json
import os
import random
import resource
import struct
import sys
import zipfile

import pytest

from fuzzing import flip, outcome_counts, overwrite, run_all, run_cases, truncate

SEED = 20250613
CASE_SECONDS = 30  # a hang guard, not a speed bar: a loaded 2-core machine must not trip it
RSS_GROWTH_LIMIT = 400 << 20  # bytes; the seeds are a few KB, a damaged shape may claim terabytes
# HDF5 itself allocates (and zeroes) a damaged variable-length string's 32-bit length before it
# notices the damage (2 GiB in case h5-overwrite-15): a refused file may cost up to this much.
REFUSED_RSS_GROWTH_LIMIT = (4 << 30) + RSS_GROWTH_LIMIT
ADDRESS_SPACE_LIMIT = 6 << 30  # the worker imports numpy and h5py, never TensorFlow


# ------------------------------------------------------------------ seeds (in the test process: they need Keras)


def _seeds(directory) -> dict:
    """A trained model (Dense, BatchNormalization, Adam state) as .weights.h5, .keras, legacy .h5 and weights-only .h5."""
    import h5py
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    # Named explicitly: automatic names would take Keras's global counters from other tests.
    model = keras.Sequential([keras.Input((4,), name="fz_in"), keras.layers.Dense(3, name="enc"),
                              keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(2, name="head")],
                             name="fz")
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((4, 4), "float32"), np.ones((4, 2), "float32"), verbose=0)
    paths = {kind: os.path.join(directory, f"seed.{kind}") for kind in ("weights.h5", "keras", "h5")}
    model.save_weights(paths["weights.h5"])
    model.save(paths["keras"])
    model.save(paths["h5"])  # Keras 3 writes the legacy HDF5 layout for .h5
    paths["legacy-weights.h5"] = os.path.join(directory, "seed-legacy.h5")
    with h5py.File(paths["h5"], "r") as src, h5py.File(paths["legacy-weights.h5"], "w") as out:
        for key, value in src["model_weights"].attrs.items():
            out.attrs[key] = value
        for name in src["model_weights"]:
            src.copy(src["model_weights"][name], out, name)
    return paths


# ------------------------------------------------------------------ byte-level damage


# ------------------------------------------------------------------ structured damage, written with h5py


def _datasets(f) -> list:
    import h5py

    found = []
    f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
    return sorted(found)


def _replace_dataset(rng, f, name):
    """Put another dataset where ``name`` was: a huge declared shape, another dtype, a scalar, a group."""
    import h5py
    import numpy as np

    attrs = dict(f[name].attrs)
    del f[name]
    choice = rng.randrange(6)
    if choice == 0:  # declared, never written: HDF5 reads it back as fill values
        f.create_dataset(name, shape=rng.choice([(2**31,), (2**20, 2**20), (2**40,), (2**16, 2**16)]), dtype="f4")
    elif choice == 1:  # declared huge, compressed: a few KB on disk
        f.create_dataset(name, shape=(2**26,), dtype="f4", chunks=(2**20,), compression="gzip", fillvalue=1.0)
    elif choice == 2:
        dtype = rng.choice([h5py.string_dtype(), h5py.vlen_dtype("f4"), h5py.ref_dtype, "c8",
                            np.dtype([("a", "f4"), ("b", "i8")]), "V7", "f2", "<u8"])
        f.create_dataset(name, shape=(3,), dtype=dtype)
    elif choice == 3:
        f.create_dataset(name, data=np.float32(rng.random()))
    elif choice == 4:
        f.create_group(name)
    else:
        f.create_dataset(name, data=np.zeros((0, 3), "f4"))
    for key, value in attrs.items():
        if isinstance(f[name], h5py.Dataset):
            f[name].attrs[key] = value
    if rng.random() < 0.3 and isinstance(f[name], h5py.Dataset):
        f[name].attrs["dtype"] = "bfloat16"


def _damage_attrs(rng, f):
    """Change the attributes the reader takes names from: layer_names, weight_names, vars' name, model_config."""
    import numpy as np

    groups = []
    f.visit(lambda name: groups.append(name))
    holders = [g for g in ["/"] + groups if any(k in f[g].attrs for k in ("layer_names", "weight_names", "name",
                                                                         "model_config"))]
    target = f[rng.choice(holders)] if holders else f
    key = rng.choice([k for k in ("layer_names", "weight_names", "name", "model_config") if k in target.attrs]
                     or ["layer_names"])
    target.attrs[key] = rng.choice([
        np.array([b"missing"]), np.array([1, 2, 3]), b"\xff\xfe", np.array([b"../x", b""]), "{not json",
        np.array([b"a" * 30000]), np.float64(2.5), np.array([[b"x"]]), "[" * 5000, json.dumps({"config": [1]}),
    ])


def _damage_links(rng, f):
    """Links the reader would follow: a cycle, a dangling soft link, an external file, deep nesting."""
    import h5py
    import numpy as np

    groups = [name for name in _groups(f) if name] or [""]
    parent = f[rng.choice(groups)] if groups != [""] else f
    choice = rng.randrange(4)
    if choice == 0:
        parent["loop"] = h5py.SoftLink(parent.name)
    elif choice == 1:
        parent["dangling"] = h5py.SoftLink("/nowhere/at/all")
    elif choice == 2:
        parent["external"] = h5py.ExternalLink(rng.choice(["/etc/passwd", "/nonexistent.h5"]), "/")
    else:
        group = parent.create_group("deep")
        for i in range(rng.choice([50, 400])):
            group = group.create_group("vars" if i % 2 else "layers")
        group.create_dataset("0", data=np.ones(2, "f4"))


def _groups(f) -> list:
    import h5py

    found = [""]
    f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Group) else None)
    return found


def _structured_h5(rng, path, data):
    """A copy of an HDF5 seed with one or two structural changes."""
    import h5py

    with open(path, "wb") as f:
        f.write(data)
    with h5py.File(path, "r+") as f:
        for _ in range(rng.randint(1, 2)):
            choice = rng.randrange(3)
            if choice == 0:
                _replace_dataset(rng, f, rng.choice(_datasets(f)))
            elif choice == 1:
                _damage_attrs(rng, f)
            else:
                _damage_links(rng, f)
    with open(path, "rb") as f:
        return f.read()


# ------------------------------------------------------------------ structured damage to the .keras zip


def _rezip(data, change) -> bytes:
    """Rewrite a .keras archive member by member; ``change(name, body)`` returns [(name, body, compress), ...]."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as a, zipfile.ZipFile(out, "w") as b:
        for info in a.infolist():
            for name, body, compress in change(info.filename, a.read(info)):
                b.writestr(zipfile.ZipInfo(name), body, compress_type=compress)
    return out.getvalue()


def _structured_zip(rng, data, weights_h5):
    stored = zipfile.ZIP_STORED
    choice = rng.randrange(8)
    if choice == 0:  # the weights member renamed
        new = rng.choice(["model.weights.h6", "../model.weights.h5", "dir/model.weights.h5", "MODEL.WEIGHTS.H5"])
        return _rezip(data, lambda n, b: [(new if n == "model.weights.h5" else n, b, stored)])
    if choice == 1:  # the weights member compressed
        return _rezip(data, lambda n, b: [(n, b, zipfile.ZIP_DEFLATED if n.endswith(".h5") else stored)])
    if choice == 2:  # a member twice
        return _rezip(data, lambda n, b: [(n, b, stored), (n, b[: len(b) // 2], stored)])
    if choice == 3:  # a damaged config
        config = rng.choice([b"{not json", b"[" * 100000, b"\xff\xfe", b'{"class_name": 5, "config": []}',
                             json.dumps({"config": {"layers": [{"class_name": "Dense", "config": None}]}}).encode()])
        return _rezip(data, lambda n, b: [(n, config if n in ("config.json", "metadata.json") else b, stored)])
    if choice == 4:  # another HDF5 file as the weights member (a structurally damaged one)
        return _rezip(data, lambda n, b: [(n, weights_h5 if n == "model.weights.h5" else b, stored)])
    if choice == 5:  # a central directory entry with crafted sizes or offsets
        data = bytearray(data)
        at = data.rfind(b"PK\x01\x02")
        field = rng.choice([20, 24, 42])  # compressed size, uncompressed size, local header offset
        struct.pack_into("<I", data, at + field, rng.choice([0, 0xFFFFFFFF, len(data) * 2, 7]))
        return bytes(data)
    if choice == 6:  # bytes overwritten inside the stored weights member, the zip CRC left as it was
        return overwrite(rng, data)
    return _rezip(data, lambda n, b: [] if n == rng.choice(["config.json", "model.weights.h5"]) else [(n, b, stored)])


def _corpus(directory) -> list:
    """(case name, file name, damaged bytes), in a fixed order from a fixed seed."""
    paths = _seeds(directory)
    rng = random.Random(SEED)
    cases = []
    scratch = os.path.join(directory, "scratch.h5")
    for kind, path in paths.items():
        with open(path, "rb") as f:
            data = f.read()
        suffix = ".keras" if kind == "keras" else (".weights.h5" if kind == "weights.h5" else ".h5")
        for i in range(30):
            damage = rng.choice([flip, truncate, overwrite])
            cases.append((f"{kind}-{damage.__name__}-{i}", suffix, damage(rng, data)))
        for i in range(30):
            if kind == "keras":
                with open(paths["weights.h5"], "rb") as f:
                    weights_h5 = _structured_h5(rng, scratch, f.read())
                damaged = _structured_zip(rng, data, weights_h5)
            else:
                damaged = _structured_h5(rng, scratch, data)
            cases.append((f"{kind}-structured-{i}", suffix, damaged))
    return cases


# ------------------------------------------------------------------ the worker


def _read_all(path) -> None:
    import restorekit

    ckpt = restorekit.Checkpoint(path)
    for key, entry in ckpt.entries.items():
        ckpt.readable_name(key)
        value = ckpt.read(key)
        assert tuple(value.shape) == tuple(entry.shape), (key, value.shape, entry.shape)
    for path in ckpt.object_paths:
        ckpt.object_paths[path]


def worker(directory: str, start: int) -> None:
    """Read the cases listed in ``directory/cases.json`` from ``start``, one JSON line per case start and outcome."""
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))
    with open(os.path.join(directory, "cases.json")) as f:
        cases = json.load(f)
    import h5py  # noqa: F401 - loaded before the baseline, like the reader will

    run_cases(cases, start, CASE_SECONDS, lambda index, case: _read_all(case[1]))


# ------------------------------------------------------------------ the test


@pytest.mark.slow
def test_damaged_keras_files_read_or_raise_restorekit_errors(tmp_path):
    cases = _corpus(tmp_path)
    listed = []
    for i, (name, suffix, data) in enumerate(cases):
        path = tmp_path / f"case{i:03d}{suffix}"
        path.write_bytes(data)
        listed.append((name, str(path)))
    (tmp_path / "cases.json").write_text(json.dumps(listed))
    total, base_rss, finished, failures = run_all(__file__, tmp_path)
    outcomes = outcome_counts(finished)
    peak_rss = max(((line["rss"], line["name"]) for line in finished if line["outcome"].split()[0] != "error"),
                   default=(0, None))
    peak_refused = max(((line["rss"], line["name"]) for line in finished), default=(0, None))
    assert total >= 200
    assert not failures, "\n".join(failures)
    grown = peak_rss[0] - base_rss
    assert grown < RSS_GROWTH_LIMIT, f"case {peak_rss[1]}: peak RSS grew by {grown >> 20} MiB"
    grown = peak_refused[0] - base_rss
    assert grown < REFUSED_RSS_GROWTH_LIMIT, f"case {peak_refused[1]} (refused): peak RSS grew by {grown >> 20} MiB"
    assert outcomes.get("error", 0) > total // 3 and outcomes.get("ok", 0) > 0, outcomes


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
