"""The GGUF container: writer/reader round trip, bad input, corruption fuzzing, shards, inventory."""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity.contract.errors import GGUFError, ParityError, TensorError
from parity.gguf.config import config_from_metadata
from parity.gguf.container import VT, GGUFFile, TensorData, Value, write_gguf
from parity.gguf.inventory import REAL_RELEASE_TYPES, expected_tensors, layout_bytes, validate
from parity.gguf.quant_blocks import random_blocks
from parity.gguf.synth import init_weight, metadata, preset_config, synthesize, tensor_type
from parity.gguf.vocab import synthetic_vocab
from parity.gguf.weights import Weights, same_model

V4_FLASH = preset_config("tiny", 129280).__class__(
    dim=4096, n_layers=43, vocab_size=129280, n_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1024,
    o_groups=8, o_lora_rank=1024, window_size=128,
    compress_ratios=(0, 0, *(4 if l % 2 == 0 else 128 for l in range(2, 43))),
    rope_theta=10000.0, compress_rope_theta=160000.0, yarn=True, rope_factor=16.0, original_seq_len=65536,
    beta_fast=32.0, beta_slow=1.0, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6, n_routed_experts=256, n_activated_experts=6,
    n_shared_experts=1, moe_inter_dim=2048, route_scale=1.5, expert_weights_norm=True, score_func="sqrtsoftplus",
    n_hash_layers=3, swiglu_limit=(10.0,) * 43, swiglu_limit_shexp=(10.0,) * 43, context_length=1048576,
    bos_token_id=0, eos_token_id=1)


def test_v4_flash_inventory_reproduces_the_spec_figures():
    specs = expected_tensors(V4_FLASH)
    required = [s for s in specs if s.required]
    assert len(required) == 1328  # spec §2: 6 + 43*23 + 41*4 + 21*6 + 3 + 40
    assert layout_bytes(specs, REAL_RELEASE_TYPES) == 86_714_775_900
    assert sum(1 for s in specs if not s.required) == 3  # optional exp_probs_b on the 3 hash layers


def small_file(tmp_path, kv=None, tensors=None, alignment=32):
    """A small valid GGUF (tiny metadata, two tensors) for container tests."""
    kv = kv if kv is not None else metadata(preset_config("tiny", len(synthetic_vocab().tokens)), "tiny")
    rng = np.random.default_rng(0)
    if tensors is None:
        tensors = [
            TensorData("a.weight", (32, 3), int(Q.F32), rng.standard_normal((3, 32)).astype("<f4").tobytes()),
            TensorData("b.weight", (64, 2), int(Q.Q8_0),
                       quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), Q.Q8_0).tobytes()),
        ]
    path = tmp_path / "small.gguf"
    write_gguf(path, kv, tensors, alignment)
    return path


def test_writer_reader_round_trip(tmp_path):
    path = small_file(tmp_path)
    f = GGUFFile(path)
    kv = metadata(preset_config("tiny", len(synthetic_vocab().tokens)), "tiny")
    assert set(f.kv) == set(kv)
    for k, v in kv.items():
        got = f.kv[k]
        assert (got.type, got.elem_type) == (v.type, v.elem_type), k
        if v.type == VT.F32 or v.elem_type == VT.F32:
            np.testing.assert_array_equal(np.float32(got.value), np.float32(v.value))
        elif v.type == VT.ARRAY:
            assert list(got.value) == list(v.value), k
        else:
            assert got.value == v.value, k
    assert f.tensors["a.weight"].shape == (3, 32) and f.tensors["b.weight"].nbytes == 2 * 2 * 34
    assert f.tensors["a.weight"].offset % 32 == 0 and f.tensors["b.weight"].offset % 32 == 0


