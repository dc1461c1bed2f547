"""The speculative greedy driver over the Engine protocol (spec v4-mtp-dspark §4.1, §4.4).

A round, with the committed prefix ending in the anchor t_{c+1} (the trunk has run positions 0..c):
1. draft: the source writes the trunk rows of the positions committed last round and drafts d_1..d_k;
2. cut: the gate, --max-draft and the step budget keep γ <= k drafts (the rest are NOT-VERIFIED);
3. verify: snapshot the trunk state, run [t_{c+1}, d_1..d_γ] at positions c+1..c+1+γ as one prefill chunk;
   v_i = first-max argmax of row i (the engine's own pick when it has the `VerifyPicks` capability);
4. accept: a' = the longest prefix with d_i = v_{i-1}; commit d_1..d_{a'} and the bonus v_{a'} (the next anchor;
   an engine with `VerifyPicks` names the row it continues from);
5. restore: when a' < γ, the snapshot replaces the state and the a' + 1 accepted rows are run again (replay), so the
   state is exactly the one the committed prefix leaves (compressors are recurrent: no truncation, §4.4).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from parity.contract.engine import Engine, PartialStateView, StateView, VerifyPicks
from parity.contract.errors import ParityError
from parity.contract.progress import SILENT, ProgressSink
from parity.spec.accept import Gate, accept_length, first_max
from parity.spec.drafts import DSparkSource, MTPSource, Proposal, ScriptSource, need_snapshots
from parity.tracing.runner import forward_chunk

Source = MTPSource | DSparkSource | ScriptSource


@dataclass(frozen=True)
class Round:
    """One round. start_pos = c + 1, the anchor's position (first verify row); drafts d_1..d_k as drafted;
    verified = γ (drafts in the verify batch); cut = why γ < k (gate | max-draft | budget | ''); verify = the
    candidate's argmaxes v_0..v_γ; accepted = a'; replayed = rows run again after the restore (0 or a' + 1);
    bonus = the committed token after the accepted drafts, the next anchor, when it is not v_{a'} (None: v_{a'});
    not_first_max = the verify rows whose pick is not the first maximum of the candidate's own logits row (§4.2)."""

    start_pos: int
    anchor: int
    drafts: tuple[int, ...]
    confidence: tuple[float, ...] | None
    verified: int
    cut: str
    verify: tuple[int, ...]
    accepted: int
    replayed: int
    seconds: dict[str, float]          # draft, verify, replay
    bonus: int | None = None
    not_first_max: tuple[int, ...] = ()

    @property
    def next_anchor(self) -> int:
        """The token committed after the accepted drafts (the bonus, the next round's anchor)."""
        return self.verify[self.accepted] if self.bonus is None else self.bonus

    @property
    def row_tokens(self) -> tuple[int, ...]:
        """The token committed from each verify row j <= a' (v_j, the bonus at row a'), then v_j for the rest."""
        a = self.accepted
        return (*self.verify[:a], self.next_anchor, *self.verify[a + 1 :])


@dataclass
class SpecRun:
    """A speculative run: the committed tokens (prompt + generated), its rounds, and the drafter inputs fed before
    each round's draft (inputs[r] covers positions feed_first[r]..start_pos - 1 of round r), and the trunk and drafter
caches after each round's commit (`state_view`)."""

    prompt: list[int]
    tokens: list[int]
    rounds: list[Round] = field(default_factory=list)
    inputs: list[np.ndarray] = field(default_factory=list)
    feed_first: list[int] = field(default_factory=list)
    states: list[dict[str, np.ndarray]] = field(default_factory=list)  # after each round (engines with StateView)
    state_scope: str | None = None   # a PartialStateView's note: which components `states` holds (None: all)
    draft_checkpoints: list[dict[str, np.ndarray]] = field(default_factory=list)   # each round's (Proposal)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]


def cut_drafts(proposal: Proposal, gate: Gate, max_draft: int | None, budget: int) -> tuple[int, str]:
    """γ and the reason it is below k: the gate first, then --max-draft, then the step budget (`budget` = the
    tokens still to generate minus the bonus)."""
    k = len(proposal.drafts)
    gamma, cut = gate.keep(proposal.confidence, k), ""
    if gamma < k:
        cut = "gate"
    if max_draft is not None and max_draft < gamma:
        gamma, cut = max_draft, "max-draft"
    if budget < gamma:
        gamma, cut = max(budget, 0), "budget"
    return gamma, cut


