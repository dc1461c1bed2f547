"""docs/peers.md's capture script for other llama.cpp builds, run as printed there: its file imports to the trace
the llamacpp engine records for the same run (same settings: one ubatch, F32 KV, 1 thread, context 512)."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from requires import require

from parity import api
from parity.contract.engine import RunOptions, load_engine
from parity.gguf.weights import Weights
from parity.tracing.importers import import_llamacpp

llama_cpp = require("llama_cpp")

DOC = Path(__file__).resolve().parents[1] / "docs" / "peers.md"
TOKENS = [0, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25]


def test_doc_capture_script_writes_the_capture_format(tiny_f32, tmp_path):
    script = re.search(r"### Capturing another llama.cpp build.*?```python\n(.*?)```", DOC.read_text(), re.S)[1]
    (tmp_path / "capture.py").write_text(script)
    out = tmp_path / "cap.npz"
    r = subprocess.run([sys.executable, str(tmp_path / "capture.py"), str(tiny_f32), ",".join(map(str, TOKENS)),
                    str(out)], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    ident = api.model_identity(tiny_f32)
    t = import_llamacpp(out, tokens=None, config=Weights(tiny_f32).config, model=ident)
    assert t.header.flags["import_dropped"] == [] and t.header.flags["import_unmapped"] == []
    eng = load_engine("llamacpp", str(tiny_f32), replace(RunOptions(fp8_kv=False, fp4_indexer=False),
                                                          engine_args=("lcp_threads=1", "lcp_ctx=512")))
    direct = api.trace(eng, tiny_f32, TOKENS, positions="all", full="all")
    assert t.ckpt == direct.ckpt and t.hc == direct.hc and t.moe == direct.moe and t.attn == direct.attn
    assert all(np.array_equal(t.vectors[k], direct.vectors[k]) for k in direct.vectors)