@pytest.mark.parametrize("alignment", [1, 8, 64, 4096])
def test_custom_alignment_is_honoured(tmp_path, alignment):
    kv = {"general.alignment": Value(VT.U32, alignment)}
    path = small_file(tmp_path, kv=kv, alignment=alignment)
    f = GGUFFile(path)
    assert f.data_start % alignment == 0
    assert np.frombuffer(f.data("a.weight"), "<f4").shape == (96,)


def _header(n_tensors=0, n_kv=0, version=3):
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


@pytest.mark.parametrize("blob,message", [
    (b"", "truncated"),
    (b"GGU", "truncated"),
    (b"GGML" + bytes(20), "bad magic"),
    (_header(version=1), "unsupported GGUF version 1"),
    (_header(version=99), "unsupported GGUF version 99"),
    (_header(n_kv=2**62), "truncated or corrupt"),
    (_header(n_tensors=2**40), "truncated or corrupt"),
    (_header(n_kv=1) + struct.pack("<Q", 2**60) + b"k", "truncated or corrupt"),  # huge key length
    (_header(n_kv=1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 4, 2**61), "truncated or corrupt"),
    (_header(n_kv=1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2**61), "truncated or corrupt"),
    (_header(n_kv=1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 77), "unknown value type 77"),
    (_header(n_kv=1) + struct.pack("<Q", 1) + b"\xff" + struct.pack("<I", 4) + bytes(4), "not valid UTF-8"),
])
def test_malformed_headers_raise_gguf_error(tmp_path, blob, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    with pytest.raises(GGUFError, match=message):
        GGUFFile(path)


def _one_tensor_file(tmp_path, ne, ggml_type, offset, data_len):
    name = b"t"
    info = struct.pack("<Q", 1) + name + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
    info += struct.pack("<IQ", ggml_type, offset)
    head = _header(n_tensors=1) + info
    head += bytes(-len(head) % 32)
    path = tmp_path / "t.gguf"
    path.write_bytes(head + bytes(data_len))
    return path


@pytest.mark.parametrize("ne,qtype,offset,data_len,message", [
    ((32,), 0, 0, 64, "runs past the end"),
    ((32,), 0, 8, 256, "not aligned"),
    ((33,), 8, 0, 64, "not a multiple"),
    ((32,), 999, 0, 128, "unknown ggml type"),
    ((0,), 0, 0, 128, "impossible dimension"),
    ((2**41, 2), 0, 0, 128, "impossible dimension"),
    ((2**40, 2**20), 0, 0, 128, "runs past the end"),
    ((4, 4, 4, 4, 4), 0, 0, 4096, "n_dims=5"),
])
def test_bad_tensor_table_raises_gguf_error(tmp_path, ne, qtype, offset, data_len, message):
    with pytest.raises(GGUFError, match=message):
        GGUFFile(_one_tensor_file(tmp_path, ne, qtype, offset, data_len))


@pytest.fixture(scope="module")
def valid_bytes(tmp_path_factory):
    return small_file(tmp_path_factory.mktemp("fuzz")).read_bytes()


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_corruption_raises_only_project_errors(tmp_path_factory, valid_bytes, data):
    blob = bytearray(valid_bytes)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(blob))))
    path = tmp_path_factory.getbasetemp() / "corrupt.gguf"
    path.write_bytes(bytes(blob[:cut] if cut is not None else blob))
    try:
        f = GGUFFile(path)
        config_from_metadata(f.kv, f.path, {n: t.shape for n, t in f.tensors.items()})
    except ParityError:
        pass


def test_synth_same_seed_gives_identical_bytes_and_other_seed_differs(tmp_path):
    a = synthesize(tmp_path / "a.gguf", "tiny", "real-mix", seed=3).read_bytes()
    b = synthesize(tmp_path / "b.gguf", "tiny", "real-mix", seed=3).read_bytes()
    c = synthesize(tmp_path / "c.gguf", "tiny", "real-mix", seed=4).read_bytes()
    assert a == b and a != c


