"""reference_cpu.dequant: bit-exact against gguf.quants, hand-computed blocks, strict input checks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

from parity.contract.errors import TensorError
from reference_cpu import dequant as dq

# f16 bit patterns of the edge scales: 0, -0, smallest subnormal, largest subnormal, smallest normal,
# 1, -1.5, largest finite, -largest finite, +inf, -inf, quiet NaN
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0xBE00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00],
                    dtype=np.uint16)
# f32 edge scales (Q8_K's d): 0, -0, smallest subnormal, smallest normal, 1, largest finite, +inf, -inf, NaN
EDGE_F32 = np.array([0x00000000, 0x80000000, 0x00000001, 0x00800000, 0x3F800000, 0x7F7FFFFF, 0x7F800000, 0xFF800000,
                     0x7FC00000], dtype=np.uint32)
# E8M0 exponents (MXFP4): 2^-128 (subnormal half), 2^-127, 2^-126, around 1, 2^125, 2^126, 255
EDGE_E8M0 = np.array([0, 1, 2, 126, 127, 128, 253, 254, 255], dtype=np.uint8)


@dataclass(frozen=True)
class Case:
    """How to find a block type's scale fields: byte offsets of its f16 scales (`f16`), of an f32 scale (`f32`), of an
    E8M0 exponent byte (`e8m0`), and IQ1_M's f16 split over the top nibbles of four 16-bit words (`f16_nibbles`)."""

    f16: tuple[int, ...] = ()
    f32: tuple[int, ...] = ()
    e8m0: tuple[int, ...] = ()
    f16_nibbles: int | None = None


# every block type, with the byte offsets of its scale fields inside one block
CASES = {
    Q.Q4_0: Case(f16=(0,)), Q.Q4_1: Case(f16=(0, 2)), Q.Q5_0: Case(f16=(0,)), Q.Q5_1: Case(f16=(0, 2)),
    Q.Q8_0: Case(f16=(0,)), Q.Q2_K: Case(f16=(80, 82)), Q.Q3_K: Case(f16=(108,)), Q.Q4_K: Case(f16=(0, 2)),
    Q.Q5_K: Case(f16=(0, 2)), Q.Q6_K: Case(f16=(208,)), Q.Q8_K: Case(f32=(0,)), Q.IQ1_S: Case(f16=(0,)),
    Q.IQ1_M: Case(f16_nibbles=48), Q.IQ2_XXS: Case(f16=(0,)), Q.IQ2_XS: Case(f16=(0,)), Q.IQ2_S: Case(f16=(0,)),
    Q.IQ3_XXS: Case(f16=(0,)), Q.IQ3_S: Case(f16=(0,)), Q.IQ4_NL: Case(f16=(0,)), Q.IQ4_XS: Case(f16=(0,)),
    Q.TQ1_0: Case(f16=(52,)), Q.TQ2_0: Case(f16=(64,)), Q.MXFP4: Case(e8m0=(0,)),
}
BLOCK_TYPES = tuple(CASES)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal float32 bit patterns, except that any NaN equals any NaN (payloads are not specified)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan]))


def _pick(values: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    return values[rng.integers(0, len(values), n)]


def random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator, edge: bool) -> np.ndarray:
    """Uniformly random block bytes (every byte pattern is a valid block of these types), optionally with every
    scale field of each block set to an edge value (0, subnormals, max finite, inf, NaN).  -> [n_blocks, size] uint8"""
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if not edge:
        return blocks
    case = CASES[qtype]
    for at in case.f16:
        blocks[:, at : at + 2] = _pick(EDGE_F16, n_blocks, rng).view(np.uint8).reshape(n_blocks, 2)
    for at in case.f32:
        blocks[:, at : at + 4] = _pick(EDGE_F32, n_blocks, rng).view(np.uint8).reshape(n_blocks, 4)
    for at in case.e8m0:
        blocks[:, at] = _pick(EDGE_E8M0, n_blocks, rng)
    if case.f16_nibbles is not None:  # nibble k of the f16 is the top nibble of 16-bit word k
        at = case.f16_nibbles
        words = blocks[:, at : at + 8].copy().view("<u2")
        bits = _pick(EDGE_F16, n_blocks, rng)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        blocks[:, at : at + 8] = words.view(np.uint8)
    return blocks


def reference(blocks: np.ndarray, qtype: Q) -> np.ndarray:
    """The independent second implementation: gguf.quants.dequantize; for Q8_K (which gguf-py cannot dequantize)
    ggml's `dequantize_row_q8_K`, x = d·q with the f32 d, written out here.  [n, size] uint8 -> [n, block] float32"""
    with np.errstate(all="ignore"):
        if qtype == Q.Q8_K:
            return blocks[:, 4:260].view(np.int8).astype(np.float32) * blocks[:, :4].copy().view("<f4")
        return quants.dequantize(blocks, qtype).astype(np.float32, copy=False)


