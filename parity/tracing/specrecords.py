"""`spec` records: one text line per speculative round of an engine's run (docs/trace-format.md "Spec records").

    spec <r> pos <start_pos>: drafts=<-|d_1,..,d_k> verified=<γ> cut=<-|gate|max-draft|budget> verify=<v_0,..,v_γ>
        accepted=<a'> conf=<-|c_1,..,c_k>

r counts the rounds from 0; start_pos = c + 1 is the anchor's position (the first verify row); the drafts are all k
drafted (the cut ones too; `-`: none, a round that only commits the anchor row's argmax); γ of them went into the
verify batch, `cut` says why γ < k (`-` exactly when γ = k); v_0..v_γ are the verify rows' argmaxes; a' the
drafts accepted; conf the DSpark raw confidence logits (`-`: none).
Every field is checked on its line (`parse_spec`), the rounds against each other and against the header's tokens
(`check_spec`): round r starts where round r-1's commits end (the first at n_prompt), a' is the greedy rule's
(the longest prefix with d_i = v_{i-1}), and the committed d_1..d_{a'} and bonus v_{a'} are the header's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from parity.contract.errors import TraceError

CUTS = ("gate", "max-draft", "budget")
FIELDS = ("drafts", "verified", "cut", "verify", "accepted", "conf")


@dataclass(frozen=True)
class SpecRecord:
    """One round as recorded. `where` (FILE:LINE of a read record, '' when built in memory) is not compared."""

    round: int
    start_pos: int
    drafts: tuple[int, ...]
    verified: int
    cut: str                       # '' | gate | max-draft | budget
    verify: tuple[int, ...]
    accepted: int
    conf: tuple[float, ...] | None
    where: str = field(default="", compare=False)


def greedy_accept(drafts: Sequence[int], verify: Sequence[int]) -> int:
    """a' = the longest prefix of `drafts` with d_i = v_{i-1} (spec v4-mtp-dspark §4.1)."""
    n = 0
    while n < len(drafts) and drafts[n] == verify[n]:
        n += 1
    return n


def format_spec(r: SpecRecord, fmt: Callable[[float], str]) -> str:
    """The record's text line (`fmt`: the trace's float format, %.9g)."""
    conf = "-" if r.conf is None else ",".join(fmt(c) for c in r.conf)
    return (f"spec {r.round} pos {r.start_pos}: drafts={','.join(map(str, r.drafts)) or '-'} verified={r.verified} "
            f"cut={r.cut or '-'} verify={','.join(map(str, r.verify))} accepted={r.accepted} conf={conf}")


def parse_spec(ln, words: list[str], kv: dict[str, str], need: Callable[..., None]) -> SpecRecord:
    """One `spec` line (`ln`: the reader's line object with int/ints/floats/fail; `need`: its required-fields
    check). Checks what the line alone decides: the counts, γ <= k, cut `-` exactly when γ = k, γ + 1 verify ids,
    a' the greedy rule's."""
    if len(words) != 4 or words[2] != "pos":
        raise ln.fail("record", "expected 'spec <round> pos <start_pos>: drafts=... verified=... cut=... verify=... "
                                "accepted=... conf=...'")
    rnd, start = ln.int("round", words[1]), ln.int("pos", words[3])
    need(ln, kv, FIELDS)
    drafts = [] if kv["drafts"] == "-" else ln.ints("drafts", kv["drafts"], None)
    if not drafts and kv["drafts"] != "-":
        raise ln.fail("drafts", "the round's k drafts, cut ones included, or '-' for none")
    gamma = ln.int("verified", kv["verified"], 0, len(drafts))
    cut = kv["cut"]
    if cut != "-" and cut not in CUTS:
        raise ln.fail("cut", f"expected -, {', '.join(CUTS)}; got {cut[:40]!r}")
    if (cut == "-") != (gamma == len(drafts)):
        raise ln.fail("cut", f"{gamma} of {len(drafts)} drafts verified: cut is '-' exactly when all are, got {cut!r}")
    verify = ln.ints("verify", kv["verify"], gamma + 1)
    accepted = ln.int("accepted", kv["accepted"], 0, gamma)
    rule = greedy_accept(drafts[:gamma], verify)
    if accepted != rule:
        raise ln.fail("accepted", f"{accepted}, but the greedy rule (the longest prefix with d_i = v_(i-1)) accepts "
                                  f"{rule} of drafts {drafts[:gamma]} with verify {verify}")
    conf = None if kv["conf"] == "-" else tuple(ln.floats("conf", kv["conf"], len(drafts)))
    return SpecRecord(rnd, start, tuple(drafts), gamma, "" if cut == "-" else cut, tuple(verify), accepted, conf,
                      f"{ln.source}:{ln.lineno}")


def check_spec(records: Sequence[SpecRecord], tokens: Sequence[int], n_prompt: int,
               fail: Callable[[SpecRecord | None, str, str], TraceError]) -> None:
    """The rounds against each other and the header's tokens (module docstring). `fail(record, field, message)`
    names the record's line (None: the file)."""
    pos = n_prompt
    for i, r in enumerate(records):
        if r.round != i:
            raise fail(r, "round", f"round {r.round}, expected {i} (rounds are numbered from 0 in order)")
        if r.start_pos != pos:
            raise fail(r, "pos", f"round {i} starts at position {r.start_pos}, but the "
                                 + ("prompt ends" if i == 0 else "previous round's commits end") + f" at {pos}")
        if pos >= len(tokens):
            raise fail(r, "pos", f"position {pos} is past the header's {len(tokens)} tokens")
        committed = [*r.drafts[: r.accepted], r.verify[r.accepted]]
        for j, t in enumerate(committed, start=pos + 1):
            if j < len(tokens) and tokens[j] != t:
                raise fail(r, "verify" if j == pos + len(committed) else "drafts",
                           f"commits token {t} at position {j}, but the header's tokens say {tokens[j]}")
        pos += r.accepted + 1
    if len(tokens) > n_prompt + 1 and pos < len(tokens) - 1:
        raise fail(None, "spec", f"the spec records commit tokens up to position {pos}, the header's tokens go on to "
                                 f"{len(tokens) - 1}: a round is missing")