@pytest.mark.parametrize("fixture", ["tiny_f32", "tiny_realmix", "tiny_mxfp4"])
def test_synthetic_models_validate_and_read_back(fixture, request):
    w = Weights(request.getfixturevalue(fixture))
    assert validate(w.tensor_infos(), w.config).ok
    assert w.config == preset_config("tiny", len(synthetic_vocab().tokens))
    for name in w.names:
        arr = w.tensor(name)
        assert arr.shape == w.info(name).shape


def test_real_mix_uses_the_release_types_and_random_blocks_hit_the_intended_scale(tiny_realmix):
    w = Weights(tiny_realmix)
    cfg = w.config
    for spec in expected_tensors(cfg):
        if not spec.required:
            continue
        assert w.info(spec.name).ggml_type == tensor_type(spec, "real-mix", cfg.n_layers), spec.name
        if w.info(spec.name).ggml_type in (Q.Q2_K, Q.Q4_K, Q.IQ2_XXS):
            _, std = init_weight(spec, cfg, np.random.default_rng(0))
            got = w.tensor(spec.name)
            assert np.isfinite(got).all()
            assert abs(got.std() / std - 1) < 0.10, (spec.name, got.std(), std)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q4_K, Q.IQ2_XXS])
@pytest.mark.parametrize("std", [1e-3, 0.05, 2.0])
def test_random_blocks_scale_and_finiteness(qtype, std):
    blocks = random_blocks(qtype, (16, 512), std, np.random.default_rng(1))
    vals = quants.dequantize(blocks, qtype)
    assert vals.shape == (16, 512) and np.isfinite(vals).all()
    assert abs(vals.std() / std - 1) < 0.10
    assert abs(vals.mean()) < 0.1 * std


def test_quantized_types_are_quantized_from_the_float_weights(tiny_mxfp4, tiny_f32):
    mx, f = Weights(tiny_mxfp4), Weights(tiny_f32)
    name = "blk.3.ffn_up_exps.weight"
    a, b = mx.expert(name, 5), f.expert(name, 5)
    assert mx.info(name).type_name == "MXFP4"
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    # MXFP4 (e2m1 + shared power-of-two scale per 32) of Gaussian weights: measured 0.115 relative error;
    # unrelated weights of the same scale would give ~1.4
    assert 0.08 < rel < 0.15


def test_expert_slice_equals_the_whole_tensor_slice(tiny_realmix):
    w = Weights(tiny_realmix)
    for name in ("blk.4.ffn_gate_exps.weight", "blk.4.ffn_down_exps.weight"):
        whole = w.tensor(name)
        for e in (0, 7):
            np.testing.assert_array_equal(w.expert(name, e), whole[e])


def test_split_shards_read_like_one_file(tmp_path, tiny_f32):
    src = GGUFFile(tiny_f32)
    names = list(src.tensors)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:]), start=1):
        kv = dict(src.kv) if i == 1 else {}
        tensors = [TensorData(n, src.tensors[n].ne, src.tensors[n].ggml_type, bytes(src.data(n))) for n in part]
        write_gguf(tmp_path / f"m-{i:05d}-of-00002.gguf", kv, tensors)
    w = Weights(tmp_path / "m-00002-of-00002.gguf")
    assert w.config == Weights(tiny_f32).config
    np.testing.assert_array_equal(w.tensor(names[-1]), Weights(tiny_f32).tensor(names[-1]))
    (tmp_path / "m-00001-of-00002.gguf").unlink()
    with pytest.raises(GGUFError, match="missing shard"):
        Weights(tmp_path / "m-00002-of-00002.gguf")


def test_nan_weights_are_an_error_naming_the_tensor(tmp_path):
    kv = metadata(preset_config("tiny", len(synthetic_vocab().tokens)), "tiny")
    arr = np.ones((4, 32), np.float32)
    arr[2, 5] = np.nan
    path = small_file(tmp_path, kv=kv, tensors=[TensorData("output_norm.weight", (32, 4), 0, arr.tobytes())])
    w = Weights(path)
    with pytest.raises(ParityError, match="output_norm.weight.*non-finite"):
        w.tensor("output_norm.weight")
    with pytest.raises(ParityError, match="'token_embd.weight' is missing"):
        w.tensor("token_embd.weight")


