"""Compare two top-k logprob runs step by step (reference A, candidate B).

Per aligned greedy step: token agreement, the shared tie-aware verdict (`parity.compare.verdict`), top-k
Jaccard, Δlogprob and rank displacement on shared tokens, KL(A‖B) and JS(A,B) as BOUNDS (a top-k list
does not give the whole distribution), the unseen tail mass of each side, and ds4_test's criterion.
Both runs are free-running greedy, so once their tokens differ the later steps see different contexts
and are not compared. A greedy-only side (official API vectors: alternatives at -9999) is compared by
tokens only.

Bounds for top-k-truncated distributions p (A) and q (B), with S = tokens listed by both:
* KL(p‖q) >= Σ_S p log(p/q) + P log(P/Q), with P = 1 - Σ_S p and Q = 1 - Σ_S q (merging the unlisted
  tokens into one cell can only lower an f-divergence: data processing). No finite upper bound exists
  while P > 0 (B's probability of a token it did not list can be arbitrarily small), so it is inf.
* JS: the same merged-cell lower bound; upper bound Σ_S js(p, q) + ln2/2 · (P + Q), because each
  unlisted token adds at most ln2/2 · (p_i + q_i).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from parity.compare.jsonvalues import json_safe
from parity.compare.verdict import StepVerdict, classify_step
from parity.contract.errors import ParityError
from parity.logprobs import printers
from parity.logprobs.io import LogprobRun, Step, Tok

# Defaults for the verdict, in nats of logprob. 0.1 is about the bf16 rounding of a logit of size ~25
# (2^-8 · 25); pass the noise envelope you measured for your engine instead where you have it.
TIE_MARGIN = 0.1
DRIFT_TOL = 0.1
# ds4_test --logprob-vectors: each reference top token must be in the candidate's top 20 with
# |Δlogprob| <= 4 nats in float32 (`fabsf(local - official) > 4.0f` fails), the first local entry with
# the same bytes counting, and the selected tokens must be equal (tests/ds4_test.c).
DS4_TEST_TOP = 20
DS4_TEST_MAX_DELTA = 4.0
# Cases ds4_test skips (`test_logprob_vector_case_disabled`): ds4's own graph disagrees with the API there.
DS4_TEST_SKIPPED = ("long_memory_archive",)
TAIL_EPS = 1e-6        # listed mass this close to 1 is float rounding, not an unseen tail
FAIL_ON = ("match", "drift", "tie", "wrong", "ds4-test")
_GATE_VERDICT = {"match": StepVerdict.MATCH, "drift": StepVerdict.DRIFT, "tie": StepVerdict.TIE_FLIP,
                 "wrong": StepVerdict.WRONG}


@dataclass(frozen=True)
class Divergence:
    """Bounds on KL(p‖q) and JS(p, q) and the unlisted ("tail") mass of each side."""

    kl_lower: float
    kl_upper: float
    js_lower: float
    js_upper: float
    tail_ref: float
    tail_cand: float


@dataclass(frozen=True)
class StepCompare:
    """One step of the alignment, built once by `compare_step` (compared) or `compare_runs` (not compared)."""

    step: int
    ref_token: str | None
    cand_token: str | None
    same_token: bool | None = None
    verdict: StepVerdict | None = None  # MATCH / TIE-FLIP / DRIFT / WRONG; None when not compared
    ref_margin: float | None = None     # A's logprob gap between its top-1 and B's pick
    k: int | None = None                # entries per side used for the Jaccard
    jaccard: float | None = None
    n_shared: int | None = None
    max_abs_dlogprob: float | None = None
    mean_abs_dlogprob: float | None = None
    max_rank_shift: int | None = None
    mean_rank_shift: float | None = None
    divergence: Divergence | None = None
    ds4_test: bool | None = None
    ds4_test_detail: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.verdict is not None:   # a spelled verdict becomes the member; a mistyped one is an error naming it
            object.__setattr__(self, "verdict", StepVerdict(self.verdict))


class LogprobPreflightError(ParityError):
    """The two logprob files come from different runs (prompt length, top_k or ctx differ)."""


def preflight(ref: LogprobRun, cand: LogprobRun) -> tuple[list[str], list[str]]:
    """(problems, notes): why two files are not the same run -- prompt_tokens / top_k / ctx both files record and
    that differ -- and the differences that do not matter.

    prompt_tokens and top_k are compared between two ds4 dumps (an official file's prompt count is the API's
    and its top 20 is not a run setting of ours); ctx wherever both record it (a dump, an official.vec case). A
    different ctx matters only when the run does not fit in the smaller one (ds4 stops a run at ctx -
    prompt_tokens - 1 steps): when it fits, the difference is a note and the files are compared.
    """
    problems, notes = [], []
    keys = ("prompt_tokens", "top_k", "ctx") if ref.format == cand.format == "ds4-dump" else ("ctx",)
    for k in keys:
        a, b = ref.meta.get(k), cand.meta.get(k)
        if a is None or b is None or a == b:
            continue
        if k != "ctx":
            problems.append(f"{k} differs: A {a}, B {b}")
            continue
        fits, run = _fits(ref, cand, min(a, b))
        if fits:
            notes.append(f"ctx differs (A {a}, B {b}); compared: the run ({run}) fits in the smaller ctx")
        else:
            problems.append(f"ctx differs: A {a}, B {b} ({run})")
    return problems, notes


def _fits(ref: LogprobRun, cand: LogprobRun, ctx: int) -> tuple[bool, str]:
    """Whether the longer of the two runs fits in `ctx` (prompt + steps + 1 <= ctx, ds4's cap), and the run in
    words; a run whose prompt length neither file records does not fit (it cannot be told)."""
    steps = max(len(ref.steps), len(cand.steps))
    counts = [n for n in (ref.meta.get("prompt_tokens"), cand.meta.get("prompt_tokens")) if n is not None]
    if not counts:
        return False, f"{steps} steps, prompt length not recorded: whether it fits the smaller ctx is unknown"
    n = max(counts)
    fits = n + steps + 1 <= ctx
    return fits, f"{n} prompt tokens + {steps} steps{'' if fits else f' does not fit in ctx {ctx}'}"


@dataclass(frozen=True)
class Comparison:
    """Two logprob runs compared step by step, built once by `compare_runs`; printers in
    `parity.logprobs.printers`."""

    ref: str
    cand: str
    greedy_only: bool
    tie_margin: float
    drift_tol: float
    steps: tuple[StepCompare, ...]
    notes: tuple[str, ...]
    ds4_test_na: str                    # why ds4_test's rule does not apply (empty: it applies)

    @property
    def compared(self) -> list[StepCompare]:
        return [s for s in self.steps if s.verdict is not None]

    def counts(self) -> dict[str, int]:
        return {v.value: sum(s.verdict is v for s in self.compared) for v in StepVerdict}

    def first_divergent_step(self) -> int | None:
        """First step where the greedy tokens differ."""
        return next((s.step for s in self.compared if not s.same_token), None)

    def first_non_match_step(self) -> int | None:
        return next((s.step for s in self.compared if s.verdict is not StepVerdict.MATCH), None)

    @property
    def incomplete(self) -> bool:
        """B stops before A does: some reference step has no candidate step."""
        return any(s.cand_token is None for s in self.steps)

    def ds4_test(self) -> bool | None:
        """ds4_test's verdict over the compared steps (None = n/a: B has no logprobs, a top_k < 20 dump, a
        case ds4_test skips). A B that stops early fails, as it would in ds4_test."""
        if self.ds4_test_na:
            return None
        checks = [s.ds4_test for s in self.compared]
        if not checks or any(c is None for c in checks):
            return None
        return all(checks) and not self.incomplete

    def failures(self, fail_on: Iterable[str]) -> list[str]:
        """The gates (see FAIL_ON) this comparison trips."""
        out = []
        counts = self.counts()
        for gate in fail_on:
            if gate == "ds4-test":
                if self.ds4_test() is False:
                    out.append("ds4-test")
            elif counts[_GATE_VERDICT[gate]]:
                out.append(gate)
        return out

    def summary_line(self) -> str:
        """The one-line summary (`parity.logprobs.printers.summary_line`)."""
        return printers.summary_line(self)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: every field, the counts and first steps, ds4_test, incomplete and the summary line;
        non-finite values spelled by `json_safe` (an infinite bound is the string "inf")."""
        d = asdict(self)
        d.update(counts=self.counts(), first_divergent_step=self.first_divergent_step(),
                 first_non_match_step=self.first_non_match_step(), ds4_test=self.ds4_test(),
                 incomplete=self.incomplete, summary=printers.summary_line(self))
        return json_safe(d)


