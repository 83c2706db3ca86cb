"""Fuzz the readers: a fixed-seed corpus of damaged indexes, entries, shards and object graphs.

Each input must read, or raise a RestoreKitError: never another exception type, never a
hang (SIGALRM fails a stuck test), never a large allocation (tracemalloc's peak per
input stays under a bound far below what a corrupt size field could ask for).
"""

import random
import signal
import tracemalloc

import numpy as np
import pytest
import tensorflow as tf

from restorekit._bundle.checks import check_header, check_shape, check_size
from restorekit._bundle.format import DT_FLOAT, decode_slice_key, encode_slice_key, tensor_crc
from restorekit._bundle.objectgraph import OBJECT_GRAPH_KEY, decode_object_graph
from restorekit._bundle.protos import BundleEntry, decode_entry, decode_header, encode_entry, put_field
from restorekit._bundle.table import FOOTER_SIZE, read_table, write_table
from restorekit._bundle.varint import put_varint
from restorekit._bundle.writer import BundleWriter
from restorekit._checkpoint import Checkpoint
from restorekit.errors import RestoreKitError

SEED = 20250611
PEAK_LIMIT = 64 << 20  # a corrupt size may claim terabytes; a read may hold a few MB


def _varint(value: int) -> bytes:
    out = bytearray()
    put_varint(out, value)
    return bytes(out)


# Values a damaged length, offset or count field would hold, and varints that are themselves broken.
CRAFTED = [_varint(v) for v in (0, 1, 127, 128, 255, 2**31 - 1, 2**31, 2**32, 2**40, 2**63 - 1, 2**63, 2**64 - 1)]
CRAFTED += [b"\x80" * 10 + b"\x01", b"\xff" * 11, b"\x80", b"\xff\xff\xff\xff\x0f"]


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One random damage: truncation, bit flips, a random or crafted insertion, an overwrite, a cut."""
    data = bytearray(data)
    if not data:
        return bytes(rng.choice(CRAFTED))
    kind = rng.randrange(7)
    pos = rng.randrange(len(data))
    if kind == 0:
        return bytes(data[: rng.randrange(len(data))])
    if kind == 1:
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 2:
        return bytes(data[:pos] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 9))) + data[pos:])
    if kind == 3:
        return bytes(data[:pos] + rng.choice(CRAFTED) + data[pos:])
    if kind == 4:
        crafted = rng.choice(CRAFTED)
        return bytes(data[:pos] + crafted + data[pos + len(crafted):])
    if kind == 5:
        return bytes(data[:pos] + data[pos + rng.randint(1, 8):])
    data[pos] = rng.choice((0x00, 0x7F, 0x80, 0xFF))
    return bytes(data)


@pytest.fixture
def guarded():
    """Run a fuzz loop with a hang alarm and allocation tracing; yields ``check(case, call)``."""

    def timeout(signum, frame):
        raise TimeoutError("a fuzz input made a reader hang")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(180)  # a hang guard for the whole loop, not a speed bar
    tracemalloc.start()
    outcomes = {"ok": 0, "error": 0}

    def check(case, call):
        tracemalloc.reset_peak()
        try:
            call()
        except RestoreKitError:
            outcomes["error"] += 1
        except Exception as e:  # the failure this harness exists to find
            pytest.fail(f"case {case}: {type(e).__name__}: {e}")
        else:
            outcomes["ok"] += 1
        peak = tracemalloc.get_traced_memory()[1]
        assert peak < PEAK_LIMIT, f"case {case} allocated {peak} bytes"

    try:
        yield check, outcomes
    finally:
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A checkpoint with every kind of entry: dtypes, strings, an empty tensor, a partitioned tensor."""
    import ml_dtypes

    prefix = str(tmp_path_factory.mktemp("fuzz-source") / "m")
    with BundleWriter(prefix) as w:
        w.add("float32", np.arange(12, dtype=np.float32).reshape(3, 4))
        w.add("bfloat16", np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16))
        w.add("int4", np.array([-8, 0, 7], dtype=ml_dtypes.int4))
        w.add("int64", np.int64(-(2**40)))
        w.add("bool", np.array([True, False]))
        w.add("string", np.array([[b"hello", b""], [b"\x00\xff", "é".encode()]], dtype=object))
        w.add("empty", np.zeros((0, 3), np.float32))
        raw = np.arange(8, dtype=np.float32).tobytes()
        for start in (0, 2):
            w.add_raw(encode_slice_key("part", ((start, 2), (0, -1))),
                      BundleEntry(dtype=DT_FLOAT, shape=(2, 2), size=16, crc32c=tensor_crc(raw[start * 8:start * 8 + 16])),
                      raw[start * 8:start * 8 + 16])
        w.add_entry_only("part", BundleEntry(dtype=DT_FLOAT, shape=(4, 2), slices=(b"", b"")))
    assert Checkpoint(prefix).verify().ok
    return prefix


def _files(prefix):
    with open(prefix + ".index", "rb") as f:
        index = f.read()
    with open(prefix + ".data-00000-of-00001", "rb") as f:
        shard = f.read()
    return index, shard


def _write(prefix, index, shard):
    with open(prefix + ".index", "wb") as f:
        f.write(index)
    with open(prefix + ".data-00000-of-00001", "wb") as f:
        f.write(shard)


def _read_everything(prefix):
    ckpt = Checkpoint(prefix)
    ckpt.verify()
    for name in ckpt:
        ckpt.read(name)


# ------------------------------------------------------------------ the index table


