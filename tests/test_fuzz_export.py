"""Fuzz the file readers of restorekit/export (.pt, .npz, .safetensors) with a fixed-seed corpus.

Every damaged file (bit flips, truncations, overwritten ranges, crafted pickles, .npy
headers and safetensors headers, rezipped so the zip CRC still holds and the damage
reaches the parser behind it) must read or raise a RestoreKitError: no other exception
type, no hang (an alarm per case), and no memory blow-up (peak RSS grows by little).
"""

import json
import random
import resource
import signal
import struct
import zipfile
from functools import partial

import numpy as np
import pytest

from conftest import requires_torch
from fuzzing import Hang, flip, on_alarm, overwrite, truncate
from restorekit.errors import RestoreKitError
from restorekit.export import import_checkpoint
from restorekit.formats import npz as npz_format
from restorekit.formats import safetensors as st_format
from restorekit.formats import torch as torch_format

SEED = 20240611
CASE_SECONDS = 30  # a hang guard, not a speed bar: a loaded 2-core machine must not trip it
RSS_GROWTH_LIMIT = 400 << 20  # bytes; the largest honest output here is a few KB


def _seeds(tmp_path, fmt):
    """Valid files of one format (``fmt``, its suffix), a few dtypes and shapes each."""
    import ml_dtypes

    seeds = {}
    if fmt == ".pt":
        import torch  # the .pt case is marked requires_torch
        base = torch.arange(12.0).reshape(3, 4)
        state = {"w": base, "tied": base, "b": torch.ones(3, dtype=torch.bfloat16), "i": torch.arange(5),
                 "s": torch.tensor(2.5)}
        torch.save(state, tmp_path / "seed.pt")
        seeds["pt"] = (tmp_path / "seed.pt").read_bytes()
        torch.save({"a": torch.arange(6, dtype=torch.int32)}, tmp_path / "legacy.pt",
                   _use_new_zipfile_serialization=False)
        seeds["legacy.pt"] = (tmp_path / "legacy.pt").read_bytes()
        return seeds
    values = [("k", np.arange(20, dtype=np.float32).reshape(4, 5)),
              ("h", np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)),
              ("v", np.array([b"a\x00", b"bc"], dtype=object)), ("n", np.int64(7))]
    if fmt == ".npz":
        npz_format.write(tmp_path / "seed.npz", values)
        seeds["npz"] = (tmp_path / "seed.npz").read_bytes()
        np.savez_compressed(tmp_path / "deflated.npz", x=np.arange(200, dtype=np.int16), y=np.zeros((3, 3)))
        seeds["deflated.npz"] = (tmp_path / "deflated.npz").read_bytes()
    else:
        st_format.write(tmp_path / "seed.safetensors", values[:2] + values[3:])
        seeds["safetensors"] = (tmp_path / "seed.safetensors").read_bytes()
    return seeds


# This corpus's own mutation sizes (the seed corpus depends on them).
_flip = partial(flip, most=8)
_overwrite = partial(overwrite, fills=(b"\xff", b"\x00", b"\x7f"), longest=16)


def _rezipped(rng, data, mutate_member):
    """Rewrite a zip with one member mutated and its CRC recomputed (damage past the zip layer)."""
    import io

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as a, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as b:
        infos = a.infolist()
        target = rng.choice(infos)
        for info in infos:
            body = a.read(info)
            if info is target:
                body = mutate_member(rng, info.filename, body)
            b.writestr(info.filename, body)
    return out.getvalue()


def _pickle_ints(rng, name, body):
    """Change the small integers a pickle builds shapes, strides, offsets and sizes from."""
    if not name.endswith(".pkl"):
        return _flip(rng, body) if body else body
    body = bytearray(body)
    spots = [i for i in range(len(body) - 1) if body[i] == ord("K")]  # BININT1
    for i in rng.sample(spots, min(len(spots), rng.randint(1, 3))):
        body[i + 1] = rng.choice([0, 1, 2, 255, body[i + 1] + 1, max(0, body[i + 1] - 1)])
    return bytes(body)


def _npy_header(rng, name, body):
    """Change an .npy header's shape, dtype or order."""
    end = body.find(b"\n")
    if not body.startswith(b"\x93NUMPY") or end < 0:
        return _flip(rng, body)
    header = body[10:end].decode("latin1")
    choice = rng.randrange(4)
    if choice == 0:
        header = header.replace("(", f"({rng.choice([0, 1, 10**9, 2**40, -1])}, ", 1)
    elif choice == 1:
        header = header.replace("'descr': '", f"'descr': '{rng.choice(['|O', '<f8', '|V3', '>i4', 'x'])}", 1)
    elif choice == 2:
        header = header.replace("False", "True")
    else:
        header = header[: rng.randrange(len(header))]
    return body[:10] + header.encode("latin1") + body[end:]


