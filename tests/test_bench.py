"""parity.bench.measure / parity.gguf.synth_real: real-dimension layout, timing plumbing, memory watch, tables."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from fake_engine import FakeEngine
from gguf.constants import GGMLQuantizationType as Q

from parity.bench import measure as bench
from parity.bench.perf_report import PerfReport, WorkerResult
from parity.contract.engine import RunOptions
from parity.contract.errors import ParityError
from parity.gguf import synth_real
from parity.gguf.container import tensor_nbytes
from parity.gguf.inventory import REAL_RELEASE_TYPES, expected_tensors
from parity.gguf.weights import Weights

SMALL_LAYER = {  # every V4 constraint kept (nope 64, indexer head 64, experts a multiple of 16), tiny sizes
    "dim": 256, "n_heads": 4, "head_dim": 128, "rope_head_dim": 64, "q_lora_rank": 64, "o_groups": 2,
    "o_lora_rank": 32, "window_size": 8, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 4,
    "n_routed_experts": 16, "n_activated_experts": 2, "moe_inter_dim": 256,
}


def test_real_config_gives_the_spec_byte_sizes() -> None:
    """Spec residual-ffn §2: IQ2_XXS gate/up = 553 648 128 B each, Q2_K down = 704 643 072 B per layer."""
    cfg = synth_real.real_config((4, 128), 290)
    sizes = {s.name: tensor_nbytes(s.ne, REAL_RELEASE_TYPES[s.klass]) for s in expected_tensors(cfg) if s.required}
    for layer in (0, 1):
        assert sizes[f"blk.{layer}.ffn_gate_exps.weight"] == 553_648_128
        assert sizes[f"blk.{layer}.ffn_up_exps.weight"] == 553_648_128
        assert sizes[f"blk.{layer}.ffn_down_exps.weight"] == 704_643_072
    assert (cfg.dim, cfg.n_heads, cfg.head_dim, cfg.rope_head_dim, cfg.q_lora_rank) == (4096, 64, 512, 64, 1024)
    assert (cfg.o_groups, cfg.o_lora_rank, cfg.window_size, cfg.index_topk) == (8, 1024, 128, 512)
    assert (cfg.n_routed_experts, cfg.n_activated_experts, cfg.moe_inter_dim, cfg.n_hash_layers) == (256, 6, 2048, 0)
    assert cfg.has_indexer(0) and not cfg.has_indexer(1)


@pytest.fixture(scope="module")
def small_real(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setattr(synth_real, "V4_FLASH_LAYER", SMALL_LAYER)
    monkeypatch_module.setattr(synth_real, "EXPERTS_PER_PIECE", 4)  # 16 experts = 4 pieces of the scratch memmap
    return synth_real.write_real(tmp_path_factory.mktemp("real") / "small.gguf", (4, 128), seed=3)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_write_real_types_shapes_and_expert_scale(small_real) -> None:
    w = Weights(small_real)
    cfg = w.config
    assert cfg.compress_ratios == (4, 128) and cfg.dim == 256 and cfg.swiglu_limit == (10.0, 10.0)
    assert w.info("blk.0.ffn_gate_exps.weight").ggml_type == Q.IQ2_XXS
    assert w.info("blk.1.ffn_down_exps.weight").ggml_type == Q.Q2_K
    assert w.info("blk.0.attn_q_b.weight").ggml_type == Q.Q8_0
    assert w.info("blk.0.indexer.proj.weight").ggml_type == Q.F16
    assert not any(p.name.endswith(".scratch") for p in small_real.parent.iterdir())
    # every expert piece is drawn with the linear-map scale 1/sqrt(in) (the same rule as parity.gguf.synth);
    # measured (seed 3): std within 3.0 % of 1/16 for experts of the first, a middle and the last piece
    for e in (0, 7, 15):
        assert np.std(w.expert("blk.0.ffn_gate_exps.weight", e)) == pytest.approx(1 / 16, rel=0.06)
        assert np.std(w.expert("blk.1.ffn_down_exps.weight", e)) == pytest.approx(1 / 16, rel=0.06)
    assert not np.array_equal(w.expert("blk.0.ffn_up_exps.weight", 0), w.expert("blk.0.ffn_up_exps.weight", 4))


def test_write_real_refuses_unknown_ratio(tmp_path) -> None:
    with pytest.raises(ValueError, match="must be 4"):
        synth_real.write_real(tmp_path / "x.gguf", (0,))


def test_reference_runs_on_the_real_layout(small_real) -> None:
    """The worker path end to end on the small real-layout file: finite logits, one time per layer and step."""
    from parity.contract.engine import load_engine
    from parity.tracing.runner import forward_chunk

    timed = bench.TimedEngine(load_engine("reference", str(small_real), RunOptions()))
    res = forward_chunk(timed, timed.new_state(), bench.prompt_tokens(12, timed.config.vocab_size), 0)
    assert res.logits.shape == (12, timed.config.vocab_size) and np.isfinite(res.logits).all()
    run = bench.time_prefill_decode(timed, 12, reps=1, decode_steps=2)
    assert len(run.prefill_layer_s) == 2 and len(run.decode_layer_s) == 2
    assert sum(run.prefill_layer_s) <= run.prefill_s


def test_time_prefill_decode_counts_layers_reps_and_steps(tiny_f32) -> None:
    timed = bench.TimedEngine(FakeEngine(str(tiny_f32)))
    run = bench.time_prefill_decode(timed, 10, reps=3, decode_steps=2)
    L = timed.config.n_layers
    assert run.load >= 0 and run.prefill_cpu_s > 0 and run.decode_cpu_s > 0  # beside every wall time
    assert len(run.prefill_all_s) == 3
    assert len(run.prefill_layer_s) == L and len(run.decode_layer_s) == L
    assert run.prefill_s == sorted(run.prefill_all_s)[1]
    assert sum(run.prefill_layer_s) <= max(run.prefill_all_s)
    assert len(timed.layer_s) == L  # the last decode step's layer calls


def test_time_tracing_reports_both_sides(tiny_f32) -> None:
    timed = bench.TimedEngine(FakeEngine(str(tiny_f32)))
    tr = bench.time_tracing(timed, 6, reps=2)
    assert tr.record_s > 0 and tr.forward_s > 0
    assert tr.overhead == pytest.approx(tr.record_s / tr.forward_s)


def test_prompt_tokens_are_fixed_and_in_range() -> None:
    a, b = bench.prompt_tokens(50, 290), bench.prompt_tokens(50, 290)
    assert np.array_equal(a, b) and a.min() >= 2 and a.max() < 290


def test_memory_watch_sees_an_allocation() -> None:
    import mmap

    with bench.MemoryWatch(every_s=0.001) as mem:
        before = mem.sample()[0]
        # 200 MiB of fresh anonymous pages, every page touched: an mmap of its own, so pages malloc kept from
        # earlier tests in this process (the engines' allocator tuning keeps freed memory) cannot serve it
        block = mmap.mmap(-1, 200 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        block.write(b"\x01" * len(block))
        time.sleep(0.01)
        block.close()
    assert mem.peak_anon - before >= 150 * 2**20
    assert mem.peak_total >= mem.peak_anon


def test_spawned_worker_failure_is_a_parity_error(tiny_f32) -> None:
    spec = {"engine": "no-such-engine", "model": str(tiny_f32), "device": "cpu", "lengths": {"4": 1},
            "decode_steps": 1, "trace_prompt": 4, "trace_reps": 0, "cache_gb": 1.0, "qat_sims": True}
    with pytest.raises(ParityError, match="unknown engine .no-such-engine.; registered: .*reference"):
        bench.spawn_worker(spec, 1, timeout_s=120)


def _worker(engine: str, ratios: list[int], prefill: list[float], decode: list[float]) -> dict:
    """A worker's document in `run_worker`'s key order, one 24-token run; the optional keys (load averages, CPU
    times, thread counts) left out."""
    run = {"prompt": 24, "reps": 1, "decode_steps": 1, "prefill_s": sum(prefill), "prefill_all_s": [sum(prefill)],
           "prefill_layer_s": prefill, "decode_s": sum(decode), "decode_layer_s": decode}
    tracing = {"prompt": 24, "reps": 1, "forward_s": 1.0, "record_s": 0.04, "overhead": 0.04}
    return {"engine": engine, "engine_version": "0", "device": "cpu", "model": "m.gguf", "n_layers": len(ratios),
            "ratios": ratios, "load_s": 1.0, "runs": [run], "tracing": tracing, "peak_rss_anon_gb": 1.5,
            "peak_rss_gb": 2.5, "model_file_gb": 1.0, "cache": {"budget": 2**30}, "blas_threads": "1",
            "usable_cpus": 2, "load_start": 0.5, "load_end": 0.5}


def _trace_diff(**doc: object) -> dict:
    """A trace-diff timing's document: 45 x 4096, 0.716 s, no load or CPU time (optional) unless given."""
    return {"checkpoints": 45, "positions": 4096, "from_npz_s": 0.716, **doc, "first_drift": "blk.21.attn",
            "npz_mb": 69.0}