def test_importing_parity_and_cli_help_do_not_import_torch():
    code = "import sys, parity, parity.cli; parity.cli.cli(['--help'], standalone_mode=False); " \
           "sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def _tensor_file(tmp_path, tensors, data_len):
    """A GGUF with no metadata and the given (name, ne, ggml type, offset) tensor infos."""
    info = b""
    for name, ne, ggml_type, offset in tensors:
        info += struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(ne))
        info += struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", ggml_type, offset)
    head = _header(n_tensors=len(tensors)) + info
    head += bytes(-len(head) % 32)
    path = tmp_path / "t.gguf"
    path.write_bytes(head + bytes(data_len))
    return path


@pytest.mark.parametrize("offsets", [(0, 0), (0, 32), (64, 32), (0, 96)])
def test_overlapping_tensors_are_refused(tmp_path, offsets):
    """Two F32 tensors of 32 floats (128 bytes) whose byte ranges overlap."""
    tensors = [("a.weight", (32,), 0, offsets[0]), ("b.weight", (32,), 0, offsets[1])]
    with pytest.raises(GGUFError, match=r"tensors '[ab].weight' \(bytes \d+\.\.\d+\) and '[ab].weight' .* overlap"):
        GGUFFile(_tensor_file(tmp_path, tensors, 512))


def test_adjacent_tensors_are_accepted(tmp_path):
    f = GGUFFile(_tensor_file(tmp_path, [("a", (32,), 0, 128), ("b", (32,), 0, 0)], 256))
    assert f.tensors["b"].offset + 128 == f.tensors["a"].offset


def test_unsupported_ggml_type_is_a_tensor_error_naming_tensor_and_type(tmp_path):
    kv = metadata(preset_config("tiny", len(synthetic_vocab().tokens)), "tiny")
    raw = bytes(2 * 40)  # Q8_1: 32 values in 40 bytes; gguf-py has no dequantizer for it
    path = small_file(tmp_path, kv=kv, tensors=[TensorData("odd.weight", (32, 2), int(Q.Q8_1), raw)])
    with pytest.raises(TensorError, match=r"odd\.weight.*ggml type Q8_1 cannot be dequantized"):
        Weights(path).tensor("odd.weight")