def _xlogy(x: float, y: float) -> float:
    """x log(x / y) with 0 log 0 = 0 and x log(x / 0) = inf."""
    if x <= 0.0:
        return 0.0
    return math.inf if y <= 0.0 else x * math.log(x / y)


def _js_term(a: float, b: float) -> float:
    """One cell of the Jensen-Shannon divergence: ½[a log(2a/(a+b)) + b log(2b/(a+b))]."""
    m = 0.5 * (a + b)
    return 0.5 * (_xlogy(a, m) + _xlogy(b, m))


def truncated_divergence(ref: dict[bytes, float], cand: dict[bytes, float]) -> Divergence:
    """KL(p‖q)/JS bounds from two top-k lists of logprobs (keys: token bytes); see the module docstring."""
    shared = ref.keys() & cand.keys()
    p = {t: math.exp(lp) for t, lp in ref.items()}
    q = {t: math.exp(lp) for t, lp in cand.items()}
    tail_p = max(0.0, 1.0 - sum(p.values()))
    tail_q = max(0.0, 1.0 - sum(q.values()))
    rest_p = max(0.0, 1.0 - sum(p[t] for t in shared))
    rest_q = max(0.0, 1.0 - sum(q[t] for t in shared))
    kl_s = sum(_xlogy(p[t], q[t]) for t in shared)
    js_s = sum(_js_term(p[t], q[t]) for t in shared)
    # A's listed mass is all of it when rest_p is within rounding; otherwise pad Q by TAIL_EPS, since
    # rounding may under-state B's unlisted mass and a larger Q only lowers the bound
    kl_rest, kl_upper = (0.0, kl_s) if rest_p <= TAIL_EPS else (_xlogy(rest_p, rest_q + TAIL_EPS), math.inf)
    js_upper = min(math.log(2.0), js_s + 0.5 * math.log(2.0) * (rest_p + rest_q))
    return Divergence(max(0.0, kl_s + kl_rest), kl_upper, js_s + _js_term(rest_p, rest_q), js_upper, tail_p, tail_q)


