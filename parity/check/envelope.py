"""Noise-floor envelope: the benign drift per checkpoint and per sub-op capture, measured, not guessed.

A quantity passes when `err <= K * floor + EPS` (`gate`), where `floor` is the largest per-position relative
L2 seen between benign pairs of runs on a calibration prompt:
* `oracle`: reference float32 vs reference float64 (the reference's own round-off);
* `rechunk`: the candidate engine, one batched prefill vs a chunked prefill (summation order, cache layout);
* `dtype` (bf16 sections only): candidate bfloat16 vs the same candidate in float32.
A pair is one run: a QAT code flip (or a routing/selection flip) in it would make the whole envelope wide. So the
round-off null measures the pairs: N_TWINS Monte-Carlo twins of the float32 reference (`RoundoffTwins`, the null
`check` judges by, parity.check.null), each free-running against the exact reference, give per quantity the
worst position of each twin (`null`). The quietest twin is plain round-off (with QAT on most twins flip some code
somewhere: median 0.2 rel-L2 at tiny real-mix's last layer, quietest 5e-6). A float32 pair (oracle; rechunk of
a float32 candidate) above K times the quietest twin (+ EPS) is not plain round-off: it is left out of that
floor and listed in `excluded`; a quantity every pair left is floored at the quietest twin. The dtype pair
measures the candidate's own precision, which the float32 null cannot, and always counts. A stored envelope is
checked against its own null when loaded (`contradictions`): a floor above that limit and above the pairs the
float32 null does not cover is refused with the reason, as is a file measured before the null (version 1).
Judging a run is `check`'s job (the round-off null on the candidate's own prompt); the envelope gives `check` its
free-running profile and `bisect` its localisation screen. `diff` / `gate` / `arbitrate` take an `--envelope` only
for the `check` they run (`--check-model` / `--check`): no command judges a run by K x floor on its own.
K = 10: on 30 random clean prompts (tiny f32, real-mix, mxfp4; docs/bisect.md) the err/floor ratio of the
prompts that stayed inside the envelope was 1.2-11 (median 1.4), while every injected fault sits > 1e3 floors
out. EPS = 1e-6 (~16 float32 ulps) covers quantities whose floor measures 0.
Envelopes are stored next to golden traces as `traces/<name>.envelope.json`, one section per candidate dtype.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from parity.check.null import N_TWINS
from parity.compare.metrics import max_abs, rel_l2
from parity.contract.checkpoints import EMBED, FINAL_NORM, LOGITS, block, block_attn
from parity.contract.engine import Engine, LayerOutput, RoundoffTwins, RunOptions
from parity.contract.errors import ParityError
from parity.contract.files import atomic_write_bytes
from parity.contract.progress import SILENT, ProgressSink
from parity.gguf.weights import same_model
from parity.tracing.runner import ChunkResult, chunk_schedule, layer_outputs, run_lockstep, run_sequence, stack

ENVELOPE_VERSION = 2   # 2: floors measured by the round-off null
K = 10.0
EPS = 1e-6
MARGIN_EPS = 1e-6   # router-key gaps are O(1) (sqrt-softplus scores): ~16 float32 ulps
TINY = 1e-30
# Calibration prompt: BOS + seeded random ids, so verdicts are judged on other prompts than the envelope's.
CALIBRATION_SEED, CALIBRATION_LEN, CALIBRATION_DECODE = 11, 28, 6
# Captures that hold discrete choices; they are compared as sets, not by rel-L2 (see bisect.compare_captures).
DISCRETE = ("index_sel", "expert_ids")
# Captures that hold rows emitted so far (cumulative per chunk), compared row by row.
ROW_CAPTURES = ("comp_rows", "index_rows")


def logit_rel_rows(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """m_t = max_v |got_tv - ref_tv| / max_v |ref_tv|  (the logit noise at that logit size).
    ref, got: [T, V] -> [T]"""
    return max_abs(ref, got) / np.maximum(np.abs(np.asarray(ref, np.float64)).max(axis=1), TINY)


def gate(err: np.ndarray | float, floor: float, k: float = K, eps: float = EPS) -> np.ndarray | float:
    """excess = err / (k * floor + eps); > 1 means outside the envelope."""
    return np.asarray(err, np.float64) / (k * floor + eps)


def subop_key(layer: int, capture: str) -> str:
    return f"{layer}:{capture}"


@dataclass
class Envelope:
    """Measured floors for one candidate dtype. Keys: checkpoint names (+ 'logits'), `layer:capture`."""

    dtype: str
    checkpoints: dict[str, float]
    subops: dict[str, float]
    router_margin: dict[str, float]       # per layer: largest |margin_ref - margin_other| on benign pairs
    logit_rel: float                      # largest logit_rel_rows on benign pairs
    components: dict[str, dict[str, float]] = field(default_factory=dict)  # pair -> quantity -> floor
    null: dict[str, list[float]] = field(default_factory=dict)   # quantity -> each twin's worst position, sorted
    excluded: dict[str, list[str]] = field(default_factory=dict)  # pair -> quantities it left out (not round-off)
    calibration: dict = field(default_factory=dict)  # prompt length, decode steps, chunking used
    k: float = K
    eps: float = EPS

    def check_options(self, options: RunOptions) -> None:
        """Refuse to judge a run whose QAT simulations differ from the calibration's."""
        for flag in ("fp8_kv", "fp4_indexer"):
            if self.calibration.get(flag) != getattr(options, flag):
                raise ParityError(f"envelope ({self.dtype}) was measured with {flag}={self.calibration.get(flag)}, "
                                  f"the candidate runs {flag}={getattr(options, flag)}: measure a matching envelope "
                                  "(`v4parity envelope ... -o OTHER.envelope.json`)")

    def floor(self, name: str) -> float:
        if name not in self.checkpoints:
            raise ParityError(f"envelope ({self.dtype}) has no floor for checkpoint {name!r}")
        return self.checkpoints[name]

    def subop_floor(self, layer: int, capture: str) -> float:
        key = subop_key(layer, capture)
        if key not in self.subops:
            raise ParityError(f"envelope ({self.dtype}) has no floor for sub-op capture {capture!r} of layer {layer}")
        return self.subops[key]

    def limit(self, floor: float) -> float:
        """The largest error inside the envelope over `floor`: k * floor + eps (the denominator of `gate`)."""
        return self.k * floor + self.eps

    def excess(self, err: np.ndarray | float, floor: float) -> np.ndarray:
        """`gate` with this envelope's k and eps: err / (k * floor + eps); > 1 is outside."""
        return gate(err, floor, self.k, self.eps)

    def excess_at(self, name: str, err: np.ndarray | float) -> np.ndarray:
        """The excess of an error at checkpoint `name` over its floor."""
        return self.excess(err, self.floor(name))

    def margin_tol(self, layer: int) -> float:
        """A routing flip at a reference router margin <= this is noise: k * measured key drift + MARGIN_EPS."""
        if str(layer) not in self.router_margin:
            raise ParityError(f"envelope ({self.dtype}) has no router-margin drift for layer {layer}")
        return self.k * self.router_margin[str(layer)] + MARGIN_EPS

    def tie_margin(self, logit: float) -> float:
        """Largest top-1/top-2 gap that noise can reorder at logit size |logit|: k * logit_rel * |logit| + eps."""
        return self.k * self.logit_rel * abs(logit) + self.eps


