"""The `inspect --draft` report: a drafter file's head, keys and tensors, and whether it fits the trunk."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from parity.contract.errors import GGUFError, ParityError, quote
from parity.gguf.container import VT, Value
from parity.gguf.drafter import check_pair, open_drafter
from parity.gguf.inventory import type_mix
from parity.gguf.weights import Weights

BULKY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")


def key_text(v: Value) -> str:
    """A metadata value for display: arrays up to 8 entries in full, else their length and first entries."""
    if v.type != VT.ARRAY:
        return quote(v.value)
    values = v.value.tolist() if isinstance(v.value, np.ndarray) else list(v.value[:9])
    if len(v.value) > 8:
        return f"{len(v.value)} x {v.elem_type.name}: {quote(values[:4])[:-1]}, ...]"
    return quote(values)


def inspect_drafter(model: str | os.PathLike, draft: str | os.PathLike) -> dict[str, Any]:
    """Everything `inspect -m TRUNK --draft FILE` shows, as plain data. A drafter that breaks the contract or does
    not fit the trunk gives `validation.ok` False with the named problem; a file that is not a GGUF raises."""
    trunk = Weights(model)
    report: dict[str, Any] = {"trunk": trunk.identity(), "draft": str(draft), "head": None, "keys": {},
                              "notes": {}, "tensors": [], "tensor_count": 0, "total_bytes": 0, "type_mix": []}
    try:
        drafter = open_drafter(draft, trunk.config)
        pair_notes = check_pair(trunk, drafter)
    except GGUFError:
        raise
    except ParityError as e:
        return report | {"validation": {"ok": False, "problems": [str(e)]}}
    dc, w = drafter.config, drafter.weights
    file_infos = {n: w.file_tensor(n)[0] for n in {w.file_name(c) for c in w.names} | set(drafter.trunk_copies)}
    tensors = [{"name": c, "file_name": w.file_name(c), "shape": list(w.info(c).shape), "type": w.info(c).type_name,
                "bytes": w.info(c).nbytes} for c in w.names]
    tensors += [{"name": f"(trunk copy of {t})", "file_name": n, "shape": list(file_infos[n].shape),
                 "type": file_infos[n].type_name, "bytes": file_infos[n].nbytes}
                for n, t in drafter.trunk_copies.items()]
    L = dc.first_layer
    return report | {
        "file": w.identity(),
        "head": {"kind": dc.kind, "layout": dc.layout, "n_blocks": dc.n_blocks,
                 "layers": list(range(L, L + dc.n_blocks)), "block_size": dc.block_size,
                 "noise_token_id": dc.noise_token_id,
                 "target_layer_ids": None if dc.target_layer_ids is None else list(dc.target_layer_ids),
                 "markov_rank": dc.markov_rank},
        "keys": {k: f"{v.type_name()} {key_text(v)}" if k not in BULKY_KEYS else f"{v.type_name()} ({len(v.value)})"
                 for k, v in w.kv.items()},
        "notes": drafter.notes | pair_notes,
        "tensors": tensors,
        "tensor_count": len(file_infos),
        "total_bytes": sum(i.nbytes for i in file_infos.values()),
        "type_mix": type_mix(file_infos),
        "validation": {"ok": True, "problems": []},
    }


def print_drafter_inspection(report: dict[str, Any], tensors: bool = True) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    con = Console()
    v = report["validation"]
    head = report["head"]
    if head is not None:
        h = Table(title=f"drafter {report['file']['file']} for trunk {report['trunk']['file']}")
        h.add_column("field")
        h.add_column("value")
        for k, val in head.items():
            if val is not None:
                h.add_row(k, str(val))
        con.print(h)
        k = Table(title="metadata keys")
        k.add_column("key")
        k.add_column("value")
        for key, val in report["keys"].items():
            k.add_row(key, Text(val))
        con.print(k)
        for key, note in report["notes"].items():
            con.print(f"[yellow]note[/] {key}: {note}")
        tt = Table(title=f"{report['tensor_count']} tensors in the file, {report['total_bytes']:,} bytes")
        for col in ("name", "file name", "shape", "type", "bytes"):
            tt.add_column(col, justify="right" if col == "bytes" else "left")
        for r in report["tensors"]:
            tt.add_row(Text(r["name"]), r["file_name"], "x".join(map(str, r["shape"])), r["type"], f"{r['bytes']:,}")
        con.print(tt if tensors else f"{tt.title} (--tensors lists them)")
        m = Table(title="type mix")
        for col in ("type", "tensors", "bytes"):
            m.add_column(col, justify="left" if col == "type" else "right")
        for r in report["type_mix"]:
            m.add_row(r["type"], str(r["count"]), f"{r['bytes']:,}")
        con.print(m)
    if v["ok"]:
        con.print("[green]drafter: OK[/] (layout, keys, tensors and the trunk pair all check)")
    else:
        con.print(f"[red]drafter: refused[/] {report['draft']}")
        for p in v["problems"]:
            con.print(f"  - {p}", markup=False, highlight=False)