def ds4_test_check(ref: Step, cand: Step) -> tuple[bool, str]:
    """ds4_test's per-step criterion, exactly: B's selected bytes equal A's; every entry ds4_test checks
    (`Step.ds4_tops`) is found in B's top 20 -- the first entry with the same bytes -- and
    |Δlogprob| <= 4 in float32. ds4 never spells EOS the API's way, so such an A entry is missing locally."""
    if ref.selected.api_eos or ref.selected != cand.selected:
        return False, f"selected token mismatch: {ref.selected.label()} vs {cand.selected.label()}"
    local = cand.top[:DS4_TEST_TOP]
    for t, lp in ref.ds4_tops if ref.ds4_tops is not None else ref.top:
        hit = None if t.api_eos else next((c_lp for c, c_lp in local if c.data == t.data), None)
        if hit is None:
            return False, f"reference top token {t.label()} missing from the candidate's top {DS4_TEST_TOP}"
        delta = abs(np.float32(hit) - np.float32(lp))
        if delta > np.float32(DS4_TEST_MAX_DELTA):
            return False, f"{t.label()}: |Δlogprob| = {float(delta):.9g} > {DS4_TEST_MAX_DELTA}"
    return True, ""


def _ds4_test_na(ref: LogprobRun, cand: LogprobRun) -> str:
    """Why ds4_test's rule cannot be applied to this pair ('' when it can)."""
    case = ref.meta.get("case") or ref.meta.get("id")
    if case in DS4_TEST_SKIPPED:
        return f"ds4_test skips case {case}"
    if cand.format == "ds4-dump" and cand.top_k is not None and cand.top_k < DS4_TEST_TOP:
        return f"B lists top {cand.top_k} < {DS4_TEST_TOP}"
    return ""


def _shared_stats(ref: Step, cand: Step) -> dict[str, Any]:
    """The StepCompare fields of two scored top-k lists: k, Jaccard, shared count, Δlogprob, rank shift, bounds."""
    rank_r = {t.data: r for r, (t, _) in enumerate(ref.top)}
    rank_c = {t.data: r for r, (t, _) in enumerate(cand.top)}
    lp_r, lp_c = dict((t.data, lp) for t, lp in ref.top), dict((t.data, lp) for t, lp in cand.top)
    shared = [t for t in rank_r if t in rank_c]
    k = min(len(ref.top), len(cand.top))
    top_r, top_c = {t.data for t, _ in ref.top[:k]}, {t.data for t, _ in cand.top[:k]}
    out: dict[str, Any] = {"k": k, "jaccard": len(top_r & top_c) / len(top_r | top_c), "n_shared": len(shared),
                           "divergence": truncated_divergence(lp_r, lp_c)}
    if shared:
        d = [abs(lp_c[t] - lp_r[t]) for t in shared]
        shifts = [abs(rank_r[t] - rank_c[t]) for t in shared]
        out.update(max_abs_dlogprob=max(d), mean_abs_dlogprob=sum(d) / len(d),
                   max_rank_shift=max(shifts), mean_rank_shift=sum(shifts) / len(shifts))
    return out


