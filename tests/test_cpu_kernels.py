"""The torch engine's compiled CPU kernels: one declared case per ggml type, its C decoder bit-exact with gguf.quants
on random and extreme-scale blocks (test_dequant's generators) and its `matvec` against an independent float64
product; row ranges, the engine's use of the kernels for every type, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from test_dequant import CASES as BLOCK_CASES
from test_dequant import random_blocks, reference, same_bits

from gpu_engine import cpu_kernels
from gpu_engine.dequant import DEQUANT
from parity.contract.engine import RunOptions
from parity.contract.errors import ParityError, TensorError
from parity.tracing.runner import run_sequence

U32 = np.finfo(np.float32).eps / 2  # unit roundoff of float32
FLOATS = (Q.F32, Q.F16, Q.BF16)

# one declared case per type: the row length of its matvec matrix (F32 / F16 / BF16 lengths that are not multiples of
# 32 exercise the dot product's tail; 32-value types get rows of 3 or 5 blocks)
CASES = {Q.F32: 40, Q.F16: 72, Q.BF16: 33, Q.Q4_0: 96, Q.Q4_1: 160, Q.Q5_0: 96, Q.Q5_1: 160, Q.Q8_0: 96,
         Q.Q2_K: 512, Q.Q3_K: 256, Q.Q4_K: 256, Q.Q5_K: 512, Q.Q6_K: 256, Q.Q8_K: 256, Q.IQ1_S: 256, Q.IQ1_M: 512,
         Q.IQ2_XXS: 768, Q.IQ2_XS: 256, Q.IQ2_S: 512, Q.IQ3_XXS: 256, Q.IQ3_S: 512, Q.IQ4_NL: 160, Q.IQ4_XS: 256,
         Q.TQ1_0: 256, Q.TQ2_0: 512, Q.MXFP4: 64}


def _values(blocks: np.ndarray, qtype: Q) -> np.ndarray:
    """gguf.quants' values of raw blocks (ggml's d*q for Q8_K).  [n, size] uint8 -> [n, block] float32"""
    if qtype in FLOATS:
        return quants.dequantize(blocks, qtype).astype(np.float32).reshape(len(blocks), -1)
    return reference(blocks, qtype)


def _raw(qtype: Q, n: int, rng: np.random.Generator, edge: bool) -> np.ndarray:
    """n random blocks [n, size] (test_dequant's generator; edge: every scale field at an extreme value); the plain
    float types are random bytes (every bit pattern, incl. inf, NaN and subnormals, is already in the draw)."""
    if qtype in FLOATS:
        return rng.integers(0, 256, size=(n, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    return random_blocks(qtype, n, rng, edge)


def matrix(qtype: Q, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks [rows, row_bytes] of a random matrix of the type: random blocks, each block redrawn until all its
    values are 0 or within 1e-20 <= |w| <= 1e6 (float32 products with N(0, 1) activations then neither overflow
    nor underflow, so the summation bound applies)."""
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = _raw(qtype, rows * k // block, rng, edge=False)
    while True:
        with np.errstate(all="ignore"):
            w = np.abs(_values(blocks, qtype))
        bad = ~((w == 0) | ((w >= 1e-20) & (w <= 1e6))).all(axis=1)
        if not bad.any():
            return blocks.reshape(rows, k // block * size)
        blocks[bad] = _raw(qtype, int(bad.sum()), rng, edge=False)


def test_every_type_has_a_case_and_a_c_decoder():
    """The declared cases cover exactly the C decoders' types, and those are every type the torch dequantizers know
    (no type is left to a slower path); every block size is ggml's."""
    assert set(CASES) == set(cpu_kernels.TYPES) == set(DEQUANT)
    assert set(CASES) - set(FLOATS) == set(BLOCK_CASES)
    assert all(k % GGML_QUANT_SIZES[t][0] == 0 for t, k in CASES.items())


@pytest.mark.parametrize(("qtype", "edge"), [(t, e) for t in CASES for e in (False, True) if not (e and t in FLOATS)],
                         ids=lambda v: v.name if isinstance(v, Q) else ("edge-scales" if v else "random"))
def test_c_decoder_is_bit_exact_with_gguf(qtype, edge):
    """`Kernels.dequantize` (the type's C decoder) on random blocks, and on blocks whose every scale field holds an
    extreme value (+-0, subnormals, +- the largest finite, +-inf, NaN), against gguf.quants (ggml's d*q for Q8_K);
    any NaN equals any NaN (a plain float type has no scale field: its random bytes already hold inf, NaN and
    subnormals). The blocks start at an odd address (a file mapping's tensor need not be aligned to its fields)."""
    rng = np.random.default_rng(int(qtype) * 13 + edge)
    n = 1024 * 32 // GGML_QUANT_SIZES[qtype][0]  # 32 K values
    blocks = _raw(qtype, n, rng, edge)
    buf = torch.zeros(blocks.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(blocks.reshape(-1))
    out = torch.full((n * GGML_QUANT_SIZES[qtype][0],), float("nan"))
    cpu_kernels.load().dequantize(buf[1:], qtype, out)
    with np.errstate(all="ignore"):
        assert same_bits(out.numpy(), _values(blocks, qtype).reshape(-1))


@pytest.mark.parametrize("qtype", list(CASES), ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3, 16])
def test_matvec_is_the_product_with_the_exactly_dequantized_matrix(qtype, n):
    """y = x Wᵀ with W = gguf.quants' values (float64 product as the truth): the error is within the classic
    float32 summation bound k·u·Σ|w x| for every element, and every row range gives the same bits."""
    kern = cpu_kernels.load()
    k = CASES[qtype]
    rng = np.random.default_rng(int(qtype) * 100 + n)
    raw = matrix(qtype, 37, k, rng)
    w = _values(raw.reshape(37 * k // GGML_QUANT_SIZES[qtype][0], -1), qtype).astype(np.float64).reshape(37, k)
    x = rng.standard_normal((n, k)).astype(np.float32)
    y = torch.full((n, 37), float("nan"))
    kern.matvec(torch.from_numpy(raw), qtype, torch.from_numpy(x), y, 0, 37)
    exact = x.astype(np.float64) @ w.T
    bound = k * U32 * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    assert (np.abs(y.numpy() - exact) <= bound).all()
    assert np.abs(y.numpy() - exact).max() > 0  # a float32 sum, not a float64 one: the check above is not vacuous
    parts = torch.full((n, 37), float("nan"))
    for r0, r1 in ((0, 5), (5, 6), (6, 37)):
        kern.matvec(torch.from_numpy(raw), qtype, torch.from_numpy(x), parts, r0, r1)
    np.testing.assert_array_equal(parts.numpy().view(np.uint32), y.numpy().view(np.uint32))


def test_matvec_writes_only_its_rows_and_refuses_unknown_types():
    kern = cpu_kernels.load()
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(matrix(Q.Q8_0, 8, 64, rng))
    x = torch.from_numpy(rng.standard_normal((2, 64)).astype(np.float32))
    y = torch.full((2, 8), float("nan"))
    kern.matvec(raw, Q.Q8_0, x, y, 2, 5)
    assert torch.isnan(y[:, [0, 1, 5, 6, 7]]).all() and torch.isfinite(y[:, 2:5]).all()
    with pytest.raises(TensorError, match="Q8_1 has no CPU kernel"):
        kern.matvec(torch.zeros(8, 72, dtype=torch.uint8), Q.Q8_1, x, y, 0, 8)
    with pytest.raises(TensorError, match="Q8_1 has no CPU kernel"):
        kern.dequantize(raw, Q.Q8_1, torch.empty(8 * 64))


def test_the_engine_gives_every_type_the_kernels_and_refuses_an_unknown_one():
    """A Q5_0 tensor (a type of llama.cpp's quantizer mixes): the engine's QTensor takes the kernels and multiplies
    few rows with `matvec`, its dense decode is gguf's bits; a type no dequantizer knows is refused at load, naming
    the file, the tensor and the type."""
    from gpu_engine.weights import QTensor

    kern = cpu_kernels.load()
    rng = np.random.default_rng(7)
    raw = quants.quantize(rng.standard_normal((8, 128)).astype(np.float32), Q.Q5_0)
    want = quants.dequantize(raw, Q.Q5_0)
    t = QTensor("blk.0.ffn_down_shexp.weight", raw, Q.Q5_0, (8, 128), torch.device("cpu"), "m.gguf", kern)
    x = torch.from_numpy(rng.standard_normal((2, 128)).astype(np.float32))
    assert t.kernels is kern and t.uses_matvec(x)
    np.testing.assert_array_equal(t.dense(torch.float32).numpy().view(np.uint32), want.view(np.uint32))
    with pytest.raises(TensorError, match="m.gguf: tensor blk.0.x.weight: ggml type Q8_1 has no dequantizer"):
        QTensor("blk.0.x.weight", np.zeros((8, 144), np.uint8), Q.Q8_1, (8, 128), torch.device("cpu"), "m.gguf", kern)


def test_shapes_dtypes_and_layouts_are_checked_before_the_c_code_runs():
    kern = cpu_kernels.load()
    rng = np.random.default_rng(1)
    raw = torch.from_numpy(matrix(Q.Q8_0, 8, 64, rng))
    x = torch.from_numpy(rng.standard_normal((2, 64)).astype(np.float32))
    y = torch.empty(2, 8)
    with pytest.raises(TensorError, match=r"Q8_0 matvec: W \(8, 68\) bytes, x \(2, 32\)"):
        kern.matvec(raw, Q.Q8_0, x[:, :32].contiguous(), y, 0, 8)
    with pytest.raises(TensorError, match=r"rows \[0, 9\) do not fit"):
        kern.matvec(raw, Q.Q8_0, x, y, 0, 9)
    with pytest.raises(TensorError, match="x must be a contiguous torch.float32 CPU tensor"):
        kern.matvec(raw, Q.Q8_0, torch.cat([x, x], dim=1)[:, ::2], y, 0, 8)
    with pytest.raises(TensorError, match="y must be a contiguous torch.float32"):
        kern.matvec(raw, Q.Q8_0, x, y.double(), 0, 8)
    with pytest.raises(TensorError, match="544 bytes do not hold the 500 output values"):
        kern.dequantize(raw, Q.Q8_0, torch.empty(500))


def test_a_missing_or_failing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler-v4p")
    with pytest.raises(ParityError, match="need a C compiler and 'no-such-compiler-v4p' is not on PATH"):
        cpu_kernels._compiler()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(ParityError, match=r"compiling cpu_kernels.c with /bin/false failed \(exit 1\)"):
        cpu_kernels._build("/bin/false")
    assert not list(tmp_path.rglob("*.so"))


def test_a_build_is_cached_by_source_and_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = cpu_kernels._build(cpu_kernels._compiler())
    assert first.parent == tmp_path / "v4parity" and first.stat().st_mode & 0o777 == 0o644
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels._build(cpu_kernels._compiler()) == first and first.stat().st_mtime_ns == mtime


def test_native_and_torch_ops_paths_agree_within_the_parity_tolerance(tiny_realmix):
    """The same run with the kernels (row-at-a-time matvec: a different float32 summation order) and with torch ops
    only: every position's logits within rel L2 2e-6 of each other (float32 summation order only; the parity
    tolerance to the reference is 1e-5), the same routing and tokens; the engine names the path in its version."""
    from gpu_engine.engine import TorchEngine

    prompt = np.random.default_rng(3).integers(2, 290, 40)
    engines = [TorchEngine(str(tiny_realmix), RunOptions(engine_args=(f"cpu_kernels={k}",)))
               for k in ("native", "torch")]
    assert "native CPU kernels" in engines[0].version and "native" not in engines[1].version
    native, ops = (run_sequence(e, prompt, decode_steps=6, capture=True) for e in engines)
    for a, b in zip(native, ops, strict=True):
        rel = np.linalg.norm(a.logits - b.logits, axis=-1) / np.linalg.norm(b.logits, axis=-1)
        assert rel.max() <= 2e-6  # measured: at most 8.8e-7 (prefill and 6 decode steps)
        for ca, cb in zip(a.captures, b.captures, strict=True):
            np.testing.assert_array_equal(ca["expert_ids"], cb["expert_ids"])
    assert [r.tokens.tolist() for r in native] == [r.tokens.tolist() for r in ops]


def test_engine_argument_is_validated(tiny_f32):
    from gpu_engine.engine import TorchEngine

    with pytest.raises(ParityError, match=r"unknown engine argument 'cpu_kernels=fast'"):
        TorchEngine(str(tiny_f32), RunOptions(engine_args=("cpu_kernels=fast",)))


def test_trace_passes_engine_args_and_records_them(tiny_realmix, tmp_path):
    """`v4parity trace --engine-arg cpu_kernels=torch`: the header records it (and the engine's version says which
    path ran); an argument the engine does not take is refused, naming it (the console script turns it into exit 2)."""
    from click.testing import CliRunner

    from parity.cli import cli
    from parity.tracing.io import read_trace

    base = ["trace", "--engine", "torch", "-m", str(tiny_realmix), "--tokens", "0,5,7", "--decode", "1"]
    r = CliRunner().invoke(cli, [*base, "--engine-arg", "cpu_kernels=torch", "-o", str(tmp_path / "t.trace")])
    assert r.exit_code == 0, r.output
    header = read_trace(tmp_path / "t.trace").header
    assert header.flags["engine_args"] == ["cpu_kernels=torch"] and "native" not in header.engine_version
    r = CliRunner().invoke(cli, [*base, "--engine-arg", "lcp_threads=3", "-o", str(tmp_path / "u.trace")])
    assert isinstance(r.exception, ParityError) and "unknown engine argument 'lcp_threads=3'" in str(r.exception)


def test_a_cpu_whose_features_cannot_be_read_gets_an_uncached_build(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: None)
    lib = cpu_kernels._build(cpu_kernels._compiler())
    assert lib.exists() and tmp_path not in lib.parents and not list(tmp_path.rglob("*.so"))
