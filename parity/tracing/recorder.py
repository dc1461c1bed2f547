"""Building a trace from engine output: which positions and full vectors, and the `Recorder` that turns
the runner's `ChunkResult`s into trace tables. Engines never see traces."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from parity.contract.checkpoints import FINAL_NORM, LOGITS, has_top, is_draft, trace_checkpoints
from parity.contract.errors import TensorError, TraceError
from parity.tracing.records import TABLES, Table, make_table
from parity.tracing.runner import ChunkResult
from parity.tracing.stats import FP_DIM, carrier_stats, stats_view, top_k


def resolve_positions(spec: str | Sequence[int], n_total: int) -> list[int]:
    """'last' | 'all' | '0,5,9' | list of ints -> sorted unique positions in [0, n_total)."""
    if isinstance(spec, str):
        if spec == "last":
            return [n_total - 1]
        if spec == "all":
            return list(range(n_total))
        try:  # every comma-separated item must be an int ("1,,2" is a typo, not [1, 2])
            spec = [int(p) for p in spec.split(",")] if spec.strip() else []
        except ValueError:
            raise TraceError(f"--positions must be 'last', 'all' or a comma list of ints, got {spec!r}") from None
    out = sorted(set(int(p) for p in spec))
    if not out:
        raise TraceError("no positions to trace")
    bad = [p for p in out if not 0 <= p < n_total]
    if bad:
        raise TraceError(f"positions {bad} out of range [0, {n_total}) for this run")
    return out


def resolve_full(spec: str | Iterable[str] | None, n_layers: int, drafts: Sequence[str] = ()) -> list[str]:
    """'all' | 'blk.2,final_norm,logits' | None -> checkpoint names (plus 'logits', plus the draft checkpoints
    `drafts` of a run with a drafter) with full vectors."""
    allowed = [*trace_checkpoints(n_layers), LOGITS, *drafts]
    if spec is None or spec == "":
        return []
    if spec == "all":
        return allowed
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise TraceError(f"--full: unknown checkpoint(s) {unknown}; valid: embed, blk.N, blk.N.attn, final_norm, "
                         f"logits{', ' + ', '.join(drafts) if drafts else ''}")
    return [n for n in allowed if n in names]


class Recorder:
    """Accumulates trace rows chunk by chunk (pass `add` as `run_sequence(on_chunk=...)`)."""

    def __init__(self, names: Sequence[str], positions: Sequence[int], full: Sequence[str], top_k: int,
                 n_hc: int) -> None:
        self.names, self.positions, self.full, self.k = list(names), list(positions), list(full), top_k
        self.rows: dict[str, dict[str, list]] = {kind: {c: [] for c in TABLES[kind]} for kind in TABLES}
        self.vec: dict[str, list[np.ndarray]] = {n: [] for n in self.full}
        self.widths: dict[str, int] = {"F": FP_DIM, "K": top_k, "H": n_hc}

    def add(self, r: ChunkResult) -> None:
        """Record one chunk; a non-finite logit (any position) or recorded value is a TensorError, not a trace."""
        n = len(r.tokens)
        _check_finite("logits", np.asarray(r.logits), r.start_pos)
        local = [p - r.start_pos for p in self.positions if r.start_pos <= p < r.start_pos + n]
        if not local:
            return
        idx = np.array(local)
        toks = r.tokens[idx]
        for layer, d in enumerate(r.diags):
            for what, arr in (("hc_attn", d.hc_attn), ("hc_ffn", d.hc_ffn)):
                for part, a in zip(("pre", "post", "comb"), arr, strict=True):
                    _check_finite(f"blk.{layer} {what} {part}", np.asarray(a)[idx], r.start_pos + idx)
            _check_finite(f"blk.{layer} expert weights", np.asarray(d.expert_weights)[idx], r.start_pos + idx)
            margin = np.asarray(d.router_margin)[idx]  # NaN marks "no margin" (hash layers); inf is an error
            _check_finite(f"blk.{layer} router margin", np.where(np.isnan(margin), 0.0, margin), r.start_pos + idx)
        for ck, name in enumerate(self.names):
            if is_draft(name):  # recorded after the run: `add_draft`
                continue
            x = np.asarray(r.checkpoints[name])[idx]
            _check_finite(f"checkpoint {name}", x, r.start_pos + idx)
            self.add_checkpoint(ck, idx + r.start_pos, toks, x, r.logits[idx] if name == FINAL_NORM else None)
            if name in self.vec:
                self.vec[name].append(x.astype(np.float32))
        if LOGITS in self.vec:
            self.vec[LOGITS].append(np.asarray(r.logits[idx], dtype=np.float32))
        for layer, diag in enumerate(r.diags):
            self._add_diag(layer, idx, idx + r.start_pos, diag)

    def add_checkpoint(self, ck: int, pos: np.ndarray, toks: np.ndarray, x: np.ndarray,
                       logits: np.ndarray | None) -> None:
        """Rows for checkpoint self.names[ck] at positions `pos` from its vectors x [n, H, D] / [n, D]."""
        st = carrier_stats(x)
        if x.ndim == 3 and x.shape[1] != self.widths["H"]:
            raise TraceError(f"checkpoint {self.names[ck]}: {x.shape[1]} streams, expected {self.widths['H']}")
        rows, n = self.rows["ckpt"], len(pos)
        l2s = _pad(st["l2s"], self.widths["H"], np.nan, np.float32)
        for c, v in (("ck", [ck] * n), ("pos", pos), ("tok", toks), ("min", st["min"]), ("max", st["max"]),
                     ("rms", st["rms"]), ("l2s", l2s), ("sum_l2", st["sum_l2"]), ("fp", st["fp"])):
            rows[c].extend(v)
        if logits is None:
            rows["argmax"].extend([-1] * n)
            rows["top_ids"].extend(np.full((n, self.k), -1, np.int32))
            rows["top_logits"].extend(np.full((n, self.k), np.nan, np.float32))
        else:
            ids, vals = top_k(logits, self.k)
            rows["argmax"].extend(ids[:, 0])
            rows["top_ids"].extend(ids)
            rows["top_logits"].extend(vals)

    def add_draft(self, name: str, pos: Sequence[int], toks: np.ndarray, x: np.ndarray) -> None:
        """Rows of draft checkpoint `name` at positions `pos` from its vectors x [n, ...] (`vector_shape`): stats of
        DSpark block rows [n, B, H, D] over the stream-major view [n, H, B·D], of [n, B, V] over [n, B·V]; the
        argmax and top-k of mtp.k.logits rows from the logits themselves."""
        x = np.asarray(x)
        _check_finite(f"checkpoint {name}", x, np.asarray(pos))
        view = stats_view(name, x)
        self.add_checkpoint(self.names.index(name), np.asarray(pos), toks, view, x if has_top(name) else None)
        if name in self.vec:
            self.vec[name].append(x.astype(np.float32))

    def add_hc(self, layer: int, sub: int, pos: np.ndarray, pre: np.ndarray, post: np.ndarray,
               comb: np.ndarray) -> None:
        """HC rows: pre/post [n, H], comb [n, H, H] (or flat [n, H*H])."""
        n = len(pos)
        for c, v in (("layer", [layer] * n), ("sub", [sub] * n), ("pos", pos), ("pre", pre), ("post", post),
                     ("comb", np.asarray(comb).reshape(n, -1))):
            self.rows["hc"][c].extend(v)

    def add_moe(self, layer: int, pos: np.ndarray, ids: np.ndarray, w: np.ndarray, margin: np.ndarray) -> None:
        """MoE rows: ids / w [n, K], margin [n]."""
        self.widths["E"] = np.asarray(ids).shape[1]
        for c, v in (("layer", [layer] * len(pos)), ("pos", pos), ("ids", ids), ("w", w), ("margin", margin)):
            self.rows["moe"][c].extend(v)

    def _add_diag(self, layer: int, idx: np.ndarray, pos: np.ndarray, d: Any) -> None:
        for sub, (pre, post, comb) in enumerate((d.hc_attn, d.hc_ffn)):
            self.add_hc(layer, sub, pos, np.asarray(pre)[idx], np.asarray(post)[idx], np.asarray(comb)[idx])
        self.add_moe(layer, pos, np.asarray(d.expert_ids)[idx], np.asarray(d.expert_weights)[idx],
                     np.asarray(d.router_margin)[idx])
        sel = None if d.index_sel is None else np.asarray(d.index_sel)[idx]
        self.add_attn(layer, pos, np.asarray(d.n_comp_visible)[idx], sel)

    def add_attn(self, layer: int, pos: np.ndarray, n_comp: np.ndarray, sel: np.ndarray | None) -> None:
        """Attention rows: compressed rows visible [n], the indexer's selection [n, S] (None off CSA layers)."""
        n = len(pos)
        if sel is not None:
            self.widths["S"] = max(self.widths.get("S", 0), sel.shape[1])
        for c, v in (("layer", [layer] * n), ("pos", pos), ("n_comp", n_comp),
                     ("has_sel", [sel is not None] * n), ("sel", list(sel) if sel is not None else [None] * n)):
            self.rows["attn"][c].extend(v)

    def tables(self) -> dict[str, Table]:
        """The four tables, canonically typed and sorted."""
        self.widths.setdefault("S", 0)
        self.widths.setdefault("E", 0)
        attn = self.rows["attn"]
        attn["sel"] = [np.full(self.widths["S"], -1) if s is None else _pad(s[None], self.widths["S"], -1, np.int32)[0]
                       for s in attn["sel"]]
        return {kind: make_table(kind, self.rows[kind], self.widths) for kind in TABLES}

    def vectors(self) -> dict[str, np.ndarray] | None:
        return {n: np.concatenate(v) for n, v in self.vec.items()} if self.full else None


def _check_finite(what: str, x: np.ndarray, pos: np.ndarray | int) -> None:
    """Refuse to record NaN/inf: x [n, ...] holds rows for positions `pos` (or from start position `pos`)."""
    if x.dtype.kind != "f":
        return
    bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1) if x.ndim else np.zeros(0, bool)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        p = int(pos[i]) if isinstance(pos, np.ndarray) else pos + i
        v = x.reshape(len(x), -1)[i]
        raise TensorError(f"{what} at position {p}: non-finite value {v[~np.isfinite(v)][0]} (the engine produced "
                          "NaN/inf; no trace is written)")


def _pad(a: np.ndarray, width: int, fill: float, dtype: Any) -> np.ndarray:
    """Right-pad [n, w] to [n, width] with `fill`."""
    out = np.full((a.shape[0], width), fill, dtype=dtype)
    out[:, : a.shape[1]] = a
    return out