def _st_header(rng, data):
    """A safetensors file with one crafted header value."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    name = rng.choice([k for k in header if k != "__metadata__"])
    field = rng.choice(["shape", "data_offsets", "dtype", "length"])
    crafted = [2.9, True, -1, 2**63, 2**64 + 8, None, "2", [1, 2], 10**30]
    if field == "shape":
        header[name]["shape"] = rng.choice([[rng.choice(crafted)], [2**62, 4], [True, 2], [1] * 70, []])
    elif field == "data_offsets":
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = rng.choice([[end, begin], [begin, 2**64], [begin], [0.0, end], [begin, end + 8]])
    elif field == "dtype":
        header[name]["dtype"] = rng.choice(["F99", 5, None, "F8_E8M0", "BOOL", "C64"])
    text = json.dumps(header).encode()
    size = len(text) if field != "length" else rng.choice([0, 1, len(text) + 1, 2**40, 100_000_001, 2**64 - 1])
    return struct.pack("<Q", size) + text + data[8 + n :]


def _corpus(tmp_path, fmt):
    rng = random.Random(f"{SEED}{fmt}")  # one stream per format: the same corpus with or without torch
    seeds = _seeds(tmp_path, fmt)
    cases = []
    for kind, data in seeds.items():
        suffix = "." + kind.split(".")[-1]
        generic = [_flip, truncate, _overwrite]
        for i in range(45):
            cases.append((f"{kind}-{i}", suffix, rng.choice(generic)(rng, data), kind))
        if kind in ("pt", "npz", "deflated.npz"):
            member = _pickle_ints if kind == "pt" else _npy_header
            for i in range(30):
                cases.append((f"{kind}-rezipped-{i}", suffix, _rezipped(rng, data, member), None))
        if kind == "safetensors":
            for i in range(40):
                cases.append((f"{kind}-header-{i}", suffix, _st_header(rng, data), None))
    originals = {}
    for kind in (k for k in _CRC_PROTECTED if k in seeds):
        path = tmp_path / f"original.{kind.split('.')[-1]}"
        path.write_bytes(seeds[kind])
        originals[kind] = _read_all(_MODULES[path.suffix], path)
    return cases, originals


def _read_all(module, path) -> dict:
    module.read_shapes(path)
    return {name: np.asarray(array).tobytes() if np.asarray(array).dtype != object else np.asarray(array).tolist()
            for name, array in module.read(path)}


# Formats whose every byte that matters is under a zip CRC-32: damage that is not caught
# there must not change a value (it only hit bytes no reader uses).
_CRC_PROTECTED = ("pt", "npz", "deflated.npz")


_MODULES = {".pt": torch_format, ".npz": npz_format, ".safetensors": st_format}


@pytest.mark.parametrize("fmt", [pytest.param(".pt", id="pt", marks=requires_torch), ".npz", ".safetensors"])
def test_damaged_files_read_or_raise_restorekit_errors(tmp_path, fmt):
    cases, originals = _corpus(tmp_path, fmt)
    assert len(cases) >= 80
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    old = signal.signal(signal.SIGALRM, on_alarm)
    foreign, hangs, changed, outcomes = [], [], [], {"read": 0, "refused": 0}
    try:
        for i, (name, suffix, data, kind) in enumerate(cases):
            path = tmp_path / f"case{suffix}"
            path.write_bytes(data)
            signal.alarm(CASE_SECONDS)
            try:
                values = _read_all(_MODULES[suffix], path)
                if kind in originals and values != originals[kind]:
                    changed.append(name)
                if i % 10 == 0:
                    import_checkpoint(path, tmp_path / f"out{i}" / "m")
                outcomes["read"] += 1
            except RestoreKitError:
                outcomes["refused"] += 1
            except Hang:
                hangs.append(name)
            except Exception as e:  # noqa: BLE001 - the point: no other type may escape
                foreign.append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, old)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    assert not foreign, "\n".join(foreign)
    assert not hangs, hangs
    assert not changed, f"damaged files read with changed values: {changed}"
    assert grown < RSS_GROWTH_LIMIT, f"peak RSS grew by {grown >> 20} MiB"
    assert outcomes["refused"] > len(cases) // 2 and outcomes["read"] > 0, outcomes
