"""Compare two traces: preflight, per-(checkpoint, position) metrics, the first drifting checkpoint.

`a` is the reference, `b` the candidate. Preflight refuses (PreflightError) when token ids, model
identity, checkpoint sets or traced positions differ, unless `force=True` (then the intersection
is compared and the refusals are kept as warnings). Metrics use the full vectors when both traces
recorded them for a checkpoint ("full"), else the 64-number fingerprints ("fp": cosine and rel-L2
are then Johnson-Lindenstrauss estimates, max-abs is unknown). A position drifts when its rel-L2
exceeds `rel_tol` or its RMS ratio leaves 1 +- `norm_tol` or any statistic is non-finite; the first
drifting checkpoint is the shallowest one (depth order) where any position drifts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from parity import metrics
from parity.errors import ParityError
from parity.records import Trace, checkpoint_depth, checkpoint_layer


class PreflightError(ParityError):
    """The two traces are not comparable (different tokens, model, checkpoints or positions)."""


@dataclass(frozen=True)
class Thresholds:
    """Drift thresholds. rel_tol 1e-3 sits ~1000x above float32 engine-vs-reference noise (~1e-6)
    and ~100x below the smallest known porting bug's effect on a carrier (spec 'Easy mistakes')."""

    rel_tol: float = 1e-3
    norm_tol: float = 1e-3

    def with_overrides(self, **kw: float | None) -> Thresholds:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    @property
    def cos_tol(self) -> float:
        """The cosine threshold equivalent to rel_tol for equal-norm vectors: 1 - rel_tol^2 / 2."""
        return float(metrics.cosine_at_rel_l2(self.rel_tol))


def preflight(a: Trace, b: Trace) -> list[str]:
    """Reasons the traces are not comparable one-to-one (empty list: comparable)."""
    ha, hb = a.header, b.header
    problems = []
    i = _first_token_difference(ha.tokens, hb.tokens)
    if i is not None:
        at = lambda t: t[i] if i < len(t) else "end"  # noqa: E731
        problems.append(f"token ids differ at position {i} (A: {at(ha.tokens)}, B: {at(hb.tokens)}; "
                        f"A has {len(ha.tokens)} tokens, B {len(hb.tokens)})")
    if _model_key(ha.model) != _model_key(hb.model):
        problems.append(f"model identity differs: A {_model_str(ha.model)} vs B {_model_str(hb.model)}")
    if ha.checkpoints != hb.checkpoints:
        only_a = [c for c in ha.checkpoints if c not in hb.checkpoints]
        only_b = [c for c in hb.checkpoints if c not in ha.checkpoints]
        problems.append(f"checkpoint sets differ: only in A {only_a or '-'}, only in B {only_b or '-'}")
    if ha.positions != hb.positions:
        problems.append(f"traced positions differ: A {_short(ha.positions)} vs B {_short(hb.positions)}")
    if ha.n_hc != hb.n_hc:
        problems.append(f"stream counts differ: A {ha.n_hc} vs B {hb.n_hc}")
    return problems


def _first_token_difference(ta: list[int], tb: list[int]) -> int | None:
    """First position whose input token differs (or where one run ends), None if identical."""
    if ta == tb:
        return None
    return next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))


def _model_key(m: dict) -> tuple:
    """What identifies a model: size + header hash (the file name is informational)."""
    return m.get("size"), m.get("header_sha256")


def _model_str(m: dict) -> str:
    return f"{m.get('file')} ({m.get('size')} bytes, header {m.get('header_sha256')})"


def _short(xs: list) -> str:
    return str(xs) if len(xs) <= 8 else f"[{xs[0]}, {xs[1]}, ..., {xs[-1]}] ({len(xs)})"