def perf_report(**doc: object) -> PerfReport:
    """The report of a hand-made bench.json document: `doc`'s keys over a complete document of placeholders."""
    return PerfReport.from_dict({
        "bench_version": 1, "quick": True, "device": "cpu", "torch_threads": 2,
        "machine": {"cpu": "Test CPU", "cores": 2, "memory_gb": 24.0, "python": "3", "numpy": "x", "torch": "y",
                    "load_avg_start": [0.5, 0, 0], "cuda": None},
        "models": {}, "dequant_load": 0.5, "dequant": [], "dequant_load_end": 0.5, "trace_diff": _trace_diff(),
        "engines": {}, "wall_s": 1.0, "load_end": 0.5, **doc})


def test_tables_from_a_hand_made_report() -> None:
    mem = _worker("reference", [4], [3.0], [0.5])
    report = perf_report(
        device="cpu", wall_s=100.0, trace_diff=_trace_diff(),
        engines={"reference": {**_worker("reference", [4, 128], [8.0, 6.0], [0.8, 0.6]), "usable_cpus": 2},
                 "torch": _worker("torch", [4, 128], [2.0, 1.5], [0.2, 0.3]), "reference_1layer_memory": mem,
                 "reference_1thread": _worker("reference", [4, 128], [12.0, 9.0], [1.0, 0.6])},
        dequant=[{"type": "Q2_K", "values": 8 * 2**20, "gguf_mvs": 100.0, "reference_mvs": 600.0,
                  "torch_mvs": 50.0, "reference_speedup": 6.0, "torch_speedup": 0.5, "reference_exact": True,
                  "torch_exact": False, "reference_mvs_2t": 900.0, "torch_mvs_2t": 90.0}],
    )
    rows = {r[0]: r[1:] for r in bench.summary_rows(report)}
    assert rows["prefill 24 tok, layer 0 (CSA)"] == ("8.000 s", "2.000 s", "4.0x")
    assert rows["decode @ctx 24, layer 1 (HCA)"] == ("0.600 s", "0.300 s", "2.0x")
    assert rows["model decode estimate: 43 x mean layer decode @ctx 24"][:2] == (
        "30.1 s/tok = 0.033 tok/s", "10.8 s/tok = 0.093 tok/s")  # 43 x 0.7 s and 43 x 0.25 s
    assert rows["reference: trace recording / forward (24 tok, every position)"][2] == "+4.00 %"
    assert rows["diff of two .npz traces, 45 checkpoints x 4096 positions"][0] == "0.72 s"
    assert rows["reference 1 layer, 1.00 GiB cache: prefill 24 / decode"][:2] == ("3.000 s", "0.500 s")
    assert bench.thread_rows(report) == [("prefill 24 tok", "12.000 s / 9.000 s", "8.000 s / 6.000 s", "1.50x / 1.50x"),
                                         ("decode @ctx 24", "1.000 s / 0.600 s", "0.800 s / 0.600 s", "1.25x / 1.00x")]
    md = bench.render_markdown(report)
    assert "| Q2_K | 100 | 600 | 6.0x | yes | 50 | 0.5x | NO | 0.1x |" in md
    assert "| Q2_K | 600 -> 900 | 50 -> 90 | 0.1x |" in md
    assert "| measure | 1 thread | 2 threads | speed-up |" in md
    assert "| 24 | 8.000 / 6.000 | 0.800 / 0.600 | 2.000 / 1.500 | 0.200 / 0.300 |" in md
    assert "Test CPU, 2 cores" in md


