"""The torch engine's dequantizers (torch ops, and the compiled CPU kernels it uses on the CPU) vs
`gguf.quants.dequantize` on the same bytes: bit-exact, incl. edge scales."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from test_dequant import CASES, reference, same_bits
from test_dequant import random_blocks as random_bytes

from gpu_engine import cpu_kernels
from gpu_engine.dequant import dequantize
from parity.contract.errors import TensorError
from parity.gguf.quant_blocks import random_blocks

# f16 bit patterns for edge scales: zero, -zero, smallest subnormal, largest subnormal, smallest normal,
# one, large (65504), negatives of those; every block type gets them written into its scale fields.
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xBC00, 0xFBFF, 0x8001, 0x3555],
                    dtype=np.uint16)


def _bits_equal(ours: torch.Tensor, ref: np.ndarray) -> None:
    ours = ours.numpy()
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    ref = ref.astype(np.float32)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


def native(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    """The CPU kernels' dequantizer, shaped like `dequantize`'s result."""
    block, size = GGML_QUANT_SIZES[qtype]
    out = torch.full((raw.numel() // size * block,), float("nan"))
    cpu_kernels.load().dequantize(raw.contiguous(), qtype, out)
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // size * block)


@pytest.fixture(params=["torch", "native"])
def deq(request):
    return {"torch": dequantize, "native": native}[request.param]


def _check(blocks: np.ndarray, qtype: Q, deq) -> None:
    ref = quants.dequantize(blocks, qtype)
    _bits_equal(deq(torch.from_numpy(blocks.copy()), qtype), ref)


def _with_edge_scales(blocks: np.ndarray, offsets: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    blocks = blocks.copy()
    for off in offsets:
        pick = rng.choice(EDGE_F16, size=blocks.shape[0])
        blocks[:, off : off + 2] = pick.view(np.uint8).reshape(-1, 2)
    return blocks


@pytest.mark.parametrize("qtype", tuple(CASES), ids=lambda q: q.name)
@pytest.mark.parametrize("edge", [False, True], ids=["random", "edge-scales"])
def test_every_block_type_bit_exact_vs_gguf(qtype, edge, deq):
    """The declared cases of test_dequant (random bytes; every scale field at 0, subnormal, max finite, inf, NaN)
    through the torch ops and the CPU kernels' C decoders against
    gguf.quants (ggml's d*q for Q8_K); any NaN equals any NaN."""
    rng = np.random.default_rng(int(qtype) * 11 + edge)
    block, _ = GGML_QUANT_SIZES[qtype]
    blocks = random_bytes(qtype, 768, rng, edge)
    rows = 768 * block // 256
    ref = reference(blocks, qtype).reshape(rows, 256)
    with np.errstate(all="ignore"):
        ours = deq(torch.from_numpy(blocks.reshape(rows, -1).copy()), qtype).numpy()
    assert same_bits(ours, ref)


@pytest.mark.parametrize("qtype,offsets", [(Q.Q2_K, (80, 82)), (Q.Q4_K, (0, 2)), (Q.IQ2_XXS, (0,))])
def test_k_and_i_quants_random_and_edge_blocks(qtype, offsets, deq):
    rng = np.random.default_rng(1)
    blocks = random_blocks(qtype, (64, 1024), 0.02, rng).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    _check(blocks, qtype, deq)
    _check(_with_edge_scales(blocks, offsets, rng), qtype, deq)
    # fully random bytes: every code value, every packed scale/min, every sign/grid index, any f16 scale
    size = GGML_QUANT_SIZES[qtype][1]
    noise = rng.integers(0, 256, size=(512, size), dtype=np.uint8)
    for off in offsets:  # keep scales finite (NaN/inf scales are not valid blocks)
        noise[:, off : off + 2] = rng.choice(EDGE_F16, size=512).view(np.uint8).reshape(-1, 2)
    _check(noise, qtype, deq)


def test_q8_0_quantized_and_edge_blocks(deq):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((128, 256)) * np.array([1e-8, 1e-3, 1.0, 3e4])[rng.integers(0, 4, (128, 1))])
    x[0] = 0.0
    blocks = quants.quantize(x.astype(np.float32), Q.Q8_0).reshape(-1, 34)
    _check(blocks, Q.Q8_0, deq)
    codes = rng.integers(0, 256, size=(256, 34), dtype=np.uint8)
    codes[:, 2:] = np.arange(256, dtype=np.uint8).reshape(8, 32).repeat(32, axis=0)  # every int8 code
    codes[:, :2] = rng.choice(EDGE_F16, size=256).view(np.uint8).reshape(-1, 2)
    _check(codes, Q.Q8_0, deq)


