"""`v4parity demo` (what `make demo` runs): both reports printed, the fault located at blk.2, plot written."""

from __future__ import annotations

from click.testing import CliRunner

from parity import api
from parity.cli import cli


def test_demo_end_to_end(tmp_path):
    res = CliRunner().invoke(cli, ["demo", "--out", str(tmp_path)])
    assert res.exit_code == 0, (res.output, res.exception)
    out = res.output
    assert "all 14 checkpoints agree" in out
    assert "first drifting checkpoint: blk.2.attn (layer 2)" in out
    assert "demo verdict: OK" in out
    assert (tmp_path / "drift.png").stat().st_size > 20_000
    tokens = api.load_trace(tmp_path / "reference.trace").header.tokens
    for name in ("torch.trace", "torch-fault.trace"):
        assert api.load_trace(tmp_path / name).header.tokens == tokens
