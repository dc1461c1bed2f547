"""Small runs of the reports that emit verdicts, shared by tests/test_verdict_types.py and the script that wrote
its fixture (`python tests/verdict_cases.py OUT_DIR`, run once on the code before the typed verdicts).

`check_documents`: `check` on the tiny f32 model (traces written by the torch engine, every position, full vectors)
for a clean candidate and a `sink-dropped` one: each report's JSON document and plain text, timings zeroed (the
only values that change from run to run)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

TRACES = Path(__file__).resolve().parent.parent / "traces"
ENV_F32 = TRACES / "tiny-f32.envelope.json"
DECODE = 4
CASES = {"clean": (), "sink-dropped": ("sink-dropped",)}


def _check(model: Path, inject: tuple[str, ...], work: Path, prompt: list[int], forced: list[int]) -> Any:
    from parity import api
    from parity.contract.engine import RunOptions

    t = api.trace("torch", model, prompt, positions="all", full="all", decode=DECODE, forced=forced,
                  options=RunOptions(inject=inject))
    path = work / f"{'-'.join(inject) or 'clean'}.trace"
    api.save_trace(t, path)
    return api.check(path, model, envelope=ENV_F32)


def check_reports(model: Path, work: Path) -> dict[str, Any]:
    """case -> the `CheckReport` of that candidate, timings zeroed."""
    from reference_prompt import prompt_and_forced

    prompt, forced = prompt_and_forced(model, DECODE)
    return {case: replace(_check(model, inject, work, prompt, forced), seconds=0.0, envelope_seconds=0.0)
            for case, inject in CASES.items()}


def documents(report: Any) -> dict[str, Any]:
    """{"json": the JSON document, "text": the plain-text report} of one check report."""
    from parity.check.check_report import to_text

    doc = json.loads(json.dumps(report.to_dict()))
    doc["envelope"]["source"] = Path(doc["envelope"]["source"]).name   # the checkout's path is not the report's
    return {"json": doc, "text": to_text(report)}


def bisect_reports() -> dict[str, Any]:
    """case -> a `BisectReport` on tests/test_bisect_fake.py's NumPy engine (clean; a defect at layer 1's
    attention; the candidate rounding its layer outputs to bf16, which the float32 envelope calls noise or a
    defect), timings zeroed."""
    from test_bisect_fake import PROMPT, FakeEngine

    from parity.bisect.search import bisect
    from parity.check.envelope import measure_envelope
    from parity.contract.engine import RunOptions

    env = measure_envelope(FakeEngine(), FakeEngine(RunOptions(dtype="float64")), FakeEngine(), PROMPT[:10], 3)
    cands = {"clean": FakeEngine(), "attention": FakeEngine(defect=(1, "attention")),
             "bf16": FakeEngine(RunOptions(dtype="bfloat16"))}
    return {case: replace(bisect(FakeEngine(), c, PROMPT, 2, env), seconds={}) for case, c in cands.items()}


def torch_bisect_report(model: Path) -> Any:
    """`bisect` of the torch engine (float32) against the reference on the tiny f32 model, the built-in prompt and
    4 decode steps (tests/test_bisect_engines.py's clean case: NOISE with a QAT code flip named), timings zeroed."""
    from parity.bisect.search import bisect, builtin_prompt
    from parity.check.envelope import load_envelope
    from parity.contract.engine import RunOptions, load_engine
    from parity.gguf.weights import Weights

    ref = load_engine("reference", str(model), RunOptions())
    cand = load_engine("torch", str(model), RunOptions())
    env = load_envelope(ENV_F32, "float32", Weights(model).identity())
    r = bisect(ref, cand, builtin_prompt(ref.config.vocab_size, ref.config.bos_token_id), DECODE, env)
    return replace(r, seconds={})


def bisect_documents(report: Any) -> dict[str, Any]:
    """{"json": the JSON document, "text": the summary} of one bisect report."""
    from parity.bisect.bisect_report import summary

    return {"json": json.loads(json.dumps(report.to_dict())), "text": summary(report)}


def main(out: Path) -> None:
    import tempfile

    from parity.gguf.synth import synthesize

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny-f32.gguf"
        synthesize(model, "tiny", "f32", seed=0)   # as tests/conftest.py's tiny_f32
        for case, report in check_reports(model, Path(tmp)).items():
            (out / f"check_{case}.json").write_text(json.dumps(documents(report), indent=1) + "\n")
        doc = bisect_documents(torch_bisect_report(model))
        (out / "bisect_torch_clean.json").write_text(json.dumps(doc, indent=1) + "\n")
    for case, report in bisect_reports().items():
        (out / f"bisect_{case}.json").write_text(json.dumps(bisect_documents(report), indent=1) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(Path(sys.argv[1]))