@dataclass
class DiffReport:
    """Everything a diff found. `table`: one row per (checkpoint, position); `summary`: one per checkpoint."""

    a: dict[str, Any]
    b: dict[str, Any]
    thresholds: Thresholds
    warnings: list[str]
    table: pd.DataFrame
    layers: pd.DataFrame
    first_drift: dict[str, Any] | None
    n_layers: int
    flags_differ: dict[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.first_drift is None

    @property
    def exact(self) -> bool:
        return bool(self.table["exact"].all())

    @property
    def summary(self) -> pd.DataFrame:
        """Per checkpoint (depth order): worst position by rel-L2 and its metrics, drift count."""
        t = self.table
        worst = t.loc[t.assign(key=t["rel_l2"].fillna(np.inf)).groupby("checkpoint", sort=False)["key"].idxmax()]
        agg = t.groupby("checkpoint", sort=False).agg(
            positions=("pos", "size"), drifting=("drift", "sum"), exact=("exact", "all"),
            cosine_min=("cosine", "min"), max_abs=("max_abs", "max"),
            stream_ratio_min=("stream_ratio_min", "min"), stream_ratio_max=("stream_ratio_max", "max"))
        w = worst.set_index("checkpoint")[["depth", "layer", "method", "pos", "norm_ratio", "rel_l2", "sqnr_db"]]
        out = w.rename(columns={"pos": "worst_pos"}).join(agg)
        return out.reset_index().sort_values("depth", kind="stable").reset_index(drop=True)

    def to_dict(self) -> dict[str, Any]:
        def records(df: pd.DataFrame) -> list[dict]:
            return [{k: _json_value(v) for k, v in row.items()} for row in df.to_dict(orient="records")]

        return {"a": self.a, "b": self.b, "thresholds": {**asdict(self.thresholds), "cos_tol": self.thresholds.cos_tol},
                "warnings": self.warnings, "flags_differ": self.flags_differ, "agree": bool(self),
                "exact": self.exact, "first_drift": self.first_drift, "checkpoints": records(self.summary),
                "positions": records(self.table), "layers": records(self.layers)}


def _json_value(v: Any) -> Any:
    if isinstance(v, (np.bool_, bool)):
        return bool(v)
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        v = float(v)
        return None if np.isnan(v) else (str(v) if np.isinf(v) else v)
    return v


# ----------------------------------------------------------------------------------------------
# Computing the diff

def diff_traces(a: Trace, b: Trace, thresholds: Thresholds | None = None, force: bool = False) -> DiffReport:
    """Preflight, then metrics for every common (checkpoint, position); raises PreflightError unless forced."""
    th = thresholds or Thresholds()
    problems = preflight(a, b)
    if problems and not force:
        raise PreflightError("refusing to compare these traces (use --force / force=True to compare the "
                             "overlap anyway):\n  - " + "\n  - ".join(problems))
    names = [c for c in a.header.checkpoints if c in b.header.checkpoints]
    positions = [p for p in a.header.positions if p in b.header.positions]
    cut = _first_token_difference(a.header.tokens, b.header.tokens)
    if cut is not None and any(p >= cut for p in positions):
        positions = [p for p in positions if p < cut]
        problems.append(f"compared only positions < {cut}: from there on the runs were fed different tokens")
    if not names or not positions:
        raise PreflightError("the traces share no (checkpoint, position) to compare")
    n_layers = a.n_layers
    frames = [_checkpoint_metrics(a, b, name, positions, th, n_layers) for name in names]
    table = pd.concat(frames, ignore_index=True)
    return DiffReport(
        a=_side(a), b=_side(b), thresholds=th, warnings=problems, table=table,
        layers=_layer_diags(a, b, positions), first_drift=_first_drift(table, th), n_layers=n_layers,
        flags_differ={k: [a.header.flags.get(k), b.header.flags.get(k)]
                      for k in sorted(set(a.header.flags) | set(b.header.flags))
                      if a.header.flags.get(k) != b.header.flags.get(k)},
    )


def _side(t: Trace) -> dict[str, Any]:
    h = t.header
    return {"engine": h.engine, "version": h.engine_version, "model": h.model, "dtype": h.dtype, "flags": h.flags,
            "n_tokens": len(h.tokens)}


def _rows_at(t: Trace, name: str, positions: list[int]) -> np.ndarray:
    rows = t.checkpoint_rows(name)
    by_pos = dict(zip(t.ckpt["pos"][rows].tolist(), rows.tolist(), strict=True))
    return np.array([by_pos[p] for p in positions])


def _checkpoint_metrics(a: Trace, b: Trace, name: str, positions: list[int], th: Thresholds,
                        n_layers: int) -> pd.DataFrame:
    ra, rb = _rows_at(a, name, positions), _rows_at(b, name, positions)
    ca, cb = a.ckpt.cols, b.ckpt.cols
    full = a.vectors is not None and b.vectors is not None and name in a.vectors and name in b.vectors
    if full:
        idx_a = [a.header.positions.index(p) for p in positions]
        idx_b = [b.header.positions.index(p) for p in positions]
        va, vb = a.vectors[name][idx_a], b.vectors[name][idx_b]
        max_abs = metrics.max_abs(va, vb)
        exact_vec = np.all(va.reshape(len(va), -1) == vb.reshape(len(vb), -1), axis=1)
    else:
        va, vb = ca["fp"][ra], cb["fp"][rb]
        max_abs, exact_vec = np.full(len(positions), np.nan), np.ones(len(positions), bool)
    rel = metrics.rel_l2(va, vb)
    cos = metrics.cosine(va, vb)
    with np.errstate(divide="ignore", invalid="ignore"):
        norm_ratio = cb["rms"][rb].astype(np.float64) / ca["rms"][ra]
        stream = cb["l2s"][rb].astype(np.float64) / ca["l2s"][ra]
    stats = ("min", "max", "rms", "sum_l2")
    finite = np.all([np.isfinite(ca[s][ra]) & np.isfinite(cb[s][rb]) for s in stats], axis=0)
    finite &= np.isfinite(ca["fp"][ra]).all(axis=1) & np.isfinite(cb["fp"][rb]).all(axis=1)
    exact = exact_vec & np.all([_same(ca[s][ra], cb[s][rb]) for s in (*stats, "l2s", "fp")], axis=0)
    drift = ~finite | ~(rel <= th.rel_tol) | ~(np.abs(norm_ratio - 1.0) <= th.norm_tol)
    with np.errstate(all="ignore"):
        smin, smax = np.nanmin(stream, axis=1), np.nanmax(stream, axis=1)
    layer = checkpoint_layer(name)
    return pd.DataFrame({
        "checkpoint": name, "depth": checkpoint_depth(name, n_layers), "layer": -1 if layer is None else layer,
        "pos": positions, "method": "full" if full else "fp", "norm_ratio": norm_ratio, "cosine": cos,
        "rel_l2": rel, "nmse": rel ** 2, "sqnr_db": metrics.sqnr_from_rel_l2(rel), "max_abs": max_abs,
        "stream_ratio_min": smin, "stream_ratio_max": smax, "finite": finite, "exact": exact, "drift": drift,
        "argmax_a": ca["argmax"][ra], "argmax_b": cb["argmax"][rb],
    })


def _same(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Row-wise exact equality (NaN equal to NaN)."""
    eq = (x == y) | (np.isnan(x) & np.isnan(y))
    return eq.reshape(len(eq), -1).all(axis=1)


def _first_drift(table: pd.DataFrame, th: Thresholds) -> dict[str, Any] | None:
    d = table[table["drift"]]
    if d.empty:
        return None
    depth = d["depth"].min()
    at = d[d["depth"] == depth].sort_values("pos")
    row = at.loc[at["rel_l2"].fillna(np.inf).idxmax()]
    reason = ("non-finite values" if not row["finite"] else
              f"rel-L2 {row['rel_l2']:.3g} > {th.rel_tol:g}" if not row["rel_l2"] <= th.rel_tol else
              f"RMS ratio {row['norm_ratio']:.6g} outside 1 +- {th.norm_tol:g}")
    return {"checkpoint": row["checkpoint"], "layer": None if row["layer"] < 0 else int(row["layer"]),
            "first_pos": int(at["pos"].iloc[0]), "worst_pos": int(row["pos"]), "positions": at["pos"].tolist(),
            "method": row["method"], "rel_l2": _json_value(row["rel_l2"]), "norm_ratio": _json_value(row["norm_ratio"]),
            "cosine": _json_value(row["cosine"]), "reason": reason}


def _layer_diags(a: Trace, b: Trace, positions: list[int]) -> pd.DataFrame:
    """Per layer: HC mix max-abs difference, expert-set flips, compressed-row and indexer mismatches."""
    keep = set(positions)
    out: dict[int, dict[str, Any]] = {}

    def rows(t: Trace, kind: str, key: tuple[str, ...]) -> dict[tuple, int]:
        tab = getattr(t, kind)
        return {k: i for i, k in enumerate(zip(*(tab[c].tolist() for c in key), strict=True)) if k[-1] in keep}

    def entry(layer: int) -> dict[str, Any]:
        return out.setdefault(layer, {"layer": layer, "hc_max_abs": 0.0, "expert_flips": 0, "first_flip_pos": -1,
                                      "weight_max_abs": 0.0, "n_comp_mismatch": 0, "sel_mismatch": 0})

    ia, ib = rows(a, "hc", ("layer", "sub", "pos")), rows(b, "hc", ("layer", "sub", "pos"))
    for k in sorted(ia.keys() & ib.keys()):
        e = entry(k[0])
        for c in ("pre", "post", "comb"):
            d = np.abs(a.hc[c][ia[k]].astype(np.float64) - b.hc[c][ib[k]])
            e["hc_max_abs"] = float(np.nanmax([e["hc_max_abs"], *d]))
    ia, ib = rows(a, "moe", ("layer", "pos")), rows(b, "moe", ("layer", "pos"))
    for k in sorted(ia.keys() & ib.keys()):
        e = entry(k[0])
        ids_a, ids_b = a.moe["ids"][ia[k]], b.moe["ids"][ib[k]]
        if set(ids_a.tolist()) != set(ids_b.tolist()):
            e["expert_flips"] += 1
            if e["first_flip_pos"] < 0:
                e["first_flip_pos"] = k[1]
        elif np.array_equal(ids_a, ids_b):
            d = np.abs(a.moe["w"][ia[k]].astype(np.float64) - b.moe["w"][ib[k]]).max(initial=0.0)
            e["weight_max_abs"] = max(e["weight_max_abs"], float(d))
    ia, ib = rows(a, "attn", ("layer", "pos")), rows(b, "attn", ("layer", "pos"))
    for k in sorted(ia.keys() & ib.keys()):
        e = entry(k[0])
        e["n_comp_mismatch"] += int(a.attn["n_comp"][ia[k]] != b.attn["n_comp"][ib[k]])
        sa, sb = a.attn["sel"][ia[k]], b.attn["sel"][ib[k]]
        e["sel_mismatch"] += int(set(sa[sa >= 0].tolist()) != set(sb[sb >= 0].tolist()))
    cols = ["layer", "hc_max_abs", "expert_flips", "first_flip_pos", "weight_max_abs", "n_comp_mismatch",
            "sel_mismatch"]
    return pd.DataFrame([out[k] for k in sorted(out)], columns=cols)


# ----------------------------------------------------------------------------------------------
# Printers (pure functions of the report)

def verdict_line(r: DiffReport) -> str:
    th = r.thresholds
    if r.first_drift is None:
        kind = "bit-exact" if r.exact else f"within rel-L2 <= {th.rel_tol:g} and RMS ratio 1 +- {th.norm_tol:g}"
        return f"all {r.table['checkpoint'].nunique()} checkpoints agree ({kind})"
    f = r.first_drift
    where = f"layer {f['layer']}" if f["layer"] is not None else f["checkpoint"]
    return (f"first drifting checkpoint: {f['checkpoint']} ({where}) from position {f['first_pos']}: {f['reason']} "
            f"[{f['method']}]")


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "-"
    return format(v, spec)


def summary_rows(r: DiffReport) -> list[list[str]]:
    """Summary cells per checkpoint, in SUMMARY_HEADERS order."""
    out = []
    for s in r.summary.to_dict(orient="records"):
        status = "exact" if s["exact"] else ("DRIFT" if s["drifting"] else "ok")
        if s["drifting"]:
            status += f" ({s['drifting']}/{s['positions']} pos)"
        streams = f"{_fmt(s['stream_ratio_min'], '.4f')}..{_fmt(s['stream_ratio_max'], '.4f')}"
        out.append([s["checkpoint"], s["method"], str(s["worst_pos"]), _fmt(s["norm_ratio"], ".6f"),
                    _fmt(s["cosine_min"], ".8f"), _fmt(s["rel_l2"], ".3e"), _fmt(s["sqnr_db"], ".1f"),
                    _fmt(s["max_abs"], ".3e"), streams, status])
    return out


SUMMARY_HEADERS = ["checkpoint", "method", "worst pos", "norm ratio", "cosine", "rel-L2", "SQNR dB", "max-abs",
                   "stream ratios", "status"]


def to_markdown(r: DiffReport) -> str:
    """The report as GitHub Markdown: verdict, warnings, summary table, layer diagnostics with differences."""
    lines = [f"**v4parity diff**: A = {r.a['engine']} {r.a['version']}, B = {r.b['engine']} {r.b['version']}", "",
             f"**{verdict_line(r)}**", ""]
    lines += [f"> warning (forced): {w}" for w in r.warnings]
    lines += [f"> flags differ: `{k}` A={v[0]} B={v[1]}" for k, v in r.flags_differ.items()]
    lines += ["", "| " + " | ".join(SUMMARY_HEADERS) + " |", "|" + "---|" * len(SUMMARY_HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in summary_rows(r)]
    bad = r.layers[(r.layers[["expert_flips", "n_comp_mismatch", "sel_mismatch"]].sum(axis=1) > 0)
                   | (r.layers["hc_max_abs"] > 0)] if len(r.layers) else r.layers
    if len(bad):
        lines += ["", "| layer | HC max-abs | expert flips | n_comp mismatches | indexer mismatches |",
                  "|---|---|---|---|---|"]
        lines += [f"| {e.layer} | {e.hc_max_abs:.3e} | {e.expert_flips} | {e.n_comp_mismatch} | {e.sel_mismatch} |"
                  for e in bad.itertuples()]
    lines += ["", f"Thresholds: rel-L2 <= {r.thresholds.rel_tol:g}, |RMS ratio - 1| <= {r.thresholds.norm_tol:g} "
                  f"(cosine >= {r.thresholds.cos_tol:.10g} for equal norms). method fp = 64-dim fingerprint estimate."]
    return "\n".join(lines) + "\n"


def print_report(r: DiffReport, console: Any = None) -> None:
    """Rich console rendering: warnings, summary table, layer diagnostics, verdict."""
    from rich.console import Console
    from rich.table import Table as RichTable

    console = console or Console(width=None if Console().is_terminal else 150)
    for w in r.warnings:
        console.print(f"[yellow]warning (forced):[/] {w}")
    for k, v in r.flags_differ.items():
        console.print(f"[cyan]flags differ:[/] {k}: A={v[0]} B={v[1]}")
    tab = RichTable(title=f"A = {r.a['engine']} ({r.a['dtype']})  vs  B = {r.b['engine']} ({r.b['dtype']})")
    for h in SUMMARY_HEADERS:
        tab.add_column(h, justify="left" if h in ("checkpoint", "method", "status") else "right")
    first = r.first_drift["checkpoint"] if r.first_drift else None
    for row in summary_rows(r):
        style = "bold red" if row[0] == first else ("red" if "DRIFT" in row[-1] else None)
        tab.add_row(*row, style=style)
    console.print(tab)
    flagged = r.layers[(r.layers[["expert_flips", "n_comp_mismatch", "sel_mismatch"]].sum(axis=1) > 0)]
    for e in flagged.itertuples():
        parts = [f"{e.expert_flips} expert-set flip(s) from position {e.first_flip_pos}" if e.expert_flips else "",
                 f"{e.n_comp_mismatch} visible-compressed-row count mismatch(es)" if e.n_comp_mismatch else "",
                 f"{e.sel_mismatch} indexer selection mismatch(es)" if e.sel_mismatch else ""]
        console.print(f"layer {e.layer}: " + ", ".join(p for p in parts if p))
    color = "green" if r else "bold red"
    console.print(f"[{color}]{verdict_line(r)}[/]")
    console.print(f"thresholds: rel-L2 <= {r.thresholds.rel_tol:g}, |RMS ratio - 1| <= {r.thresholds.norm_tol:g}; "
                  "method 'fp' = fingerprint estimate, 'full' = full vectors")
