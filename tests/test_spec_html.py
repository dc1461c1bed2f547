"""`v4parity spec --html FILE`: the page printed from the SpecReport, rendered by headless chromium (the pattern of
tests/test_html_pages.py): verdict first, the per-round timeline (one cell per drafted position, coloured by its
label, marked where accepted) equal to the `--json` report of the same run, the per-slot acceptance numbers and plot.

Expected values that do not come from the page code: scripted drafts `reject-at:2` at depth 3 (spec §6.4) draft the
reference's greedy continuation with the 2nd draft of every round made wrong, so on a correct engine every round
that verifies 3 drafts is [ACCEPT-OK accepted, DRAFTER-MISS, NOT-VERIFIED] and the acceptance is 100 / 0 / 0 % per
slot; a trunk fault (`sink-dropped`) makes the run exit 1 and the verdict box red.
"""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from test_html_report import _chromium, _has_colour, _pixels

from parity.cli import cli
from parity.spec.html import CANDIDATE, COLOURS, REFERENCE

ENVELOPE = Path(__file__).parent / "fixtures" / "spec" / "tiny-f32-nosims.envelope.json"


def _spec(tiny_f32, tmp_path, name: str, *extra: str) -> tuple[int, dict, str, Path]:
    page = tmp_path / f"{name}.html"
    res = CliRunner().invoke(cli, ["spec", "-m", str(tiny_f32), "--tokens", "0 5 7 9 11 13", "--engine", "torch",
                                   "--envelope", str(ENVELOPE), "--no-fp8-kv", "--no-fp4-indexer", "--json",
                                   "--html", str(page), *extra])
    text = page.read_text()
    assert not re.search(r"(src|href)=\"(?!data:)", text) and "<script" not in text   # self-contained
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    return res.exit_code, json.loads(res.stdout), dom, page


def _timeline(dom: str) -> list[list[tuple[str, bool, str]]]:
    """Per timeline row: (label, accepted, cell text) of each drafted cell."""
    part = dom[dom.index('id="timeline"'):]
    part = part[part.index("<tbody>") : part.index("</table>")]
    rows = re.findall(r"<tr>(.*?)</tr>", part)
    return [[(lab, acc == " accepted", text) for lab, acc, text in
             re.findall(r'<td class="lab-([A-Z-]+)( accepted)?"[^>]*>([^<]*)</td>', r)] for r in rows]


def test_spec_html_timeline_and_acceptance_match_the_report(tiny_f32, tmp_path):
    code, doc, dom, page = _spec(tiny_f32, tmp_path, "script", "--script", "reject-at:2", "--depth", "3",
                                 "--steps", "12")
    assert code == 0
    verdict = re.search(r'<div class="verdict pass" id="verdict">(.*?)</div>', dom).group(1)
    assert verdict == "PASS: EXACT: speculative == plain == reference tokens"
    assert dom.index('id="verdict"') < dom.index('id="timeline"') < dom.index('id="acceptance"')
    rows = _timeline(dom)
    assert len(rows) == len(doc["rounds"]) and len(rows) >= 4
    for row, r in zip(rows, doc["rounds"], strict=True):
        assert [lab for lab, _, _ in row] == r["labels"]                            # the report's labels
        assert [acc for _, acc, _ in row] == [i < r["accepted"] for i in range(len(r["drafts"]))]
        assert [int(text.split()[0]) for _, _, text in row] == r["drafts"]
        if r["verified"] == 3:                                                      # the script's own pattern
            assert row[0][:2] == ("ACCEPT-OK", True) and [lab for lab, _, _ in row[1:]] == ["DRAFTER-MISS",
                                                                                             "NOT-VERIFIED"]
    legend = dict(re.findall(r'data-label="([A-Z-]+)">[A-Z-]+ (\d+)</span>', dom))
    assert {k: int(v) for k, v in legend.items()} == doc["labels"]
    acc = dom[dom.index('id="acceptance"'):]
    table = re.findall(r"<tr[^>]*><td>(\d)</td><td>([\d.]+)%</td><td>([\d.]+)%</td></tr>", acc)
    assert table == [("1", "100.0", "100.0"), ("2", "0.0", "0.0"), ("3", "0.0", "0.0")]
    assert doc["acceptance"]["per_slot"] == [1.0, 0.0, 0.0]
    # the plot: both bar colours drawn (slot 1 is 100 % for both)
    from matplotlib.image import imread

    src = re.search(r'<img alt="per-slot acceptance" src="data:image/png;base64,([^"]+)"', page.read_text()).group(1)
    img = (imread(io.BytesIO(base64.b64decode(src)), format="png")[..., :3] * 255).round().astype(np.int64)
    assert _has_colour(img, CANDIDATE) and _has_colour(img, REFERENCE)
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,900", page.as_uri())
    shown = _pixels(shot)
    assert _has_colour(shown[:200], "#e3f4e6")                                      # green verdict box on top
    for lab in ("ACCEPT-OK", "DRAFTER-MISS", "NOT-VERIFIED"):
        assert _has_colour(shown, COLOURS[lab]), lab


def test_spec_html_of_a_faulty_run_is_red(tiny_f32, tmp_path):
    code, doc, dom, _ = _spec(tiny_f32, tmp_path, "fault", "--script", "accept-all", "--depth", "2", "--steps", "4",
                              "--inject", "sink-dropped")
    assert code == 1 and doc["first_divergence"]["class"] == "WRONG"
    verdict = re.search(r'<div class="verdict fail" id="verdict">(.*?)</div>', dom).group(1)
    assert verdict.startswith("FAIL: WRONG at step 0")
    assert [[lab for lab, _, _ in row] for row in _timeline(dom)] == [r["labels"] for r in doc["rounds"]]
