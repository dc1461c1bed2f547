"""`parity.bench.perf_report` and `parity.bench.reports` (issue 26.3): `v4parity bench`'s sections as frozen typed
reports. bench.json and the Markdown table stay what the dict-based run wrote (the expected bytes are the old code's
spelling, computed here, and tests/fixtures/bench/bench.json / .md, written by the old code), the command's stage
notes go through the progress protocol, and a document with a missing or unknown key is refused by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_bench import _trace_diff, _worker

from parity.bench import measure
from parity.bench.perf_report import DequantRow, PerfReport, TimedRun, WorkerResult
from parity.bench.run import run_bench_command
from parity.bench.verdicts import render_verdicts_markdown, summarize, write_verdicts
from parity.bench.verdicts_report import CorrectRow, FaultRow, TieRow, VerdictsReport
from parity.compare.jsonvalues import json_safe
from parity.compare.verdict import Verdict
from parity.contract.errors import ParityError
from parity.contract.progress import Recording


def _document() -> dict:
    """A complete bench.json document in the order `run_bench` builds it (values hand-made; one inf)."""
    return {
        "bench_version": 3, "quick": True, "device": "cpu", "torch_threads": 2,
        "machine": {"cpu": "Test CPU", "cores": 2, "memory_gb": 24.0, "python": "3", "numpy": "x", "torch": "y",
                    "load_avg_start": [0.5, 0, 0], "cuda": None},
        "models": {"2layer": {"path": "/tmp/m2.gguf", "gib": 1.5}},
        "dequant_load": 0.5,
        "dequant": [{"type": "Q2_K", "values": 8 * 2**20, "gguf_mvs": 100.0, "reference_mvs": 600.0,
                     "torch_mvs": 50.0, "reference_speedup": 6.0, "torch_speedup": float("inf"),
                     "reference_exact": True, "torch_exact": False, "reference_mvs_2t": 900.0, "torch_mvs_2t": 90.0}],
        "dequant_load_end": 0.7,
        "trace_diff": _trace_diff(),
        "engines": {"reference": {**_worker("reference", [4, 128], [8.0, 6.0], [0.8, 0.6]), "usable_cpus": 2},
                    "torch": _worker("torch", [4, 128], [2.0, 1.5], [0.2, 0.3]),
                    "reference_1layer_memory": _worker("reference", [4], [3.0], [0.5])},
        "wall_s": 100.0, "load_end": 0.9,
    }


def test_bench_json_and_table_are_unchanged_and_the_report_is_frozen(tmp_path, monkeypatch):
    doc = _document()

    def fake_run_bench(cache, device, quick, engines, threads, progress, peers=()):
        progress.note("dequantizer throughput (reference NumPy / torch / gguf.quants) ...")
        return PerfReport.from_dict(doc)

    monkeypatch.setattr(measure, "run_bench", fake_run_bench)
    rec = Recording()
    run = run_bench_command(tmp_path / "cache", tmp_path / "out", device="cpu", quick=True, engines="reference",
                            peers="", torch_threads=0, verdicts=False, verdicts_only=False, progress=rec)
    old_json = json.dumps(json_safe(doc), indent=2, allow_nan=False)      # what the dict-based run wrote
    assert (tmp_path / "out" / "bench.json").read_text() == old_json
    table = measure.render_markdown(PerfReport.from_dict(doc))
    assert run.table == table == (tmp_path / "out" / "bench.md").read_text()
    assert isinstance(run.report, PerfReport) and run.verdicts is None
    assert list(run.report.to_dict()) == list(doc) and run.report.to_dict()["dequant"][0]["torch_speedup"] == "inf"
    assert run.report.tiny_engines is None and "tiny_engines" not in run.report.to_dict()   # optional, absent
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.report.wall_s = 0.0  # type: ignore[misc]
    assert rec.calls == [("note", "dequantizer throughput (reference NumPy / torch / gguf.quants) ...")]


def test_the_records_write_and_print_what_the_dict_based_bench_did():
    """tests/fixtures/bench/bench.json / .md: a quick bench on the tiny model, a 1-thread reference worker and the
    tiny-model engines, written by the dict-based code (see the fixtures' README): every table of bench.md."""
    fixtures = Path(__file__).parent / "fixtures" / "bench"
    text = (fixtures / "bench.json").read_text()
    report = PerfReport.from_dict(json.loads(text))
    assert json.dumps(report.to_dict(), indent=2, allow_nan=False) == text
    assert measure.render_markdown(report) == (fixtures / "bench.md").read_text()
    assert list(report.engines) == ["reference", "torch", "reference_1layer_memory", "reference_1thread"]
    assert list(report.tiny_engines) == ["reference", "torch"]
    assert all(isinstance(w, WorkerResult) and all(isinstance(r, TimedRun) for r in w.runs)
               for w in report.engines.values())
    assert isinstance(report.dequant[0], DequantRow) and report.dequant[0].torch_mvs_2t is not None


def test_the_verdict_records_write_and_print_what_the_dict_based_bench_did(tmp_path):
    """tests/fixtures/bench/verdicts.json / .md: a small verdict bench with every row kind, one false DEFECT and one
    misnamed fault, written by the dict-based code (see the fixtures' README)."""
    fixtures = Path(__file__).parent / "fixtures" / "bench"
    report = VerdictsReport.from_dict(json.loads((fixtures / "verdicts.json").read_text()))
    write_verdicts(report, tmp_path)
    for name in ("verdicts.json", "verdicts.md"):
        assert (tmp_path / name).read_bytes() == (fixtures / name).read_bytes(), name
    assert render_verdicts_markdown(report) == (fixtures / "verdicts.md").read_text()
    assert [type(r) for r in report.rows] == [CorrectRow, CorrectRow, FaultRow, FaultRow, TieRow, TieRow]
    assert summarize(report.rows) == report.summary   # the stored aggregates are those of the stored rows
    s = report.summary
    assert (s.correct.false_defects, s.faults.found, len(s.misses), [t.expected for t in s.ties]) == (
        1, 1, 1, ["TIE", "DEFECT"])
    assert report.rows[0].verdict is Verdict.MATCH and report.rows[1].subops is None   # a QAT-off baseline: no key
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.rows[0].seconds = 0.0  # type: ignore[misc]


def test_a_document_with_a_missing_or_unknown_key_is_refused_by_name():
    doc = _document()
    del doc["wall_s"]
    named = r"PerfReport: unknown key\(s\) \['walltime'\], missing key\(s\) \['wall_s'\]"
    with pytest.raises(ParityError, match=named):
        PerfReport.from_dict({**doc, "walltime": 1.0})
    worker = _worker("torch", [4], [2.0], [0.2])
    del worker["runs"][0]["prefill_s"]
    nested = r"PerfReport.engines: WorkerResult.runs: TimedRun: unknown key\(s\) \[\], missing key\(s\) \['prefill_s'\]"
    with pytest.raises(ParityError, match=nested):
        PerfReport.from_dict({**_document(), "engines": {"torch": worker}})
    verdicts = {"alpha": 0.05, "twins": 19, "plan": {}, "rows": [], "summary": summarize([]).to_dict(), "wall_s": 1.0}
    with pytest.raises(ParityError, match=r"missing key\(s\) \['plan_name'\]"):
        VerdictsReport.from_dict(verdicts)
    assert VerdictsReport.from_dict({**verdicts, "plan_name": "quick"}).to_dict() == {**verdicts, "plan_name": "quick"}
    with pytest.raises(ParityError, match=r"VerdictsReport.rows: verdict row: kind 'twin' is not one of"):
        VerdictsReport.from_dict({**verdicts, "plan_name": "quick", "rows": [{"kind": "twin"}]})
