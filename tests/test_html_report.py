"""The HTML report, rendered by a real browser (Debian's headless chromium): the verdict and the per-checkpoint
table are on the page and visible, the file is self-contained (no URL other than inline data: images)."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
from fake_engine import FakeEngine
from requires import require_program

from parity import api
from parity.compare.html import Section, table, write_html, write_report

PROMPT = [0, 5, 7, 9, 11, 13, 15, 17]


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    chromium = require_program("chromium", "chromium")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}"]
    return subprocess.run([chromium, *flags, *args], capture_output=True, text=True, timeout=120, check=True)


@pytest.fixture(scope="module")
def reports(tiny_f32):
    def run(perturb=None):
        return api.trace(FakeEngine(str(tiny_f32), perturb=perturb), tiny_f32, PROMPT, positions="all", decode=2)
    ref = run()
    return {"ok": api.diff(ref, run()), "bad": api.diff(ref, run({2: 0.05}))}


def _pixels(png_path):
    from matplotlib.image import imread

    return (imread(png_path)[..., :3] * 255).round().astype(np.int64)


def _has_colour(img, hex_colour: str) -> bool:
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
    return bool((np.abs(img - rgb).max(axis=-1) <= 2).any())


def test_failing_report_renders_verdict_and_table(reports, tmp_path):
    path = write_report(tmp_path / "report.html", reports["bad"])
    text = path.read_text()
    assert not re.search(r"(src|href)=\"(?!data:)", text) and "<script" not in text and "http" not in text
    dom = _chromium(tmp_path, "--dump-dom", path.as_uri()).stdout
    verdict = re.search(r'<div class="verdict fail" id="verdict">(.*?)</div>', dom).group(1)
    assert verdict.startswith("FAIL: first drifting checkpoint: blk.2.attn")
    assert dom.index('id="verdict"') < dom.index('id="checkpoints"')  # verdict first
    table_html = dom[dom.index('id="checkpoints"'):]
    assert re.search(r'<tr class="first"><td class="l">blk\.2\.attn</td>', table_html)
    assert re.search(r'<tr class="pass"><td class="l">blk\.1</td>', table_html)
    assert "data:image/png;base64," in dom and "Run headers" in dom
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,900", path.as_uri())
    img = _pixels(shot)
    top = img[:200]
    assert _has_colour(top, "#fbe4e4")                      # the red verdict box is painted at the top
    assert _has_colour(img, "#f8caca") and _has_colour(img, "#f3fbf4")  # first-drift row and passing rows


def test_passing_report_is_green(reports, tmp_path):
    path = write_report(tmp_path / "ok.html", reports["ok"], plot=False)
    dom = _chromium(tmp_path, "--dump-dom", path.as_uri()).stdout
    assert re.search(r'<div class="verdict pass" id="verdict">PASS: all 14 checkpoints agree', dom)
    rows = re.findall(r'<tr class="(\w*)"><td class="l">', dom)
    assert rows == ["pass"] * 14
    shot = tmp_path / "ok.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,700", path.as_uri())
    assert _has_colour(_pixels(shot)[:200], "#e3f4e6")


def test_generic_page_escapes_and_keeps_sections_in_order(tmp_path):
    path = write_html(tmp_path / "g.html", "bisect <run>", "culprit: blk.3 & its MoE", False,
                      [Section("first", table(["a", "b"], [["<x>", 1]], ["fail"])), Section("second", "<p>z</p>")])
    text = path.read_text()
    assert "&lt;x&gt;" in text and "culprit: blk.3 &amp; its MoE" in text and "<x>" not in text
    assert text.index("<h2>first</h2>") < text.index("<h2>second</h2>")


def test_report_and_diff_html_from_the_cli(tiny_f32, tmp_path):
    from click.testing import CliRunner

    from parity.cli import cli

    def run(perturb=None):
        return api.trace(FakeEngine(str(tiny_f32), perturb=perturb), tiny_f32, PROMPT, positions="all", decode=2)

    a, b = api.save_trace(run(), tmp_path / "a.trace"), api.save_trace(run({2: 0.05}), tmp_path / "b.trace")
    r = CliRunner().invoke(cli, ["report", str(a), str(b), "-o", str(tmp_path / "r.html")])
    assert r.exit_code == 1 and "first drifting checkpoint: blk.2.attn" in r.output  # drift: exit 1, as diff
    assert 'class="verdict fail"' in (tmp_path / "r.html").read_text()
    r = CliRunner().invoke(cli, ["report", str(a), str(a), "-o", str(tmp_path / "ok.html")])
    assert r.exit_code == 0 and 'class="verdict pass"' in (tmp_path / "ok.html").read_text()
    r = CliRunner().invoke(cli, ["diff", str(a), str(b), "--html", str(tmp_path / "d.html"), "--no-fail"])
    assert r.exit_code == 0 and "blk.2.attn" in (tmp_path / "d.html").read_text()
