"""The `inspect` report of a model file: config, schedule, tensors, validation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from parity.gguf.inventory import type_mix, validate
from parity.gguf.support import ENGINES, support
from parity.gguf.weights import Weights


def layer_kind(ratio: int) -> str:
    return {0: "SWA"}.get(ratio, "CSA" if ratio == 4 else f"HCA/{ratio}")


def inspect_model(path: str, engines: Sequence[str] = ENGINES) -> dict[str, Any]:
    """Everything `v4parity inspect` shows, as plain data: config, schedule, tensors, the type mix (count and
    bytes per ggml type), whether each engine in `engines` reads every type (`parity.gguf.support`), and the
    contract validation (problems; `layout`/`differs`: types llama.cpp's quantizer writes that differ from the
    release's, `parity.gguf.inventory.validate`)."""
    w = Weights(path)
    cfg = w.config
    infos = w.tensor_infos()
    mix = type_mix(infos)
    tensors = [
        {"name": n, "shape": list(w.info(n).shape), "type": w.info(n).type_name, "bytes": w.info(n).nbytes}
        for n in w.names
    ]
    v = validate(infos, cfg)
    problems = list(v.problems)
    return {
        "file": w.identity(),
        "config": cfg.to_dict() | {"derived": cfg.derived},
        "notes": dict(cfg.notes),
        "schedule": [
            {"layer": l, "ratio": cfg.ratio(l), "kind": layer_kind(cfg.ratio(l)), "hash": cfg.is_hash_layer(l),
             "indexer": cfg.has_indexer(l)}
            for l in range(cfg.n_layers)
        ],
        "tensors": tensors,
        "total_bytes": sum(t["bytes"] for t in tensors),
        "type_mix": mix,
        "engines": support([int(r["id"]) for r in mix], engines),
        "validation": {"ok": not problems, "problems": problems, "layout": v.layout, "differs": list(v.differs)},
    }


def print_inspection(report: dict[str, Any], tensors: bool = True) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    cfg = report["config"]
    derived = cfg.pop("derived")
    t = Table(title=f"config of {report['file']['file']}", show_lines=False)
    t.add_column("field")
    t.add_column("value")
    t.add_column("source")
    for k, v in cfg.items():
        t.add_row(k, str(v), f"[yellow]derived: {derived[k]}[/]" if k in derived else "metadata")
    con.print(t)
    for k, note in report["notes"].items():
        con.print(f"[yellow]note[/] {k}: {note}")
    s = Table(title="layer schedule")
    for col in ("layer", "ratio", "kind", "hash-routed", "indexer"):
        s.add_column(col)
    for row in report["schedule"]:
        s.add_row(str(row["layer"]), str(row["ratio"]), row["kind"], "yes" if row["hash"] else "",
                  "yes" if row["indexer"] else "")
    con.print(s)
    tt = Table(title=f"{len(report['tensors'])} tensors, {report['total_bytes']:,} bytes")
    for col in ("name", "shape", "type", "bytes"):
        tt.add_column(col, justify="right" if col == "bytes" else "left")
    for r in report["tensors"]:
        tt.add_row(r["name"], "x".join(map(str, r["shape"])), r["type"], f"{r['bytes']:,}")
    con.print(tt if tensors else f"{tt.title} (--tensors lists them)")
    m = Table(title="type mix")
    for col in ("type", "tensors", "bytes", "share"):
        m.add_column(col, justify="left" if col == "type" else "right")
    total = max(report["total_bytes"], 1)
    for r in report["type_mix"]:
        m.add_row(r["type"], str(r["count"]), f"{r['bytes']:,}", f"{100 * r['bytes'] / total:.1f} %")
    con.print(m)
    for e in report["engines"]:
        con.print(engine_line(e))
    v = report["validation"]
    if v["layout"]:
        con.print(f"layout: {v['layout']} (information, not a problem)")
    if v["ok"]:
        con.print("[green]validation: OK[/] (all expected tensors present with allowed shapes and types)")
    else:
        con.print(f"[red]validation: {len(v['problems'])} problem(s)[/]")
        for p in v["problems"]:
            con.print(f"  - {p}")


def engine_line(e: dict[str, Any]) -> str:
    """One engine's verdict on the file's types, for the console (rich markup)."""
    if not e["available"]:
        return f"[yellow]{e['engine']}: cannot tell[/] ({e['error']})"
    missing = [t for t, ok in e["reads"].items() if not ok]
    if not missing:
        return f"[green]{e['engine']}: reads every type[/] ({e['how']})"
    return f"[red]{e['engine']}: does not read {', '.join(missing)}[/] ({e['how']})"