def _ours(blocks: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    with np.errstate(all="ignore"):
        return dq.dequantize(blocks.reshape(-1), qtype, shape)


def test_every_block_type_has_a_case() -> None:
    """The declared cases cover exactly the types the dequantizer handles (floats are tested separately)."""
    assert set(dq.KERNELS) - {Q.F32, Q.F16, Q.BF16} == set(CASES)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("edge", [False, True], ids=["random", "edge-scales"])
def test_bit_exact_vs_gguf(qtype: Q, edge: bool) -> None:
    rng = np.random.default_rng(int(qtype) * 7 + edge)
    block, _ = GGML_QUANT_SIZES[qtype]
    n_blocks = 3 * 1024
    shape = (n_blocks * block // 512, 512)
    blocks = random_blocks(qtype, n_blocks, rng, edge)
    assert same_bits(_ours(blocks, qtype, shape), reference(blocks, qtype).reshape(shape))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_bit_exact_across_chunk_boundaries_and_3d_shapes(qtype: Q) -> None:
    """More blocks than one chunk plus a ragged remainder, in an expert-style (E, out, in) shape."""
    rng = np.random.default_rng(100 + int(qtype))
    block, _ = GGML_QUANT_SIZES[qtype]
    per_row = 1024 // block
    rows = dq.CHUNK_VALUES // 1024 + 3
    blocks = random_blocks(qtype, 2 * rows * per_row, rng, edge=False)
    shape = (2, rows, 1024)
    assert same_bits(_ours(blocks, qtype, shape), reference(blocks, qtype).reshape(shape))


def test_reference_for_q8_k_is_d_times_q() -> None:
    """The Q8_K reference of these tests on a hand block: d = 0.5 (f32), q = -128 .. 127."""
    q = np.arange(-128, 128, dtype=np.int8)
    block = np.concatenate([np.array([0.5], "<f4").view(np.uint8), q.view(np.uint8), np.zeros(32, np.uint8)])
    assert np.array_equal(reference(block.reshape(1, -1), Q.Q8_K)[0], q.astype(np.float32) * 0.5)
    assert np.array_equal(dq.dequantize(block, Q.Q8_K, (256,)), q.astype(np.float32) * 0.5)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_plain_float_types_bit_exact(qtype: Q) -> None:
    rng = np.random.default_rng(5)
    width = {Q.F32: 4, Q.F16: 2, Q.BF16: 2}[qtype]
    raw = rng.integers(0, 256, size=64 * 96 * width, dtype=np.uint8)  # every bit pattern incl. inf/NaN/subnormal
    ours = _ours(raw, qtype, (64, 96))
    assert ours.dtype == np.float32
    assert same_bits(ours, quants.dequantize(raw.reshape(64, -1), qtype).astype(np.float32))


def test_i32_passthrough() -> None:
    vals = np.array([[0, -1, 2**31 - 1], [-(2**31), 7, 42]], dtype="<i4")
    out = dq.dequantize(vals.view(np.uint8).reshape(-1), Q.I32, (2, 3))
    assert out.dtype == np.int32
    assert np.array_equal(out, vals)


def _f16_bytes(x: float) -> list[int]:
    return list(np.array([x], dtype="<f2").view(np.uint8))


def test_q8_0_hand_block() -> None:
    q = np.arange(-16, 16, dtype=np.int8)
    block = np.array(_f16_bytes(0.5) + list(q.view(np.uint8)), dtype=np.uint8)
    assert np.array_equal(dq.dequantize(block, Q.Q8_0, (32,)), q.astype(np.float32) * 0.5)


def test_q2_k_hand_block() -> None:
    """Sub-block j: scale nibble = j % 4 + 1, min nibble = 1; all codes 2 (bytes 0b10101010); d = 2, dmin = 0.25."""
    scales = [(j % 4 + 1) | (1 << 4) for j in range(16)]
    block = np.array(scales + [0b10101010] * 64 + _f16_bytes(2.0) + _f16_bytes(0.25), dtype=np.uint8)
    want = np.repeat([2.0 * (j % 4 + 1) * 2 - 0.25 for j in range(16)], 16).astype(np.float32)
    assert np.array_equal(dq.dequantize(block, Q.Q2_K, (256,)), want)


def test_q2_k_code_positions() -> None:
    """Code at bit pair s of byte b in half h lands at h*128 + s*32 + b (d = 1, every scale 1, no mins)."""
    qs = np.zeros(64, dtype=np.uint8)
    qs[5] = 3 << 4            # half 0, shift 2 (bits 4-5), byte 5 -> element 2*32 + 5 = 69
    qs[32 + 20] = 1 << 6      # half 1, shift 3, byte 20 -> element 128 + 96 + 20 = 244
    block = np.concatenate([np.full(16, 1, np.uint8), qs, _f16_bytes(1.0), _f16_bytes(0.0)]).astype(np.uint8)
    want = np.zeros(256, np.float32)
    want[69], want[244] = 3.0, 1.0
    assert np.array_equal(dq.dequantize(block, Q.Q2_K, (256,)), want)


def test_q4_k_hand_block() -> None:
    """All 6-bit scales 3 and mins 1 (packed by hand); codes: low nibble 5, high nibble 9; d = 1, dmin = 2."""
    packed = [3] * 4 + [1] * 4 + [3 | (1 << 4)] * 4
    block = np.array(_f16_bytes(1.0) + _f16_bytes(2.0) + packed + [5 | (9 << 4)] * 128, dtype=np.uint8)
    group = np.concatenate([np.full(32, 3 * 5 - 2), np.full(32, 3 * 9 - 2)])
    assert np.array_equal(dq.dequantize(block, Q.Q4_K, (256,)), np.tile(group, 4).astype(np.float32))


def test_iq2_xxs_hand_block() -> None:
    """Grid row 0 is eight 8s; d = 1 and group scale 0 give 8 * 0.5 * 0.25 = 1; sign index 1 (0x81) negates
    elements 0 and 7 of the first 8-value chunk; group scale 3 gives 8 * 3.5 * 0.25 = 7."""
    words = np.zeros(16, dtype="<u4")
    words[1] = 1                    # group 0: sign indices (1, 0, 0, 0), scale 0
    words[3] = 3 << 28              # group 1: no signs, scale 3
    block = np.concatenate([np.array(_f16_bytes(1.0), np.uint8), words.view(np.uint8)])
    out = dq.dequantize(block, Q.IQ2_XXS, (256,))
    want = np.ones(256, np.float32)
    want[[0, 7]] = -1.0
    want[32:64] = 7.0
    want[64:] = 1.0
    assert np.array_equal(out, want)


def test_mxfp4_hand_block() -> None:
    """e = 128 -> scale 2^(128-128) * 0.5 * 2 = 1 on doubled E2M1 values; low nibbles 0..15 fill the first half."""
    qs = np.arange(16, dtype=np.uint8) | (np.uint8(7) << 4)      # high nibble 7 = +6.0 doubled -> 12
    block = np.concatenate([[128], qs]).astype(np.uint8)
    doubled = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
    want = np.array(doubled + [12] * 16, np.float32)
    out = dq.dequantize(block, Q.MXFP4, (32,))
    assert np.array_equal(out, want)


def test_tables_match_ggml_facts() -> None:
    """Facts of the ggml tables: grid row 0 is eight 8s, grid values are {8, 25, 43}, ksigns have even parity."""
    grid = dq.IQ2_SIGNED_GRID.reshape(256, 128, 8)
    assert np.array_equal(grid[0, 0], np.full(8, 8.0, np.float32))
    assert set(np.unique(np.abs(grid)).tolist()) == {8.0, 25.0, 43.0}
    negatives = (grid[:, :, :] < 0).sum(axis=2)
    assert np.all(negatives % 2 == 0)
    assert dq.E8M0_HALF[128] == 1.0 and dq.E8M0_HALF[127] == 0.5


@pytest.mark.parametrize(
    ("raw_len", "qtype", "shape", "match"),
    [
        (33, Q.Q8_0, (32,), "needs 34 bytes"),
        (34, Q.Q8_0, (16,), "not a multiple of the block size"),
        (84, Q.Q2_K, (2, 128), "not a multiple of the block size"),
        (36, Q.Q8_1, (32,), "no dequantizer for ggml type Q8_1"),
        (8, 99, (2,), "unknown ggml type 99"),
        (11, Q.I32, (3,), "needs 12 bytes"),
    ],
)
def test_bad_input_is_a_tensor_error(raw_len: int, qtype: int, shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(TensorError, match=match):
        dq.dequantize(np.zeros(raw_len, np.uint8), qtype, shape)


def test_non_uint8_raw_is_rejected() -> None:
    with pytest.raises(TensorError, match="uint8"):
        dq.dequantize(np.zeros(17, np.int16), Q.MXFP4, (32,))