def test_error_lines_cap_long_names(tmp_path):
    name = "n" * 100_000  # longer than a tensor name may be: refused before it is decoded
    tensors = [(name, (32,), 0, 0), ("b", (32,), 0, 0)]
    with pytest.raises(GGUFError) as e:
        GGUFFile(_tensor_file(tmp_path, tensors, 256))
    assert "tensor name #0" in str(e.value) and len(str(e.value)) < 400
    key = ("k" * 65_535).encode()  # the longest key there may be, twice: the error line quotes it capped
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<IB", 0, 1)
    (tmp_path / "k.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + entry * 2)
    with pytest.raises(GGUFError) as e:
        GGUFFile(tmp_path / "k.gguf")
    assert "duplicate metadata key" in str(e.value) and len(str(e.value)) < 400


def test_big_arrays_are_views_and_string_arrays_lazy(tiny_f32):
    f = GGUFFile(tiny_f32)
    types = f.kv["tokenizer.ggml.token_type"].value
    assert isinstance(types, np.ndarray) and not types.flags.owndata and not types.flags.writeable
    tokens = f.kv["tokenizer.ggml.tokens"].value
    vocab = synthetic_vocab().tokens
    assert len(tokens) == len(vocab) and tokens[5] == vocab[5] and list(tokens) == vocab
    assert len(repr(tokens)) < 200


def test_identity_covers_the_tensor_data_and_reads_the_old_form(tmp_path):
    a = Weights(synthesize(tmp_path / "a.gguf", "tiny", "real-mix", seed=3)).identity()
    b = Weights(synthesize(tmp_path / "b.gguf", "tiny", "real-mix", seed=4)).identity()
    c = Weights(synthesize(tmp_path / "c.gguf", "tiny", "real-mix", seed=3)).identity()
    # different seeds: same size and header (the old identity cannot tell them apart), other data hash
    assert (a["size"], a["header_sha256"]) == (b["size"], b["header_sha256"])
    assert a["data_sha256"] != b["data_sha256"] and a["data_sha256"] == c["data_sha256"]
    assert not same_model(a, b) and same_model(a, c)
    old = {k: a[k] for k in ("file", "size", "header_sha256")}
    assert same_model(old, b) and same_model(b, old)  # an old identity is compared on what it carries
    assert not same_model(old, {**b, "size": b["size"] + 1})
    for key in ("size", "header_sha256"):  # a key neither identity carries is no evidence of the same model
        partial = {k: v for k, v in old.items() if k != key}
        with pytest.raises(ParityError, match=f"model identity without '{key}'"):
            same_model(partial, partial)
    with pytest.raises(ParityError, match="without 'file'"):
        same_model(a, {k: v for k, v in c.items() if k != "file"}, compare_file=True)


def test_data_hash_samples_the_documented_blocks(tmp_path):
    """An independent transcription of the recipe in data_sha256's docstring, on a file with a big tensor."""
    import hashlib

    kv = metadata(preset_config("tiny", len(synthetic_vocab().tokens)), "tiny")
    rng = np.random.default_rng(5)
    big = rng.standard_normal((64, 512)).astype("<f4").tobytes()    # 128 KiB: sampled
    small = rng.standard_normal((2, 32)).astype("<f4").tobytes()    # whole
    path = small_file(tmp_path, kv=kv, tensors=[TensorData("big", (512, 64), 0, big),
                                                 TensorData("small", (32, 2), 0, small)])
    h = hashlib.sha256()
    h.update(b"big\0" + struct.pack("<Q", len(big)))
    for k in range(16):
        at = k * (len(big) - 4096) // 15
        h.update(big[at: at + 4096])
    h.update(b"small\0" + struct.pack("<Q", len(small)) + small)
    assert Weights(path).identity()["data_sha256"] == h.hexdigest()[:32]
    flipped = bytearray(big)
    flipped[len(big) // 2 + 100] ^= 1  # between sampled blocks 7 (59255..63351) and 8 (67720..71816)
    path2 = small_file(tmp_path / "2", kv=kv, tensors=[TensorData("big", (512, 64), 0, bytes(flipped)),
                                                        TensorData("small", (32, 2), 0, small)])
    assert Weights(path2).identity()["data_sha256"] == h.hexdigest()[:32]  # the stated limit of sampling


def test_inspect_reports_extra_compress_ratios_and_refuses_a_scalar_token_list(tmp_path):
    from parity.contract.errors import MetadataError
    from parity.gguf.report import inspect_model

    cfg = preset_config("tiny", len(synthetic_vocab().tokens))
    kv = metadata(cfg, "tiny")
    kv["deepseek4.attention.compress_ratios"] = Value(VT.ARRAY, [*cfg.compress_ratios, 0, 4, 128], VT.I32)
    report = inspect_model(str(small_file(tmp_path, kv=kv)))
    assert report["config"]["compress_ratios"] == list(cfg.compress_ratios)
    assert "3 extra" in report["notes"]["compress_ratios"]
    kv["tokenizer.ggml.tokens"] = Value(VT.STRING, "abc")
    with pytest.raises(MetadataError, match="tokenizer.ggml.tokens"):
        inspect_model(str(small_file(tmp_path / "s", kv=kv)))
