"""`synth --preset flash`: the full-depth V4-Flash shape (checked against the spec's numbers, written here from
spec v4-residual-ffn-gguf §1/§3/§4 and v4-attention, not from the writer), and the streaming writer on a scaled-down
variant (same code path, smaller dimensions): valid, deterministic, bounded memory, release types, padded vocabulary."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import quants
from gguf.constants import GGMLQuantizationType as Q

from parity.cli import cli
from parity.gguf import synth_flash
from parity.gguf.container import GGUFFile, tensor_nbytes
from parity.gguf.inventory import expected_tensors
from parity.gguf.report import inspect_model

# spec v4-residual-ffn-gguf §1 / §3.1 (V4-Flash): the numbers a flash file must carry
SPEC = {"dim": 4096, "n_layers": 43, "vocab_size": 129280, "n_heads": 64, "head_dim": 512, "rope_head_dim": 64,
        "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "index_n_heads": 64,
        "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "n_activated_experts": 6,
        "moe_inter_dim": 2048, "n_shared_experts": 1, "n_hash_layers": 3, "route_scale": 1.5, "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0, "rope_factor": 16.0, "original_seq_len": 65536, "beta_fast": 32.0,
        "beta_slow": 1.0, "score_func": "sqrtsoftplus"}
# a scaled-down variant for writing in a test: every dimension a valid deepseek4 shape, k-quant rows of 256
SMALL = {"n_layers": 5, "vocab_size": 1000, "dim": 256, "n_heads": 4, "head_dim": 192, "q_lora_rank": 256,
         "o_groups": 2, "o_lora_rank": 256, "index_n_heads": 4, "index_topk": 8, "window_size": 8, "moe_inter_dim": 256}


def test_flash_config_is_the_spec_shape() -> None:
    cfg = synth_flash.flash_config()
    for key, want in SPEC.items():
        assert getattr(cfg, key) == want, key
    assert cfg.n_routed_experts == 16  # the one knob's default
    # spec §4.3: ratio 0 for layers 0-1, 4 for the 21 even layers 2..42, 128 for the 20 odd layers 3..41
    r = cfg.compress_ratios
    assert r[:2] == (0, 0) and [i for i in range(43) if r[i] == 4] == list(range(2, 43, 2))
    assert [i for i in range(43) if r[i] == 128] == list(range(3, 42, 2))
    assert cfg.swiglu_limit == (10.0,) * 43 and cfg.yarn
    assert synth_flash.flash_config(40).n_routed_experts == 40


def test_flash_tensor_bytes_and_total() -> None:
    specs = {s.name: s for s in expected_tensors(synth_flash.flash_config()) if s.required}
    # spec §4: token_embd [4096, 129280] F16, output [4096, 129280] Q8_0 (34 B per 32), 3 hash layers' tid2eid [6, V]
    assert specs["token_embd.weight"].ne == (4096, 129280)
    assert specs["output.weight"].ne == (4096, 129280)
    assert [f"blk.{i}.ffn_gate_tid2eid.weight" in specs for i in range(4)] == [True, True, True, False]
    assert specs["blk.42.ffn_gate_exps.weight"].ne == (4096, 2048, 16)
    assert "blk.43.attn_norm.weight" not in specs and "blk.42.attn_norm.weight" in specs
    # release types (spec §4 table): F16 embedding, Q8_0 head/attention/shared, IQ2_XXS gate/up, Q2_K down
    types = {s.name: synth_flash.REAL_RELEASE_TYPES[s.klass] for s in specs.values()}
    assert types["token_embd.weight"] == Q.F16 and types["output.weight"] == Q.Q8_0
    assert types["blk.7.ffn_up_exps.weight"] == Q.IQ2_XXS and types["blk.7.ffn_down_exps.weight"] == Q.Q2_K
    assert types["blk.7.attn_q_b.weight"] == Q.Q8_0 and types["blk.7.ffn_up_shexp.weight"] == Q.Q8_0
    embd = 4096 * 129280 * 2
    head = 4096 * 129280 // 32 * 34
    experts_per_layer = 16 * 2048 * 4096 // 256 * (66 + 66 + 84)
    assert tensor_nbytes((4096, 2048, 16), Q.IQ2_XXS) == 16 * 2048 * 4096 // 256 * 66
    total = sum(tensor_nbytes(s.ne, types[n]) for n, s in specs.items())
    rest = total - embd - head - 43 * experts_per_layer
    assert 12e9 < total < 15e9, total                   # 13.6 GB with 16 experts (4.9 GB of them experts)
    assert 43 * 150e6 < rest < 43 * 250e6, rest         # attention + shared + compressor/indexer: 150-250 MB a layer


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(synth_flash, "PIECE_ELEMS", 1 << 15)  # big tensors cut into many pieces: the streaming path runs
    d = tmp_path_factory.mktemp("flash")
    tracemalloc.start()
    a = synth_flash.write_flash(d / "a.gguf", 8, 1, **SMALL)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    b = synth_flash.write_flash(d / "b.gguf", 8, 1, **SMALL)
    c = synth_flash.write_flash(d / "c.gguf", 8, 2, **SMALL)
    yield a, b, c, peak
    mp.undo()


def test_small_variant_is_deterministic_and_streams(small) -> None:
    a, b, c, peak = small
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(a) == digest(b) != digest(c)
    size = a.stat().st_size
    assert size > 8e6
    # the file never sits in memory: the traced peak is a small fraction of it (pieces of 32 K values, the vocab)
    assert peak < size / 4, (peak, size)


def test_small_variant_validates_with_padded_vocab_and_release_types(small) -> None:
    a = small[0]
    report = inspect_model(a)
    assert report["validation"]["ok"], report["validation"]
    f = GGUFFile(a)
    tokens = f.kv["tokenizer.ggml.tokens"].value
    types = f.kv["tokenizer.ggml.token_type"].value
    assert len(tokens) == 1000 and f.kv["deepseek4.vocab_size"].value == 1000
    assert tokens[999] == "[PAD999]" and types[999] == 5 and tokens[0] == "<｜begin▁of▁sentence｜>"
    assert len(set(tokens)) == 1000
    ti = f.tensors
    assert ti["token_embd.weight"].ggml_type == Q.F16 and ti["output.weight"].ggml_type == Q.Q8_0
    assert ti["blk.4.ffn_gate_exps.weight"].ggml_type == Q.IQ2_XXS
    assert ti["blk.4.ffn_down_exps.weight"].ggml_type == Q.Q2_K
    assert ti["blk.2.ffn_gate_tid2eid.weight"].ne == (6, 1000) and "blk.3.ffn_gate_tid2eid.weight" not in ti
    assert list(f.kv["deepseek4.attention.compress_ratios"].value) == [0, 0, 4, 128, 4, 0]
    # a streamed (many-piece) linear map keeps the N(0, 1/in) scale: attn_q_b is [q_rank 256 -> 4 x 192]
    w = quants.dequantize(np.asarray(f.data("blk.3.attn_q_b.weight")), Q.Q8_0).reshape(-1, 256)
    assert w.shape == (768, 256) and abs(float(w.std()) * 16 - 1) < 0.05
    # pieces are independent streams: no two rows of the embedding's pieces repeat
    e = np.asarray(f.data("token_embd.weight")).view(np.float16).reshape(-1, 256)
    assert e.shape == (1000, 256) and len({row.tobytes() for row in e}) == 1000


def test_cli_flash_options() -> None:
    run = lambda *args: CliRunner().invoke(cli, ["synth", *args, "-o", "/nonexistent/x.gguf"])  # noqa: E731
    r = run("--preset", "tiny", "--experts", "8")
    assert r.exit_code == 2 and "--experts is for --preset flash only" in r.output
    r = run("--preset", "flash", "--quant", "f32")
    assert r.exit_code == 2 and "release type mix only" in r.output
    r = run("--preset", "flash", "--experts", "4")
    assert r.exit_code == 2 and "4 is not in the range x>=6" in r.output
