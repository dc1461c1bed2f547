"""reference_cpu.dequant: bit-exact against gguf.quants, hand-computed blocks, strict input checks."""

from __future__ import annotations

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
# byte offsets of the f16 scales inside one block, per type
F16_FIELDS = {Q.Q8_0: (0,), Q.Q2_K: (80, 82), Q.Q4_K: (0, 2), Q.IQ2_XXS: (0,)}
BLOCK_TYPES = (Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal float32 bit patterns, except that any NaN equals any NaN (payloads are not specified)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan]))


def _random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator, edge: bool) -> np.ndarray:
    """Uniformly random block bytes (every byte pattern is a valid block), optionally with edge scales."""
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if edge:
        for at in F16_FIELDS.get(qtype, ()):
            pick = EDGE_F16[rng.integers(0, len(EDGE_F16), n_blocks)]
            blocks[:, at : at + 2] = pick.view(np.uint8).reshape(n_blocks, 2)
        if qtype == Q.MXFP4:
            blocks[:, 0] = np.array([0, 1, 2, 126, 127, 128, 253, 254, 255], np.uint8)[rng.integers(0, 9, n_blocks)]
    return blocks


def _gguf(blocks: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    with np.errstate(all="ignore"):
        return quants.dequantize(blocks.reshape(*shape[:-1], -1), qtype).astype(np.float32, copy=False)


def _ours(blocks: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    with np.errstate(all="ignore"):
        return dq.dequantize(blocks.reshape(-1), qtype, shape)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("edge", [False, True], ids=["random", "edge-scales"])
def test_bit_exact_vs_gguf(qtype: Q, edge: bool) -> None:
    rng = np.random.default_rng(int(qtype) * 7 + edge)
    block, _ = GGML_QUANT_SIZES[qtype]
    n_blocks = 3 * 1024
    shape = (n_blocks * block // 512, 512)
    blocks = _random_blocks(qtype, n_blocks, rng, edge)
    assert _same_bits(_ours(blocks, qtype, shape), _gguf(blocks, qtype, shape))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_bit_exact_across_chunk_boundaries_and_3d_shapes(qtype: Q) -> None:
    """More blocks than one chunk plus a ragged remainder, in an expert-style (E, out, in) shape."""
    rng = np.random.default_rng(100 + int(qtype))
    block, _ = GGML_QUANT_SIZES[qtype]
    per_row = 1024 // block
    rows = dq.CHUNK_VALUES // 1024 + 3
    blocks = _random_blocks(qtype, 2 * rows * per_row, rng, edge=False)
    shape = (2, rows, 1024)
    assert _same_bits(_ours(blocks, qtype, shape), _gguf(blocks, qtype, shape))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_plain_float_types_bit_exact(qtype: Q) -> None:
    rng = np.random.default_rng(5)
    width = {Q.F32: 4, Q.F16: 2, Q.BF16: 2}[qtype]
    raw = rng.integers(0, 256, size=64 * 96 * width, dtype=np.uint8)  # every bit pattern incl. inf/NaN/subnormal
    ours = _ours(raw, qtype, (64, 96))
    assert ours.dtype == np.float32
    assert _same_bits(ours, _gguf(raw, qtype, (64, 96 * width)).reshape(64, 96))


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
        (8, Q.Q5_0, (32,), "no dequantizer for ggml type Q5_0"),
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