@pytest.mark.slow
def test_bench_quick_end_to_end(tmp_path) -> None:
    """`v4parity bench --quick` through the CLI: JSON + table written, every dequantizer exact."""
    from click.testing import CliRunner

    from parity.cli import cli

    res = CliRunner().invoke(cli, ["bench", "--quick", "--no-verdicts", "--out", str(tmp_path / "o"), "--cache-dir",
                                   str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert all(r["reference_exact"] and r["torch_exact"] for r in report["dequant"])
    assert set(report["engines"]) == {"reference", "torch", "reference_1layer_memory"}


def test_dequant_rows_cover_every_type_with_a_gguf_baseline() -> None:
    """The dequantizer table has a row per type (the release's mix and every type added since, Q8_K excepted:
    gguf.quants cannot dequantize it); each is measured on the same bytes by gguf.quants and both engines, exact."""
    sources = bench.dequant_sources(None, 1 << 13, np.random.default_rng(0))
    assert set(sources) == {"F32", "F16", "BF16", "Q8_0", "Q4_K", "Q2_K", "IQ2_XXS", "MXFP4", *bench.NEW_TYPES}
    assert all(sources[name][0] == Q[name] for name in sources)
    rows = {r.type: r for r in bench.measure_dequant(None, "cpu", 1 << 13, 1)}
    assert set(rows) == set(sources)
    for name in bench.NEW_TYPES:
        r = rows[name]
        assert r.values == 1 << 13 and r.gguf_mvs > 0 and r.reference_mvs > 0 and r.torch_mvs > 0
        assert r.reference_exact and r.torch_exact, name


def test_trace_diff_timing_finds_the_planted_drift(tmp_path) -> None:
    """Synthetic real-size traces are well-formed: diff finds the drift planted from checkpoint blk.2.attn on."""
    td = bench.time_trace_diff(4, 16, reps=1, tmp=tmp_path)
    assert td.checkpoints == 2 * 4 + 2 and td.positions == 16
    assert td.first_drift == "blk.2.attn"
    assert td.from_npz_s > 0 and td.npz_mb > 0


@pytest.mark.parametrize("args", [["--engines", "reference,bogus"], ["--torch-threads", "-1"]])
def test_bench_cli_refuses_bad_options(args: list[str], tmp_path) -> None:
    from click.testing import CliRunner

    from parity.cli import cli

    res = CliRunner().invoke(cli, ["bench", "--out", str(tmp_path), *args])
    assert isinstance(res.exception, ParityError)


def test_bench_cli_refuses_cuda_without_a_gpu(tmp_path) -> None:
    import torch
    from click.testing import CliRunner

    from parity.cli import cli

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res = CliRunner().invoke(cli, ["bench", "--device", "cuda", "--out", str(tmp_path)])
    assert isinstance(res.exception, ParityError) and "no CUDA device" in str(res.exception)


# ------------------------------------------------------------------------------------------------
# parity.bench.verdicts: check's false-DEFECT and detection rates


def test_verdict_bench_one_correct_and_one_faulty_run(tiny_f32, tmp_path) -> None:
    """The smallest verdict plan end to end: a clean torch run and a faulty one on tiny F32, judged from files;
    the JSON has every row field, and the aggregates are those of the rows."""
    from parity.bench import verdicts
    from parity.bench.verdicts_report import read_row
    from parity.contract.progress import Recording

    plan = verdicts.VerdictPlan(torch_lengths={40: 1}, torch_models=("f32",), llamacpp_types=(),
                                faults=("no-decode-compression",), fault_prompts=1, fault_qat=(True,), decode=4)
    rec = Recording()
    result = verdicts.run_verdicts({"f32": tiny_f32}, plan, tmp_path / "scratch", rec, plan_name="one of each")
    lines = rec.notes
    js, md = verdicts.write_verdicts(result, tmp_path / "out")
    def no_constants(name: str) -> None:
        raise AssertionError(f"non-strict JSON constant {name}")

    data = json.loads(js.read_text(), parse_constant=no_constants)
    rows = data["rows"]
    assert [r["kind"] for r in rows] == ["correct", "fault"] and len(lines) == 2 and "ETA" in lines[-1]
    for r in rows:
        assert {"verdict", "headline", "culprit_layer", "cause", "seconds", "layer_runs", "layer_runs_total",
                "prompt", "decode", "seed", "engine", "model", "qat"} <= set(r)
        assert r["layer_runs_total"] == sum(r["layer_runs"].values()) > 0 and r["prompt"] == 40
    correct, fault = rows
    assert correct["verdict"] in ("MATCH", "NOISE") and not correct["false_defect"]
    assert fault["fault"] == "no-decode-compression" and fault["expected_layer"] is not None
    assert fault["verdict"] == "DEFECT" and fault["found"], fault["headline"]
    assert data["summary"] == json.loads(json.dumps(verdicts.summarize([read_row(r) for r in rows]).to_dict()))
    s = data["summary"]
    c, f = s["correct"], s["faults"]
    assert (c["n"], c["false_defects"], f["acting"], f["found"]) == (1, 0, 1, 1)
    assert s["time"]["all"]["max_s"] == max(r["seconds"] for r in rows)
    assert "| false DEFECT | 0 / 1 = 0.0 %" in md.read_text()


def verdict_row(**doc: object) -> dict:
    """An unjudged verdict-bench row document (a correct torch run, check's MATCH) with `doc`'s keys over it."""
    return {"kind": "correct", "engine": "torch", "model": "f32", "qat": True, "fault": None, "prompt": 40, "seed": 1,
            "subops": False, "decode": 8, "wall_s": 1.0, "verdict": "MATCH", "headline": "MATCH", "culprit_layer": None,
            "culprit_subop": None, "cause": None, "causes": [], "judged": "layer-level", "seconds": 1.0,
            "layer_runs": {}, "layer_runs_total": 1, **doc}


def test_verdict_summary_counts_false_defects_and_misses() -> None:
    """summarize() on hand-made rows: a DEFECT on a correct run is a false DEFECT; a faulty run is found only with
    the right fault at the right layer; a fault that does not act is left out of the rates."""
    from parity.bench.verdicts import summarize, upper_bound
    from parity.bench.verdicts_report import read_row

    def row(kind: str, verdict: str, s: float, **kw: object):
        r = verdict_row(kind=kind, verdict=verdict, headline=verdict, seconds=s, layer_runs_total=10, **kw)
        if kind == "correct":
            r["false_defect"] = verdict == "DEFECT"
        else:
            r["detected"] = verdict == "DEFECT"
            r["found"] = r["detected"] and r["cause"] == r["fault"] and r["culprit_layer"] == r["expected_layer"]
        return read_row(r)

    rows = [row("correct", "MATCH", 1.0), row("correct", "DEFECT", 2.0, prompt=150),
            row("fault", "DEFECT", 3.0, fault="f", cause="f", culprit_layer=2, expected_layer=2),
            row("fault", "DEFECT", 4.0, fault="f", cause="g", culprit_layer=2, expected_layer=2),
            row("fault", "NOISE", 5.0, fault="f", expected_layer=1),
            row("fault", "MATCH", 6.0, fault="h", expected_layer=None)]
    s = summarize(rows)
    assert (s.correct.n, s.correct.false_defects, s.correct.false_defect_rate) == (2, 1, 0.5)
    assert (s.faults.n, s.faults.acting, s.faults.inert) == (4, 3, 1)
    assert (s.faults.detected, s.faults.found) == (2, 1)
    assert len(s.false_defects) == 1 and len(s.misses) == 2
    assert s.time.all.to_dict() == {"n": 6, "median_s": 3.5, "max_s": 6.0, "median_layer_runs": 10}
    assert list(s.time.by_length["f32"]) == ["40", "150"]
    assert upper_bound(0, 50) == pytest.approx(1 - 0.05 ** (1 / 50), rel=1e-6)


def test_every_ratio_carries_the_load_it_was_measured_at() -> None:
    """A ratio of two wall times taken at different loads is meaningless: each speed-up cell names the 1-minute load
    average of both runs, the CPU-time rows (load-insensitive) sit beside them, and the diff row its load and CPU."""
    ref = _worker("reference", [4], [8.0], [0.8])
    tor = _worker("torch", [4], [2.0], [0.2])
    ref["runs"][0].update(load=0.6, prefill_cpu_s=12.0, decode_cpu_s=1.5)
    tor["runs"][0].update(load=4.2, prefill_cpu_s=2.0, decode_cpu_s=0.25)
    report = perf_report(engines={"reference": ref, "torch": tor},
                         trace_diff=_trace_diff(checkpoints=88, positions=4096, from_npz_s=0.5, load=3.9, cpu_s=0.61))
    rows = {r[0]: r[1:] for r in bench.summary_rows(report)}
    assert rows["prefill 24 tok, layer 0 (CSA)"] == ("8.000 s", "2.000 s", "4.0x (load 0.6 / 4.2)")
    cpu = rows["CPU time, prefill 24 tok (all layers, all threads)"]
    assert cpu == ("12.000 s", "2.000 s", "6.0x (load 0.6 / 4.2)")
    assert rows["CPU time, decode 24 tok (all layers, all threads)"][2] == "6.0x (load 0.6 / 4.2)"
    assert rows["diff of two .npz traces, 88 checkpoints x 4096 positions"][0] == "0.50 s (CPU 0.61 s, load 3.9)"



def test_per_length_workers_merge_into_one_engine_answer() -> None:
    a, b = _worker("torch", [4], [2.0], [0.2]), _worker("torch", [4], [9.0], [0.9])
    b["runs"][0]["prompt"], b["tracing"], b["peak_rss_gb"] = 128, None, 7.0
    a["load_s"], b["load_s"] = 1.0, 3.0
    m = bench.merge_workers([WorkerResult.from_dict(a), WorkerResult.from_dict(b)])
    assert [r.prompt for r in m.runs] == [24, 128] and m.tracing == WorkerResult.from_dict(a).tracing
    assert (m.peak_rss_gb, m.peak_rss_anon_gb, m.load_s) == (7.0, 1.5, 3.0)