def _crafted_footer(rng, index: bytes) -> bytes:
    # Block handles (offset, size varints) that point anywhere, then the real magic number.
    handles = b"".join(rng.choice(CRAFTED) for _ in range(4))
    footer = handles[: FOOTER_SIZE - 8].ljust(FOOTER_SIZE - 8, b"\x00") + index[-8:]
    return index[:-FOOTER_SIZE] + footer


def test_damaged_index_tables_read_or_raise(source, tmp_path, guarded):
    check, outcomes = guarded
    index, shard = _files(source)
    rng = random.Random(SEED)
    prefix = str(tmp_path / "m")
    for case in range(150):
        damaged = _crafted_footer(rng, index) if case % 5 == 0 else mutate(rng, index)
        _write(prefix, damaged, shard)
        check(case, lambda: read_table(damaged))
        check(case, lambda: _read_everything(prefix))
    assert outcomes["error"] >= 150


# ------------------------------------------------------------------ entries and headers


def _decode_and_check(value: bytes, *, header: bool):
    if header:
        check_header(decode_header(value))
        return
    entry = decode_entry(value)
    check_shape("x", entry)
    check_size("x", entry)
    decode_entry(encode_entry(entry))  # what we decode, we can encode and decode again


def test_damaged_bundle_entries_and_headers_decode_or_raise(source, guarded):
    check, outcomes = guarded
    records = read_table(_files(source)[0])
    rng = random.Random(SEED + 1)
    for case in range(300):
        key, value = records[case % len(records)]
        damaged = mutate(rng, value)
        check(case, lambda: _decode_and_check(damaged, header=key == b""))
        if key[:1] == b"\x00":
            check(case, lambda: decode_slice_key(mutate(rng, key)))
    assert outcomes["error"] >= 100 and outcomes["ok"] >= 50


# ------------------------------------------------------------------ shards and re-encoded records


def _mutate_records(rng, records):
    """Damage one entry proto (or key) and re-encode the table, so block crcs pass and the parsers see it."""
    records = list(records)
    i = rng.randrange(len(records))
    key, value = records[i]
    choice = rng.randrange(6)
    if choice == 0:
        value = mutate(rng, value)
    elif choice == 1 and i > 0:
        field = rng.choice(["offset", "size", "shard_id", "dtype"])
        value = encode_entry(decode_entry(value).replace(**{field: rng.choice([1, 3, 26, 31, 2**31, 2**40, 2**63 - 1])}))
    elif choice == 2 and i > 0:
        shape = tuple(rng.choice([0, 1, 7, 2**20, 2**40]) for _ in range(rng.randint(0, 4)))
        value = encode_entry(decode_entry(value).replace(shape=shape))
    elif choice == 3 and i > 0:
        key = b"\x00" + mutate(rng, key)
    elif choice == 4:
        value = bytes(rng.randrange(256) for _ in range(rng.randint(0, 30)))
    else:
        del records[i]
        return records
    records[i] = (key, value)
    return sorted(dict(records).items())


def test_damaged_shards_and_entries_read_or_raise(source, tmp_path, guarded):
    check, outcomes = guarded
    index, shard = _files(source)
    records = read_table(index)
    rng = random.Random(SEED + 2)
    prefix = str(tmp_path / "m")
    for case in range(200):
        if case % 2:
            _write(prefix, index, mutate(rng, shard))
        else:
            _write(prefix, write_table(_mutate_records(rng, records)), shard)
        check(case, lambda: _read_everything(prefix))
    assert outcomes["error"] >= 80 and outcomes["ok"] >= 10


# ------------------------------------------------------------------ the object graph


@pytest.fixture(scope="module")
def object_graph(tmp_path_factory):
    """The serialized object graph of a tf.train.Checkpoint holding a Keras model and an Adam optimizer."""
    import keras

    # Named explicitly: automatic names would take Keras's global counters from other tests.
    model = keras.Sequential([keras.Input((3,), name="fuzz_in"), keras.layers.Dense(4, name="fuzz_a"),
                              keras.layers.Dense(2, name="fuzz_b")], name="fuzz_model")
    optimizer = keras.optimizers.Adam(name="fuzz_adam")
    optimizer.apply_gradients(zip([tf.ones_like(v) for v in model.trainable_variables], model.trainable_variables))
    prefix = tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path_factory.mktemp("graph") / "ckpt"))
    raw = Checkpoint(prefix).read(OBJECT_GRAPH_KEY).item()
    assert len(decode_object_graph(raw).variables) >= 12
    return raw


def _use_graph(raw: bytes):
    graph = decode_object_graph(raw)
    for variable in graph.variables:
        assert graph.by_key[variable.key] is not None
    return len(graph.by_path)


def test_damaged_object_graphs_decode_or_raise(object_graph, guarded):
    check, outcomes = guarded
    rng = random.Random(SEED + 3)
    for case in range(250):
        damaged = mutate(rng, object_graph)
        if case % 10 == 0:  # an extra node naming a child id far past the end
            child, node, extra = bytearray(), bytearray(), bytearray()
            put_field(child, 1, 0, rng.choice([10**6, 2**31 - 1, 2**63]))
            put_field(node, 1, 2, bytes(child))
            put_field(extra, 1, 2, bytes(node))
            damaged = object_graph + bytes(extra)
        check(case, lambda: _use_graph(damaged))
    assert outcomes["error"] >= 50


def test_the_harness_fails_on_other_exceptions_and_large_allocations(guarded):
    check, outcomes = guarded
    with pytest.raises(pytest.fail.Exception, match="case 0: KeyError"):
        check(0, lambda: {}["missing"])
    with pytest.raises(AssertionError, match="case 1 allocated"):
        check(1, lambda: np.ones(PEAK_LIMIT // 8 + 1))
    check(2, lambda: decode_entry(b"\x08"))
    assert outcomes == {"ok": 1, "error": 1}