def speculate(engine: Engine, source: Source, prompt: Sequence[int], steps: int, gate: Gate,
              max_draft: int | None = None, progress: ProgressSink = SILENT) -> SpecRun:
    """Generate `steps` tokens after `prompt` by speculative greedy rounds (module docstring); `progress.count`
    counts the generated tokens."""
    if steps < 1:
        raise ParityError(f"--steps must be >= 1, got {steps}")
    if max_draft is not None and max_draft < 0:
        raise ParityError(f"--max-draft must be >= 0, got {max_draft}")
    snapshot, restore = need_snapshots(engine).snapshot, engine.restore
    picks = engine if isinstance(engine, VerifyPicks) else None
    state = engine.new_state()
    rows = forward_chunk(engine, state, np.asarray(prompt, np.int64), 0)
    run = SpecRun(list(prompt), [*prompt, int(first_max(rows.logits)[-1])])
    first = 0
    while len(run.generated) < steps:
        c = len(run.tokens) - 2
        t0 = time.perf_counter()
        inputs = source.inputs(rows)
        proposal = source.draft(inputs, run.tokens, first)
        run.inputs.append(inputs)
        run.feed_first.append(first)
        run.draft_checkpoints.append(proposal.checkpoints)
        gamma, cut = cut_drafts(proposal, gate, max_draft, steps - len(run.generated) - 1)
        drafts = proposal.drafts[:gamma]
        t1 = time.perf_counter()
        saved = snapshot(state)
        batch = np.concatenate([[run.tokens[-1]], drafts]).astype(np.int64)
        verify_rows = forward_chunk(engine, state, batch, c + 1)
        verify, bonus, off = own_picks(picks, verify_rows.logits, drafts)
        a = accept_length(drafts, verify)
        t2 = time.perf_counter()
        run.tokens += [*map(int, drafts[:a]), int(verify[a]) if bonus is None else bonus]
        rows, replayed = verify_rows, 0
        if a < gamma:
            state = restore(state, saved)
            rows, replayed = forward_chunk(engine, state, batch[: a + 1], c + 1), a + 1
        conf = tuple(map(float, proposal.confidence)) if proposal.confidence is not None else None
        run.rounds.append(Round(c + 1, int(batch[0]), tuple(map(int, proposal.drafts)), conf, gamma, cut,
                                tuple(map(int, verify)), a, replayed,
                                {"draft": t1 - t0, "verify": t2 - t1, "replay": time.perf_counter() - t2},
                                None if bonus == int(verify[a]) else bonus, off))
        if isinstance(engine, StateView):
            run.states.append(state_view(engine, state, source))
        elif isinstance(engine, PartialStateView):
            shown, run.state_scope = engine.visible_state(state)
            run.states.append(shown)
        first = c + 1
        progress.count("spec rounds", min(len(run.generated), steps), steps)
    run.tokens = run.tokens[: len(run.prompt) + steps]
    return run


def own_picks(picks: VerifyPicks | None, logits: np.ndarray, drafts: np.ndarray
              ) -> tuple[np.ndarray, int | None, tuple[int, ...]]:
    """The verify argmaxes v_0..v_γ, the bonus token (None: the rule's, v_{a'}) and the rows whose pick is not the
    first maximum of its own logits row. Without `picks` the driver applies the rules (first maximum, row a')."""
    first = first_max(logits)
    if picks is None:
        return first, None, ()
    verify = np.asarray(picks.verify_argmax(logits), np.int64)
    if verify.shape != first.shape:
        raise ParityError(f"verify_argmax: {verify.shape} picks for {len(first)} verify rows")
    a = accept_length(drafts, verify)
    row = int(picks.next_row(a, len(drafts)))
    if not 0 <= row <= len(drafts):
        raise ParityError(f"next_row: row {row} outside the verify batch's rows 0..{len(drafts)}")
    return verify, int(verify[row]), tuple(int(i) for i in np.flatnonzero(verify != first))


def state_view(engine: StateView, state: object, source: Source) -> dict[str, np.ndarray]:
    """The trunk caches and the drafter's (MTP ring as `mtp.blk.L.*`, DSpark rings as `dspark.*`) as named arrays."""
    out = engine.state_arrays(state)
    if isinstance(source, MTPSource):
        out |= {f"mtp.{k}": v for k, v in engine.state_arrays(source.state).items()}
    elif isinstance(source, DSparkSource):
        out |= engine.state_arrays(source.state)
    return out
