"""Fuzzing the GGUF reader and the metadata contract: hostile counts within a memory bound, structured mutations
of a real synthetic model, every metadata key with every value type. Every failure is a ParityError subclass
naming the file; nothing else escapes, nothing hangs, and loading any GGUF peaks at <= 2 x file size + 16 MiB
(tracemalloc: every Python and numpy allocation; the memory map itself is not an allocation)."""

from __future__ import annotations

import contextlib
import random
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity.contract.errors import GGUFError, MetadataError, ParityError
from parity.gguf.config import config_from_metadata
from parity.gguf.container import SCALAR_FORMAT, VT, GGUFFile, Value
from parity.gguf.inventory import validate
from parity.gguf.synth import metadata, preset_config
from parity.gguf.vocab import synthetic_vocab
from parity.gguf.weights import Weights

MiB = 1 << 20


def _kv(key: str, vt: VT, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", int(vt)) + payload


def _gguf(kvs: list[bytes], n_kv: int | None = None, n_tensors: int = 0, tail: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + tail


def _array(et: VT, count: int, body: bytes) -> bytes:
    return struct.pack("<IQ", int(et), count) + body


def _peak_of(fn) -> int:
    tracemalloc.start()
    with contextlib.suppress(ParityError):
        fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def _tensor_infos(n: int) -> bytes:
    """n F32 tensors of 32 values, packed back to back, then their data."""
    infos = b"".join(struct.pack("<Q", 6) + f"t{i:05d}".encode() + struct.pack("<IQIQ", 1, 32, 0, 128 * i)
                     for i in range(n))
    head = 24 + len(infos)
    return infos + bytes(-head % 32) + bytes(128 * n)


SIZE = 8 * MiB  # hostile files of 8 MiB; the issue measured +486 MiB for a 46 MiB file before the fix


def _hostile() -> dict[str, bytes]:
    n = SIZE // 8
    return {
        # a string array whose count fills the file with 2-byte strings (the old reader made a str object each)
        "string-array-count": _gguf([_kv("a", VT.ARRAY, _array(VT.STRING, SIZE // 10,
                                                                (struct.pack("<Q", 2) + b"ab") * (SIZE // 10)))]),
        # the same, one string short of the file (the error comes after walking every entry)
        "string-array-truncated": _gguf([_kv("a", VT.ARRAY, _array(VT.STRING, n + 1, bytes(8 * n)))]),
        # numeric arrays filling the file: views, no per-entry object
        "u8-array-count": _gguf([_kv("a", VT.ARRAY, _array(VT.U8, SIZE, bytes(SIZE)))]),
        "i32-array-count": _gguf([_kv("a", VT.ARRAY, _array(VT.I32, SIZE // 4, struct.pack("<i", 4096) * (n * 2)))]),
        "bool-array-count": _gguf([_kv("a", VT.ARRAY, _array(VT.BOOL, SIZE, bytes(SIZE)))]),
        # one string as long as the file
        "one-huge-string": _gguf([_kv("a", VT.STRING, struct.pack("<Q", SIZE) + b"x" * SIZE)]),
        # as many metadata entries as the reader accepts, then one more than it accepts
        "many-keys": _gguf([_kv(f"k{i:05d}", VT.U8, b"\0") for i in range(1 << 14)]),
        "too-many-keys": _gguf([_kv(f"k{i:05d}", VT.U8, b"\0") for i in range(1 << 14)], n_kv=(1 << 14) + 1)
        + bytes(SIZE),
        # a tensor count that fits the remaining bytes; as many valid tensors as the reader accepts
        "tensor-count": _gguf([], n_tensors=SIZE // 32, tail=bytes(SIZE)),
        "many-tensors": _gguf([], n_tensors=1 << 14, tail=_tensor_infos(1 << 14)),
    }


@pytest.mark.parametrize("case", sorted(_hostile()))
def test_hostile_counts_fail_cleanly_within_the_memory_bound(tmp_path, case):
    blob = _hostile()[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(blob)
    del blob
    peak = _peak_of(lambda: GGUFFile(path))
    size = path.stat().st_size
    print(f"{case}: peak {peak / MiB:.2f} MiB, file {size / MiB:.2f} MiB, ratio {peak / size:.3f}")
    assert peak <= 2 * size + 16 * MiB, f"{case}: peak {peak / MiB:.1f} MiB for a {size / MiB:.1f} MiB file"


@pytest.mark.parametrize("fixture", ["tiny_f32", "tiny_realmix"])
def test_loading_a_model_stays_within_the_memory_bound(fixture, request):
    path = request.getfixturevalue(fixture)

    def load():
        w = Weights(path)
        validate(w.tensor_infos(), w.config)
        w.identity()

    peak = _peak_of(load)
    size = path.stat().st_size
    print(f"{fixture}: peak {peak / MiB:.2f} MiB, file {size / MiB:.2f} MiB, ratio {peak / size:.3f}")
    assert peak <= 2 * size + 16 * MiB


# ----------------------------------------------------------------------------------------------
# Structured mutations of a real model's header: counts, types, lengths, offsets

def _fields(path) -> list[tuple[int, int, str]]:
    """(offset, width, kind) of every count, type code, length and offset field in the file's header."""
    f = GGUFFile(path)
    buf, out, pos = bytes(f.header_bytes()), [(8, 8, "count"), (16, 8, "count")], 24

    def u(fmt):
        nonlocal pos
        (v,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v

    def skip_string():
        nonlocal pos
        n = u("<Q")
        pos += n

    for _ in range(len(f.kv)):
        out.append((pos, 8, "length"))
        skip_string()
        out.append((pos, 4, "type"))
        vt = VT(u("<I"))
        if vt == VT.STRING:
            out.append((pos, 8, "length"))
            skip_string()
        elif vt == VT.ARRAY:
            out += [(pos, 4, "type"), (pos + 4, 8, "count")]
            et, n = VT(u("<I")), u("<Q")
            for _ in range(n if et == VT.STRING else 0):
                skip_string()
            pos += 0 if et == VT.STRING else n * struct.calcsize(SCALAR_FORMAT[et])
        else:
            pos += struct.calcsize(SCALAR_FORMAT[vt])
    for _ in range(len(f.tensors)):
        out.append((pos, 8, "length"))
        skip_string()
        out.append((pos, 4, "count"))
        nd = u("<I")
        out += [(pos + 8 * i, 8, "count") for i in range(nd)]
        pos += 8 * nd
        out += [(pos, 4, "type"), (pos + 4, 8, "offset")]
        pos += 12
    return out


INTERESTING = [0, 1, 2, 7, 8, 9, 12, 31, 32, 33, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1,
               2**63, 2**64 - 1]
N_STRUCTURED = 600


@pytest.fixture(scope="module")
def tiny_bytes(tiny_realmix):
    return tiny_realmix.read_bytes(), _fields(tiny_realmix)


def test_structured_header_mutations_raise_only_project_errors(tmp_path, tiny_bytes):
    """Each case overwrites 1-3 header fields (counts, type codes, lengths, offsets) with boundary values or
    off-by-small deltas, then loads the file as a model (container, config, inventory, one tensor)."""
    blob, fields = tiny_bytes
    rng = random.Random(16)
    outcomes: dict[str, int] = {}
    for case in range(N_STRUCTURED):
        b = bytearray(blob)
        for _ in range(rng.randint(1, 3)):
            at, width, _ = rng.choice(fields)
            (old,) = struct.unpack_from("<Q" if width == 8 else "<I", b, at)
            new = rng.choice(INTERESTING) if rng.random() < 0.6 else old + rng.choice([-33, -8, -1, 1, 8, 32, 4096])
            struct.pack_into("<Q" if width == 8 else "<I", b, at, new % (1 << (8 * width)))
        path = tmp_path / "m.gguf"
        path.write_bytes(bytes(b))
        try:
            w = Weights(path)
            validate(w.tensor_infos(), w.config)
            w.tensor(next(iter(w.names)))
            outcomes["loaded"] = outcomes.get("loaded", 0) + 1
        except ParityError as e:
            assert str(path) in str(e) or "tensor" in str(e), (case, str(e)[:200])
            assert len(str(e)) < 1000, (case, len(str(e)))
            outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
    assert outcomes.get("GGUFError", 0) > N_STRUCTURED // 4  # the mutations do reach the structure checks
    print(outcomes)


# ----------------------------------------------------------------------------------------------
# Metadata: every key of the contract with a value of every type

BASE_CFG = preset_config("tiny", len(synthetic_vocab().tokens))
BASE_KV = metadata(BASE_CFG, "tiny")
SAMPLES = [Value(VT.U8, 3), Value(VT.I8, -1), Value(VT.U32, 2**32 - 1), Value(VT.I64, -(2**63)),
           Value(VT.U64, 2**64 - 1), Value(VT.F32, float("nan")), Value(VT.F64, float("inf")), Value(VT.F32, -0.0),
           Value(VT.BOOL, True), Value(VT.STRING, ""), Value(VT.STRING, "x" * 5000),
           Value(VT.ARRAY, [], VT.I32), Value(VT.ARRAY, np.arange(10**5, dtype=np.int32), VT.I32),
           Value(VT.ARRAY, [1.0] * 7, VT.F32), Value(VT.ARRAY, ["a", "b"], VT.STRING),
           Value(VT.ARRAY, [True] * 7, VT.BOOL)]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(BASE_KV)), value=st.sampled_from(SAMPLES), drop=st.booleans())
def test_metadata_values_of_any_type_give_a_metadata_error_or_a_config(key, value, drop):
    kv = dict(BASE_KV)
    if drop:
        del kv[key]
    else:
        kv[key] = value
    try:
        config_from_metadata(kv, "fuzz.gguf")
    except MetadataError as e:
        msg = str(e)
        assert msg.startswith("fuzz.gguf: key '") and len(msg) < 400, msg[:500]


def test_unsupported_types_in_the_tensor_table_are_gguf_errors(tmp_path):
    blob = _gguf([], n_tensors=1, tail=struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 32, 31, 0) + bytes(256))
    path = tmp_path / "t.gguf"
    path.write_bytes(blob)
    with pytest.raises(GGUFError, match="unknown ggml type 31|unsupported ggml type"):
        GGUFFile(path)


# ----------------------------------------------------------------------------------------------
# Name and key lengths are capped before decoding (issue 28 item 12)

def _name_length_to_end(kind: str) -> bytes:
    """An 8 MiB file whose first key (or, after one valid key, first tensor name) declares the rest of the file."""
    rest = b"x" * SIZE
    if kind == "key":
        return _gguf([struct.pack("<Q", len(rest)) + rest], n_kv=1)
    return _gguf([_kv("a", VT.U8, b"\0")], n_tensors=1, tail=struct.pack("<Q", len(rest)) + rest)


@pytest.mark.parametrize(("kind", "what", "cap"), [("key", "metadata key #0", 65535),
                                                    ("tensor", "tensor name #0", 63)])
def test_a_name_length_corrupted_to_the_rest_of_the_file_is_refused_before_decoding(tmp_path, kind, what, cap):
    path = tmp_path / f"{kind}.gguf"
    path.write_bytes(_name_length_to_end(kind))
    with pytest.raises(GGUFError, match=rf"{what} at offset \d+ declares {SIZE} bytes, at most {cap} allowed"):
        GGUFFile(path)
    peak = _peak_of(lambda: GGUFFile(path))
    assert peak < MiB, f"{kind}: peak {peak / MiB:.2f} MiB for a {SIZE / MiB:.0f} MiB file (the span was decoded)"


@pytest.mark.parametrize(("kind", "n"), [("key", 65535), ("tensor", 63)])
def test_names_at_the_cap_are_read(tmp_path, kind, n):
    """The caps are the limits themselves: the GGUF spec's 65535-byte key, ggml's 63 bytes + NUL tensor name."""
    name = b"k" * n
    if kind == "key":
        blob = _gguf([struct.pack("<Q", n) + name + struct.pack("<I", int(VT.U8)) + b"\0"])
    else:
        info = struct.pack("<Q", n) + name + struct.pack("<IQIQ", 1, 32, 0, 0)
        blob = _gguf([], n_tensors=1, tail=info + bytes(-(24 + len(info)) % 32) + bytes(128))
    path = tmp_path / f"{kind}.gguf"
    path.write_bytes(blob)
    f = GGUFFile(path)
    assert name.decode() in (f.kv if kind == "key" else f.tensors)
    path.write_bytes(blob.replace(struct.pack("<Q", n) + name, struct.pack("<Q", n + 1) + name + b"k", 1))
    with pytest.raises(GGUFError, match=f"declares {n + 1} bytes, at most {n} allowed"):
        GGUFFile(path)


def test_the_writer_refuses_names_the_reader_would_refuse(tmp_path):
    from parity.gguf.container import TensorData, write_gguf

    t = TensorData("t" * 64, (32,), 0, bytes(128))  # 64 bytes: no room for ggml's NUL in char[64]
    with pytest.raises(GGUFError, match="64 bytes, more than the 63 a reader accepts"):
        write_gguf(tmp_path / "a.gguf", {}, [t])
    with pytest.raises(GGUFError, match="65536 bytes, more than the 65535 a reader accepts"):
        write_gguf(tmp_path / "b.gguf", {"k" * 65536: Value(VT.U8, 1)}, [])
    write_gguf(tmp_path / "c.gguf", {"k" * 65535: Value(VT.U8, 1)}, [TensorData("t" * 63, (32,), 0, bytes(128))])
    f = GGUFFile(tmp_path / "c.gguf")
    assert list(f.tensors) == ["t" * 63] and list(f.kv) == ["k" * 65535]