def compare_step(ref: Step, cand: Step, *, greedy_only: bool, cand_has_logprobs: bool,
                 tie_margin: float, drift_tol: float, keys: dict[bytes, int]) -> StepCompare:
    """One aligned step. `keys` maps token bytes to the integer ids `classify_step` works on."""
    def key(t: Tok) -> int:
        return keys.setdefault(t.data, len(keys))

    fields: dict[str, Any] = {}
    if greedy_only or not ref.top or not cand.top:  # no usable scores: the verdict rests on the tokens alone
        verdict, _ = classify_step([(key(ref.selected), 0.0)], [(key(cand.selected), 0.0)], 0.0, 0.0)
        margin = None
        if not greedy_only:
            fields["note"] = "a side lists no scored entry at this step: tokens compared only"
    else:
        verdict, margin = classify_step([(key(t), lp) for t, lp in ref.top], [(key(t), lp) for t, lp in cand.top],
                                        tie_margin, drift_tol)
        fields.update(_shared_stats(ref, cand))
    if cand_has_logprobs:
        fields["ds4_test"], fields["ds4_test_detail"] = ds4_test_check(ref, cand)
    return StepCompare(ref.index, ref.selected.label(), cand.selected.label(), ref.selected == cand.selected,
                       verdict=verdict, ref_margin=margin, **fields)


def _align(ref: LogprobRun, cand: LogprobRun, greedy_only: bool, tie_margin: float,
           drift_tol: float) -> tuple[StepCompare, ...]:
    """Every step of the longer run: compared while the greedy tokens agree, noted (not compared) after."""
    keys: dict[bytes, int] = {}
    steps: list[StepCompare] = []
    diverged_at = None
    for i in range(max(len(ref.steps), len(cand.steps))):
        a = ref.steps[i] if i < len(ref.steps) else None
        b = cand.steps[i] if i < len(cand.steps) else None
        if a is None or b is None:
            only = "A" if b is None else "B"
            steps.append(StepCompare(i, a.selected.label() if a else None, b.selected.label() if b else None,
                                     note=f"only in {only}"))
        elif diverged_at is not None:
            steps.append(StepCompare(i, a.selected.label(), b.selected.label(),
                                     note=f"not compared: contexts differ since step {diverged_at}"))
        else:
            steps.append(compare_step(a, b, greedy_only=greedy_only, cand_has_logprobs=not cand.greedy_only,
                                      tie_margin=tie_margin, drift_tol=drift_tol, keys=keys))
            if not steps[-1].same_token:
                diverged_at = i
    return tuple(steps)


def _run_notes(ref: LogprobRun, cand: LogprobRun, greedy_only: bool) -> list[str]:
    """The notes on the two runs as a whole: greedy-only sides, prompt lengths, finish reasons, step counts."""
    notes = []
    if greedy_only:
        both = ref.greedy_only and cand.greedy_only
        side = "A and B carry" if both else ("A" if ref.greedy_only else "B") + " carries"
        notes.append(f"{side} greedy tokens only (alternatives at -9999 or none): tokens are compared, "
                     "KL/JS/Jaccard/Δlogprob are not computed, and a tie cannot be told from a wrong token")
    n_a, n_b = ref.meta.get("prompt_tokens"), cand.meta.get("prompt_tokens")
    if n_a is not None and n_b is not None and n_a != n_b:
        notes.append(f"prompt lengths differ (A {n_a} tokens, B {n_b}): check that both rendered the same prompt")
    for name, run in (("A", ref), ("B", cand)):
        if run.meta.get("finish_reason"):
            notes.append(f"{name} finish_reason: {run.meta['finish_reason']}")
    if len(ref.steps) != len(cand.steps):
        notes.append(f"A has {len(ref.steps)} steps, B has {len(cand.steps)}: extra steps are not compared")
    return notes


def compare_runs(ref: LogprobRun, cand: LogprobRun, tie_margin: float = TIE_MARGIN,
                 drift_tol: float = DRIFT_TOL, force: bool = False) -> Comparison:
    """Align the two runs' steps and compare each (A is the reference).

    Raises LogprobPreflightError when the files come from different runs (see `preflight`), unless `force`
    (then the refusals become notes)."""
    problems, fit_notes = preflight(ref, cand)
    if problems and not force:
        where = lambda r: r.path + (f"#{r.meta['case']}" if "case" in r.meta else "")  # noqa: E731
        raise LogprobPreflightError(f"refusing to compare logprobs of different runs (A {where(ref)}, B {where(cand)}; "
                                    "--force compares anyway): " + "; ".join(problems))
    greedy_only = ref.greedy_only or cand.greedy_only
    return Comparison(ref.describe(), cand.describe(), greedy_only, tie_margin, drift_tol,
                      _align(ref, cand, greedy_only, tie_margin, drift_tol),
                      (*fit_notes, *(f"forced: {p}" for p in problems), *_run_notes(ref, cand, greedy_only)),
                      _ds4_test_na(ref, cand))