# ---------------------------------------------------------------- measuring

def calibration_prompt(vocab_size: int, bos: int) -> list[int]:
    """BOS + CALIBRATION_LEN - 1 ids drawn with CALIBRATION_SEED from [2, vocab_size)."""
    rng = np.random.default_rng(CALIBRATION_SEED)
    return [bos, *(int(t) for t in rng.integers(2, vocab_size, CALIBRATION_LEN - 1))]


def checkpoint_errors(ref: Sequence[ChunkResult], got: Sequence[ChunkResult]) -> dict[str, np.ndarray]:
    """Per-position rel-L2 of every checkpoint and of the logits: name -> [T]."""
    names = list(ref[0].checkpoints)
    out = {n: rel_l2(stack(ref, n), stack(got, n)) for n in names}
    out[LOGITS] = rel_l2(stack(ref, LOGITS), stack(got, LOGITS))
    return out


def capture_errors(ref: Sequence[LayerOutput], got: Sequence[LayerOutput], layer: int) -> dict[str, float]:
    """Largest per-position (per-row for emitted rows) rel-L2 of every float capture of one layer's runs:
    'layer:name' -> err. Discrete captures (ids) are skipped: they are judged by margins, not floors."""
    out: dict[str, float] = {}
    for name in ref[0].captures:
        if name in DISCRETE:
            continue
        if any(name not in r.captures for r in got):
            raise ParityError(f"a benign run did not fill capture {name!r} at layer {layer}; the envelope needs "
                              "every capture of parity.contract.checkpoints.SUBOPS")
        if name == "expert_weights":
            a, b = _aligned_weights(ref, got)
        elif name in ROW_CAPTURES:
            a, b = ref[-1].captures[name], got[-1].captures[name]
            if a.shape != b.shape:  # a benign pair never differs in emitted rows
                raise ParityError(f"benign runs emitted different {name} at layer {layer}: {a.shape} vs {b.shape}")
        else:
            a = np.concatenate([r.captures[name] for r in ref])
            b = np.concatenate([r.captures[name] for r in got])
        e = rel_l2(a, b) if len(a) else np.zeros(1)
        out[subop_key(layer, name)] = float(e.max())
    return out