def test_mxfp4_quantized_and_every_exponent_and_code(deq):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 256)).astype(np.float32) * 0.05
    _check(quants.quantize(x, Q.MXFP4).reshape(-1, 17), Q.MXFP4, deq)
    blocks = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256, dtype=np.uint8)                  # every e8m0 exponent incl. 0, 1, 254, 255
    blocks[:16, 1:] = (np.arange(16, dtype=np.uint8) * 17)[:, None]  # every 4-bit code in both nibbles
    with np.errstate(over="ignore"):  # e = 255 times code 12 overflows to inf in both implementations
        _check(blocks, Q.MXFP4, deq)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.F32])
def test_float_types(qtype, deq):
    rng = np.random.default_rng(4)
    x = rng.standard_normal(4096).astype(np.float32) * 100
    x[:4] = [0.0, -0.0, 1e-40, -65504.0]
    if qtype == Q.F16:
        raw = x.astype(np.float16).view(np.uint8)
        ref = raw.view(np.float16).astype(np.float32)
    elif qtype == Q.BF16:
        raw = quants.quantize(x, Q.BF16)
        ref = quants.dequantize(raw, Q.BF16)
    else:
        raw = x.view(np.uint8)
        ref = x
    _bits_equal(deq(torch.from_numpy(raw.reshape(8, -1).copy()), qtype), ref.reshape(8, -1))


def test_leading_shape_is_kept_and_bad_sizes_are_errors():
    rng = np.random.default_rng(5)
    blocks = random_blocks(Q.Q4_K, (2, 3, 512), 0.1, rng)
    out = dequantize(torch.from_numpy(blocks), Q.Q4_K)
    assert tuple(out.shape) == (2, 3, 512)
    with pytest.raises(TensorError, match="not a multiple"):
        dequantize(torch.zeros(1, 143, dtype=torch.uint8), Q.Q4_K)
    with pytest.raises(TensorError, match="Q8_1 has no torch dequantizer"):
        dequantize(torch.zeros(1, 36, dtype=torch.uint8), Q.Q8_1)


@pytest.mark.parametrize("qtype", tuple(CASES), ids=lambda q: q.name)
def test_chunked_into_reused_buffer_is_bit_exact(qtype, monkeypatch):
    """Several pieces plus a partial last one (CHUNK_VALUES lowered), written into one reused output buffer."""
    import gpu_engine.dequant as dq

    monkeypatch.setattr(dq, "CHUNK_VALUES", 3 * 256)
    rng = np.random.default_rng(6)
    blocks = [random_bytes(qtype, 7 * 256 // GGML_QUANT_SIZES[qtype][0], rng, edge=False) for _ in range(2)]
    buf = torch.full((7 * 256,), float("nan"))
    for b in blocks:  # the second call overwrites every value the first one wrote
        with np.errstate(all="ignore"):
            got = dequantize(torch.from_numpy(b.reshape(7, -1).copy()), qtype, out=buf)
        assert got.data_ptr() == buf.data_ptr()
        assert same_bits(got.numpy(), reference(b, qtype).reshape(7, 256))
    with pytest.raises(TensorError, match="output buffer"):
        dequantize(torch.from_numpy(blocks[0].reshape(7, -1).copy()), qtype, out=torch.empty(7 * 256 - 1))


def test_all_finite_is_exact_also_when_the_sum_overflows():
    from gpu_engine.weights import all_finite

    big = torch.full((4,), 3e38)  # finite values whose float32 sum overflows
    assert all_finite(big) and all_finite(torch.zeros(0))
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = big.clone()
        x[2] = bad
        assert not all_finite(x)
        assert not all_finite(torch.tensor([1.0, bad, -1.0]))
