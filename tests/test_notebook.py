"""notebooks/drift_profile.ipynb executes top to bottom (so it cannot rot), on a kernel of this interpreter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).parents[1]


def test_drift_profile_notebook_executes(tmp_path, monkeypatch):
    # a kernelspec for the current interpreter, whatever kernels the machine has installed
    spec = tmp_path / "kernels" / "v4parity-test"
    spec.mkdir(parents=True)
    spec.joinpath("kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "v4parity test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    nb = nbformat.read(ROOT / "notebooks" / "drift_profile.ipynb", as_version=4)
    NotebookClient(nb, kernel_name="v4parity-test", timeout=300,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    assert "blk.2.attn - rel-L2" in text          # the injected fault is located at the first compressed layer
    assert "blk.0.attn - rel-L2" in text          # bf16 drifts from the first layer on
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2
    assert not any(o.output_type == "error" for o in outputs)
