"""`v4parity spec`'s result as data: one run of the speculative driver, its exactness and its attribution.
Printers live in parity/spec/printers.py; the JSON document is `SpecReport.to_dict`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from parity.check.envelope import Envelope
from parity.compare.jsonvalues import json_safe
from parity.contract.engine import Engine
from parity.contract.errors import ParityError
from parity.contract.progress import SILENT, ProgressSink
from parity.gguf.drafter import DrafterConfig
from parity.spec.accept import DEFECT_LABELS, LABELS, Gate
from parity.spec.attribution import RoundAttribution, StateDivergence, attribute, offline_per_slot, online_per_slot
from parity.spec.drafts import DSparkSource, MTPSource, ScriptSource
from parity.spec.driver import Round, SpecRun, speculate
from parity.spec.exactness import Committed, Divergence, committed_verdicts, first_divergence
from parity.tracing.runner import run_sequence


@dataclass(frozen=True)
class SpecReport:
    options: dict[str, Any]               # engine, drafter kind, depth / B, pairing, ring policy, gate, ... (§6.5)
    prompt: tuple[int, ...]
    spec_tokens: tuple[int, ...]          # generated tokens, speculative
    plain_tokens: tuple[int, ...] | None  # the same engine's plain greedy decode (None: a run read from a trace)
    reference_tokens: tuple[int, ...]     # the reference's plain greedy decode
    divergence: Divergence | None
    committed: tuple[Committed, ...]      # every committed token judged on its own prefix (teacher-forced)
    rounds: tuple[Round, ...]
    attribution: tuple[RoundAttribution, ...]
    state_divergence: StateDivergence | None      # None: every state equal (or `state_checked` False)
    state_checked: bool                           # the candidate has the StateView capability
    per_slot: tuple[float | None, ...]            # the candidate's online acceptance per slot
    reference_per_slot: tuple[float | None, ...]  # the reference drafter's offline acceptance per slot
    seconds: dict[str, float]
    state_note: str | None = None                 # why states were not compared, or which part was (partial view)

    @property
    def exact(self) -> bool:
        return self.divergence is None

    @property
    def labels(self) -> dict[str, int]:
        c = Counter(lab for a in self.attribution for lab in a.labels)
        return {k: c.get(k, 0) for k in LABELS}

    @property
    def defects(self) -> list[str]:
        """What makes the exit status 1: a WRONG divergence, a WRONG committed token (teacher-forced), a state
        divergence (not a possible code flip), a defect label."""
        out = [f"WRONG at step {self.divergence.step}"] if self.divergence and self.divergence.cls == "WRONG" else []
        wrong = self.committed_counts["WRONG"]
        if wrong:
            out.append(f"committed WRONG x{wrong}")
        if self.state_divergence is not None and not self.state_flip_possible:
            out.append(f"state {self.state_divergence.component} after round {self.state_divergence.round}")
        dd = self.drafter_divergence
        at = f" (drafter departs at {dd.component} from round {dd.round})" if dd is not None else ""
        labels = [f"{k} x{v}{at if k == 'DRAFTER-DRIFT' else ''}" for k, v in self.labels.items()
                  if k in DEFECT_LABELS and v]
        if dd is not None and not self.labels["DRAFTER-DRIFT"] and not self.flip_possible(dd):
            out.append(f"drafter {dd.component} from round {dd.round}")
        return out + labels

    @property
    def drafter_divergence(self) -> StateDivergence | None:
        """The first round where the candidate's drafter departs from the reference drafter on the candidate's own
        inputs, and the first draft checkpoint that departs (`component`; spec §6.3.4), or None."""
        return next((StateDivergence(n, r.start_pos, *a.drafter) for n, (r, a) in
                     enumerate(zip(self.rounds, self.attribution, strict=True)) if a.drafter is not None), None)

    def flip_possible(self, div: StateDivergence) -> bool:
        """A difference of values only with a QAT simulation on: possibly one FP8 / FP4 code that flipped between
        two paths (spec §4.5.2), noted, not a defect."""
        flags = self.options["flags"]
        return div.kind == "values" and bool(flags["fp8_kv"] or flags["fp4_indexer"])

    @property
    def committed_counts(self) -> dict[str, int]:
        c = Counter(x.cls for x in self.committed)
        return {k: c.get(k, 0) for k in ("MATCH", "TIE", "WRONG")}

    @property
    def state_flip_possible(self) -> bool:
        """The first state difference is one of values with a QAT simulation on: possibly one code flip between
        the batched and the sequential path (spec §4.5.2), noted, not a defect."""
        return self.state_divergence is not None and self.flip_possible(self.state_divergence)

    @property
    def cost(self) -> dict[str, int]:
        """Trunk rows run: drafted, verified (verify batch rows), accepted drafts, replayed, and the rounds; the
        plain decode runs one row per generated token (the prompt aside)."""
        r = self.rounds
        return {"rounds": len(r), "drafted": sum(len(x.drafts) for x in r),
                "verify_rows": sum(x.verified + 1 for x in r), "accepted": sum(x.accepted for x in r),
                "replayed_rows": sum(x.replayed for x in r),
                "snapshots": len(r), "plain_rows": len(self.spec_tokens) - 1}

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per round (tokens committed per round = this + 1)."""
        return float(np.mean([x.accepted for x in self.rounds])) if self.rounds else 0.0

    def first_round(self, labels: Sequence[str]) -> int | None:
        """Index of the first round with one of `labels`, or None."""
        return next((i for i, a in enumerate(self.attribution) if set(a.labels) & set(labels)), None)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: exact, first_divergence ({step, class, spec_induced, position, spec, plain,
        reference, margin, margin_ulps, tie, tie_ulps} or null), labels ({LABEL: count}), rounds ([{start_pos,
        anchor, drafts, confidence, verified, cut, verify, reference, margins, accepted, replayed, labels,
        reference_drafts, seconds}]), acceptance ({per_slot, reference_per_slot, mean}), state_divergence ({round,
        start_pos, component, kind, why} or null; kind shape | non-finite | values), drafter_divergence ({round,
        start_pos, component: the first draft checkpoint where the candidate's drafter departs from the reference
        drafter on the candidate's inputs, kind, why} or null), state_flip_possible (a values difference with QAT
        sims on: noted, not a defect), committed ({counts: {MATCH, TIE, WRONG}, divergent: [{class, step,
        position, token, reference, margin, tie}]}: every committed token judged on its own prefix), state_checked,
        state_note (why not; with a partial view the components compared; else null), cost, tokens, options,
        seconds, defects. A run read from a trace (`--candidate`): spec_induced, plain and tokens.plain null."""
        div = None if self.divergence is None else _with_class(self.divergence)
        rounds = [{**asdict(r), "reference": list(a.reference), "margins": list(a.margins), "ties": list(a.ties),
                   "labels": list(a.labels), "reference_drafts": list(a.reference_drafts)}
                  for r, a in zip(self.rounds, self.attribution, strict=True)]
        return json_safe({"exact": self.exact, "first_divergence": div, "labels": self.labels, "rounds": rounds,
                          "acceptance": {"per_slot": list(self.per_slot),
                                         "reference_per_slot": list(self.reference_per_slot),
                                         "mean": self.mean_accepted},
                          "state_divergence": asdict(self.state_divergence) if self.state_divergence else None,
                          "drafter_divergence": (asdict(self.drafter_divergence) if self.drafter_divergence
                                                 else None),
                          "committed": {"counts": self.committed_counts,
                                        "divergent": [_with_class(x) for x in self.committed if x.cls != "MATCH"]},
                          "state_checked": self.state_checked, "state_note": self.state_note,
                          "state_flip_possible": self.state_flip_possible,
                          "cost": self.cost, "defects": self.defects,
                          "tokens": {"prompt": list(self.prompt), "spec": list(self.spec_tokens),
                                     "plain": None if self.plain_tokens is None else list(self.plain_tokens),
                                     "reference": list(self.reference_tokens)},
                          "options": self.options, "seconds": self.seconds})


def _with_class(x: Divergence | Committed) -> dict[str, Any]:
    """A record's fields with its `cls` spelled "class" (first), as the JSON document holds them."""
    return {"class": x.cls, **{k: v for k, v in asdict(x).items() if k != "cls"}}


def spec_report(cand: Engine, ref: Engine, kind: str, prompt: Sequence[int], steps: int, env: Envelope, *,
                depth: int = 1, gate: Gate | None = None, max_draft: int | None = None,
                reject_at: int | None = None, drafter: DrafterConfig | None = None,
                progress: ProgressSink = SILENT, pairing: str | None = None) -> SpecReport:
    """Run `cand` speculatively (`kind`: mtp | dspark | script), decode plainly with `cand` and `ref`, attribute
    every round with `ref`. `drafter`: the drafter's `DrafterConfig` (DSpark taps and B); scripts draft the
    reference's greedy continuation, the `reject_at`-th draft of each round made wrong (None: accept-all).
    `pairing`: the MTP pairing prev | same (spec §2.3; None: prev), refused for other kinds. `progress.count` counts
    the decodes, the rounds and their attribution."""
    import time

    if steps < 1:
        raise ParityError(f"--steps must be >= 1, got {steps}")
    if pairing is not None and kind != "mtp":
        raise ParityError(f"an MTP pairing ({pairing}) was given for {kind} drafts: it applies to an MTP drafter only")
    if kind == "dspark" and drafter is None:
        raise ParityError("spec_report: a DSpark run needs the drafter's DrafterConfig (taps, B)")
    gate = gate or Gate("none")
    t0 = time.perf_counter()
    ref_tokens, ref_logits = reference_decode(ref, prompt, steps)
    t1 = time.perf_counter()
    progress.count("reference plain decode", steps, steps)
    cand_plain = ref_tokens if cand is ref else [int(np.argmax(r.logits[-1])) for r in run_sequence(cand, prompt,
                                                                                                   steps - 1)]
    t2 = time.perf_counter()
    progress.count("plain decode", steps, steps)
    if kind == "script":
        source: Any = ScriptSource([*prompt, *ref_tokens], depth, reject_at, cand.config.vocab_size)
        ref_source = None
    elif kind == "mtp":
        pairing = pairing or "prev"
        source, ref_source = MTPSource(cand, depth, pairing), MTPSource(ref, depth, pairing)
    else:
        source, ref_source = DSparkSource(cand, drafter), DSparkSource(ref, drafter)
    run = speculate(cand, source, prompt, steps, gate, max_draft, progress)
    t3 = time.perf_counter()
    attrs, state_div = attribute(ref, ref_source, run, env, progress)
    t4 = time.perf_counter()
    width = max((len(r.drafts) for r in run.rounds), default=0)
    options = {"engine": cand.name, "flags": cand.options.flags(), "drafter": kind,
               "depth": depth if kind != "dspark" else width, "pairing": pairing if kind == "mtp" else None,
               "ring_policy": "replay" if kind == "mtp" else "committed-rows" if kind == "dspark" else None,
               "gate": str(gate), "max_draft": max_draft, "temperature": 0, "tie_break": "first-max",
               "reject_at": reject_at, "envelope_logit_rel": env.logit_rel}
    return assemble(options, run, cand_plain, ref_tokens, ref_logits, attrs, state_div, env,
                    {"reference_plain": t1 - t0, "plain": t2 - t1, "spec": t3 - t2, "attribution": t4 - t3},
                    run.state_scope)


def reference_decode(ref: Engine, prompt: Sequence[int], steps: int) -> tuple[list[int], np.ndarray]:
    """The reference's plain greedy decode of `steps` tokens: the tokens and the rows predicting them [steps, V]."""
    rows = run_sequence(ref, prompt, steps - 1)
    return [int(np.argmax(r.logits[-1])) for r in rows], np.stack([r.logits[-1] for r in rows])


def assemble(options: dict[str, Any], run: SpecRun, plain: Sequence[int] | None, ref_tokens: Sequence[int],
             ref_logits: np.ndarray, attrs: list[RoundAttribution], state_div: StateDivergence | None, env: Envelope,
             seconds: dict[str, float], state_note: str | None = None) -> SpecReport:
    """The report of an attributed run: exactness (against `plain` too unless None), every committed token on its
    own prefix, acceptance per slot."""
    width = max((len(r.drafts) for r in run.rounds), default=0)
    steps, prompt = len(run.generated), run.prompt
    committed = committed_verdicts(run.rounds, attrs, run.generated[0], ref_tokens[0], ref_logits[0], len(prompt),
                                   steps, env)
    return SpecReport(options, tuple(prompt), tuple(run.generated), None if plain is None else tuple(plain),
                      tuple(ref_tokens), first_divergence(run.generated, plain, ref_tokens, ref_logits, len(prompt),
                                                          env),
                      tuple(committed), tuple(run.rounds), tuple(attrs), state_div, bool(run.states),
                      tuple(online_per_slot(run.rounds, width)),
                      tuple(offline_per_slot(run.rounds, attrs, run.tokens, width)), seconds, state_note)
