"""`--html FILE` on check, bisect and validate: one self-contained page each, rendered by headless chromium
with the verdict first and the command's own result on the page."""

from __future__ import annotations

import re

from click.testing import CliRunner
from test_html_report import _chromium

from parity import api
from parity.cli import cli
from parity.contract.engine import RunOptions


def _rendered(tmp_path, page) -> str:
    text = page.read_text()
    assert not re.search(r"(src|href)=\"(?!data:)", text) and "<script" not in text  # self-contained
    return _chromium(tmp_path, "--dump-dom", page.as_uri()).stdout


def test_check_html_shows_the_defect_and_the_table(tiny_f32, tmp_path):
    t = api.trace("torch", tiny_f32, [0, 17, 42, 99, 5, 8], positions="all", full="all",
                  options=RunOptions(inject=("sink-dropped",)))
    api.save_trace(t, tmp_path / "cand.trace")
    r = CliRunner().invoke(cli, ["check", "-m", str(tiny_f32), "-c", str(tmp_path / "cand.trace"),
                                 "--html", str(tmp_path / "check.html")])
    assert r.exit_code == 1, r.output
    dom = _rendered(tmp_path, tmp_path / "check.html")
    verdict = re.search(r'<div class="verdict fail" id="verdict">(.*?)</div>', dom).group(1)
    assert verdict.startswith("FAIL: DEFECT at layer 0") and "sink-dropped" in verdict
    assert dom.index('id="verdict"') < dom.index("<table>")
    assert re.search(r'<tr class="fail"><td class="l">blk\.0</td>', dom) and "data:image/png;base64," in dom


def test_bisect_and_validate_html_pages(tiny_f32, tmp_path):
    b = CliRunner().invoke(cli, ["bisect", "-m", str(tiny_f32), "--decode", "1", "--html", str(tmp_path / "b.html")])
    assert b.exit_code == 0, b.output
    dom = _rendered(tmp_path, tmp_path / "b.html")
    assert re.search(r'<div class="verdict pass" id="verdict">PASS: (NO DEFECT|NOISE)', dom), dom[:2000]
    v = CliRunner().invoke(cli, ["validate", "-m", str(tiny_f32), "--exact", "torch", "--approx",
                                 "torch:act_quant=q8_0", "--boundary", "--n", "2", "--decode", "1", "--pins", "1",
                                 "-o", str(tmp_path / "v"), "--html", str(tmp_path / "v.html")])
    assert v.exit_code == 0, v.output
    dom = _rendered(tmp_path, tmp_path / "v.html")
    assert re.search(r'<div class="verdict pass" id="verdict">PASS: pins only - no budget given, metrics not judged',
                     dom)  # no --budget: the metrics were not judged, and the verdict says so
    assert "Announce pin" in dom