def weights_by_id(ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort each position's (id, weight) pairs by id so two engines' choices line up.
    ids, weights: [T, K] -> [T, K], [T, K]"""
    order = np.argsort(ids, axis=1, kind="stable")
    return np.take_along_axis(ids, order, 1), np.take_along_axis(weights, order, 1)


def aligned_weights(ids_a: np.ndarray, w_a: np.ndarray, ids_b: np.ndarray,
                    w_b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Both sides' expert weights sorted by id, and the positions where both chose the same expert set.
    [T, K] x 4 -> [T, K], [T, K], bool [T]"""
    ia, wa = weights_by_id(ids_a, w_a)
    ib, wb = weights_by_id(ids_b, w_b)
    return wa, wb, (ia == ib).all(axis=1)


def _aligned_weights(ref: Sequence[LayerOutput], got: Sequence[LayerOutput]) -> tuple[np.ndarray, ...]:
    """Expert weights of both runs aligned by id, at the positions where both chose the same set."""
    def cat(rs: Sequence[LayerOutput], name: str) -> np.ndarray:
        return np.concatenate([r.captures[name] for r in rs])
    wa, wb, same = aligned_weights(cat(ref, "expert_ids"), cat(ref, "expert_weights"),
                                   cat(got, "expert_ids"), cat(got, "expert_weights"))
    return wa[same], wb[same]


def margin_drift(ref: Sequence[LayerOutput], got: Sequence[LayerOutput]) -> float:
    """One layer: largest |router_margin_ref - router_margin_got| where both chose the same expert set."""
    ma = np.concatenate([r.diag.router_margin for r in ref])
    mb = np.concatenate([r.diag.router_margin for r in got])
    ia = np.sort(np.concatenate([r.diag.expert_ids for r in ref]), axis=1)
    ib = np.sort(np.concatenate([r.diag.expert_ids for r in got]), axis=1)
    same = (ia == ib).all(axis=1) & np.isfinite(ma) & np.isfinite(mb)
    return float(np.abs(ma - mb)[same].max()) if same.any() else 0.0


@dataclass
class PairFloors:
    """The floors of one benign pair, gathered layer by layer (`add_layer`) and at the ends (`add_ends`);
    `floors()` in the order of `pair_floors`: checkpoints, logits, 'logit_rel', 'layer:capture', 'margin:layer'."""

    layers: dict[int, tuple[dict[str, float], dict[str, float], float]] = field(default_factory=dict)
    ends: dict[str, float] = field(default_factory=dict)

    def add_layer(self, layer: int, ref: Sequence[LayerOutput], got: Sequence[LayerOutput]) -> None:
        carriers = {name: float(rel_l2(np.concatenate([getattr(r, what) for r in ref]),
                                       np.concatenate([getattr(g, what) for g in got])).max())
                    for name, what in ((block_attn(layer), "attn_carrier"), (block(layer), "carrier"))}
        captures = capture_errors(ref, got, layer) if ref[0].captures and got[0].captures else {}
        self.layers[layer] = (carriers, captures, margin_drift(ref, got))

    def add_ends(self, ref: Sequence[ChunkResult], got: Sequence[ChunkResult]) -> None:
        for name in (EMBED, FINAL_NORM, LOGITS):
            self.ends[name] = float(rel_l2(stack(ref, name), stack(got, name)).max())
        self.ends["logit_rel"] = float(logit_rel_rows(stack(ref, LOGITS), stack(got, LOGITS)).max())

    def floors(self) -> dict[str, float]:
        layers = [self.layers[l] for l in sorted(self.layers)]
        return {EMBED: self.ends[EMBED], **{k: v for c, _, _ in layers for k, v in c.items()},
                FINAL_NORM: self.ends[FINAL_NORM], LOGITS: self.ends[LOGITS], "logit_rel": self.ends["logit_rel"],
                **{k: v for _, caps, _ in layers for k, v in caps.items()},
                **{f"margin:{l}": m for l, (_, _, m) in zip(sorted(self.layers), layers, strict=True)}}


def pair_floors(ref: Sequence[ChunkResult], got: Sequence[ChunkResult]) -> dict[str, float]:
    """All floors of one benign pair of whole-model runs: checkpoints, 'logit_rel', 'layer:capture',
    'margin:layer'."""
    pair = PairFloors()
    for layer in range(len(ref[0].diags)):
        pair.add_layer(layer, layer_outputs(ref, layer), layer_outputs(got, layer))
    pair.add_ends(ref, got)
    return pair.floors()


F32_PAIRS = ("oracle", "rechunk")   # pairs whose arithmetic the float32 null covers (rechunk: float32 candidates)


def null_limit(twins: Sequence[float], k: float = K, eps: float = EPS) -> float:
    """The largest floor a float32 benign pair may give and still be plain round-off: k * quietest twin + eps."""
    return k * float(min(twins)) + eps


def merge_floors(null: dict[str, list[float]], pairs: dict[str, dict[str, float]],
                 f32_pairs: Sequence[str]) -> tuple[dict[str, float], dict[str, list[str]]]:
    """Per quantity: floor = max(every pair not excluded), the quietest twin when none is left; a float32 pair
    above `null_limit` is
    excluded; a quantity a pair did not measure (an engine without that capture) takes no part. Returns (floors,
    pair -> excluded quantities)."""
    def beyond(name: str, key: str) -> bool:
        return name in f32_pairs and pairs[name][key] > null_limit(null[key])

    floors, excluded = {}, {}
    for key, twins in null.items():
        kept = [f[key] for name, f in pairs.items() if key in f and not beyond(name, key)]
        floors[key] = max(kept) if kept else float(min(twins))
    for name in f32_pairs:
        out = sorted(key for key in null if key in pairs.get(name, {}) and beyond(name, key))
        if out:
            excluded[name] = out
    return floors, excluded


def measure_envelope(ref32: Engine, ref64: Engine, cand: Engine, prompt: Sequence[int], decode: int = 0,
                     chunk: int = 5, cand_f32: Engine | None = None, n_twins: int = N_TWINS,
                     progress: ProgressSink = SILENT) -> Envelope:
    """The round-off null (`n_twins` twins of `ref32`) and the benign pairs on `prompt` (+ `decode` greedy steps
    of the float32 reference, teacher-forced on every side); floors by `merge_floors`. `cand_f32` (the candidate
    in float32) adds the `dtype` pair for a bf16 candidate. After the float32 reference's own run (which picks
    the decode tokens), every other run goes in lockstep, layer after layer (`run_lockstep`): engines sharing the
    reference's weight cache dequantize each layer once for all of them, and each pair's floors are taken per
    layer as it finishes. `progress.note(message)` announces the stages, `progress.count(stage, done, total)`
    counts the layers of the lockstep."""
    if not isinstance(ref32, RoundoffTwins):
        raise ParityError(f"engine {ref32.name} has no round-off twins (RoundoffTwins): no measured envelope")
    say = progress.note
    say("envelope: reference float32")
    base = run_sequence(ref32, prompt, decode, capture=True)
    tokens = [*prompt, *(int(t) for t in np.concatenate([r.tokens for r in base])[len(prompt):])]
    one, chunked = chunk_schedule(len(prompt), None), chunk_schedule(len(prompt), chunk)
    runs = {**{f"twin {seed}": (ref32.roundoff_twin(seed), one) for seed in range(1, n_twins + 1)},   # type: ignore[attr-defined]
            "float64": (ref64, one), "cand": (cand, one), "cand chunked": (cand, chunked),
            **({"cand float32": (cand_f32, one)} if cand_f32 is not None else {})}
    pairs_of = {**{f"twin {seed}": (None, f"twin {seed}") for seed in range(1, n_twins + 1)},
                "oracle": (None, "float64"), "rechunk": ("cand", "cand chunked"),
                **({"dtype": ("cand float32", "cand")} if cand_f32 is not None else {})}
    say(f"envelope: {len(runs)} runs in lockstep, layer after layer: {n_twins} round-off twins of the reference "
        f"(the null), the reference float64, {cand.name} {cand.options.dtype} in one chunk and in chunks of {chunk}"
        + (f", {cand_f32.name} float32" if cand_f32 is not None else ""))
    floors = _lockstep_floors(base, runs, pairs_of, tokens, decode, progress)
    twins = [floors.pop(f"twin {seed}") for seed in range(1, n_twins + 1)]
    null = {key: sorted(t[key] for t in twins) for key in twins[0]}
    merged, excluded = merge_floors(null, floors, f32_pairs(cand.options.dtype))
    for name, keys in excluded.items():
        say(f"envelope: the {name} pair is not round-off at {len(keys)} quantit{'y' if len(keys) == 1 else 'ies'} "
            f"({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}): left out of the floor")
    ckpt_names = [*base[0].checkpoints, LOGITS]
    return Envelope(
        dtype=cand.options.dtype,
        checkpoints={n: merged[n] for n in ckpt_names},
        subops={k: v for k, v in merged.items() if ":" in k and not k.startswith("margin:")},
        router_margin={k.split(":", 1)[1]: v for k, v in merged.items() if k.startswith("margin:")},
        logit_rel=merged["logit_rel"],
        components=floors,
        calibration={"prompt_len": len(prompt), "decode": decode, "chunk": chunk, "pairs": sorted(floors),
                     "twins": n_twins, "engine": cand.name, "fp8_kv": cand.options.fp8_kv,
                     "fp4_indexer": cand.options.fp4_indexer},
        null=null,
        excluded=excluded,
    )


def _lockstep_floors(base: Sequence[ChunkResult], runs: dict[str, tuple[Engine, list[int]]],
                     pairs_of: dict[str, tuple[str | None, str]], tokens: Sequence[int], decode: int,
                     progress: ProgressSink) -> dict[str, dict[str, float]]:
    """Every pair's floors (pair -> `pair_floors` order), the runs of `runs` (name -> engine, prompt chunks; then
    `decode` single steps) in lockstep; a pair's side None is `base`."""
    names = list(runs)
    acc = {pair: PairFloors() for pair in pairs_of}
    n_layers = len(base[0].diags)

    def on_layer(layer: int, outs: list[list[LayerOutput]]) -> None:
        by_name = dict(zip(names, outs, strict=True))
        for pair, (a, b) in pairs_of.items():
            acc[pair].add_layer(layer, layer_outputs(base, layer) if a is None else by_name[a], by_name[b])
        progress.count("envelope layers", layer + 1, n_layers)

    ends = run_lockstep([(engine, [*sizes, *[1] * decode]) for engine, sizes in runs.values()], tokens, True,
                        on_layer)
    by_name = dict(zip(names, ends, strict=True))
    for pair, (a, b) in pairs_of.items():
        acc[pair].add_ends(base if a is None else by_name[a], by_name[b])
    return {pair: f.floors() for pair, f in acc.items()}


def f32_pairs(dtype: str) -> tuple[str, ...]:
    """The benign pairs whose arithmetic is float32 for a candidate of `dtype` (the null's precision)."""
    return F32_PAIRS if dtype == "float32" else ("oracle",)


def stored_floors(env: Envelope) -> dict[str, float]:
    """Every floor of an envelope by the quantity keys of `pair_floors`."""
    return {**env.checkpoints, **env.subops, "logit_rel": env.logit_rel,
            **{f"margin:{k}": v for k, v in env.router_margin.items()}}


def contradictions(env: Envelope) -> list[str]:
    """The floors its own null contradicts: above `null_limit` and above every pair the float32 null does not
    cover (`f32_pairs`: the dtype pair, a bf16 candidate's rechunk); a quantity with no twins is one too. Empty
    for an envelope `measure_envelope` wrote."""
    out = []
    for key, floor in stored_floors(env).items():
        twins = env.null.get(key)
        if not twins:
            out.append(f"{key}: no round-off twins measured")
            continue
        own = [f.get(key, 0.0) for name, f in env.components.items() if name not in f32_pairs(env.dtype)]
        allowed = max([null_limit(twins, env.k, env.eps), *own])
        if floor > allowed:
            out.append(f"{key}: floor {floor:.3g} > {allowed:.3g} ({env.k:g} x the quietest of {len(twins)} "
                       f"round-off twins, {min(twins):.3g}, + {env.eps:g})")
    return out


# ---------------------------------------------------------------- storage

def save_envelope(path: str | os.PathLike, env: Envelope, model_identity: dict) -> Path:
    """Add/replace the `env.dtype` section of the envelope file at `path` (atomic write)."""
    path = Path(path)
    doc = {"format": "v4parity-envelope", "version": ENVELOPE_VERSION, "model": model_identity, "dtypes": {}}
    if path.exists():
        old = read_envelope(path)
        if same_model(old["model"], model_identity):
            doc["dtypes"] = old["dtypes"]
    doc["dtypes"][env.dtype] = asdict(env)
    return atomic_write_bytes(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())


def read_envelope(path: Path) -> dict:
    """The whole envelope document; an unreadable file or one of another format or version is a ParityError."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ParityError(f"cannot read envelope {path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != "v4parity-envelope" or doc.get("version") != ENVELOPE_VERSION:
        version = doc.get("version") if isinstance(doc, dict) else None
        why = " (version 1 floors predate the round-off null)" if version == 1 else ""
        raise ParityError(f"{path}: not a v4parity envelope of version {ENVELOPE_VERSION}{why}; "
                          "regenerate it with `v4parity envelope`")
    return doc


def load_envelope(path: str | os.PathLike, dtype: str, model_identity: dict | None = None) -> Envelope:
    """The `dtype` section of an envelope file; refuses a file measured on another model (`same_model`)."""
    path = Path(path)
    doc = read_envelope(path)
    if model_identity is not None and not same_model(doc["model"], model_identity):
        raise ParityError(f"{path} was measured on model {doc['model']}, not {model_identity}")
    if dtype not in doc["dtypes"]:
        raise ParityError(f"{path} has no {dtype} section (has: {', '.join(sorted(doc['dtypes']))}); "
                          f"measure it with `v4parity envelope --dtype {dtype}`")
    section = doc["dtypes"][dtype]
    want = {f.name for f in fields(Envelope)}
    if set(section) != want:
        raise ParityError(f"{path}: {dtype} section has missing fields {sorted(want - set(section))} / unknown fields "
                          f"{sorted(set(section) - want)}; regenerate it with `v4parity envelope`")
    env = Envelope(**section)
    wrong = contradictions(env)
    if wrong:
        raise ParityError(f"{path}: {dtype} section has {len(wrong)} floor(s) its round-off null contradicts ("
                          f"{'; '.join(wrong[:3])}{'; ...' if len(wrong) > 3 else ''}): an inherited or edited floor "
                          "would hide real errors; regenerate it with `v4parity envelope`")
    return env

