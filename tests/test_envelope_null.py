"""The envelope measured by the round-off null: one unlucky calibration run cannot widen it, and a stored floor its
own null contradicts is refused (issue 22, point 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.check.envelope import contradictions, load_envelope, merge_floors
from parity.contract.errors import ParityError

TRACES = Path(__file__).resolve().parent.parent / "traces"


def test_merge_floors_hand_computed():
    # quietest twin 1e-6: a float32 pair above 10 * 1e-6 + 1e-6 = 1.1e-5 is not round-off
    null = {"a": [1e-6, 2e-6, 4e-4], "b": [1e-6, 3e-6, 5e-6], "c": [2e-6, 2e-6, 2e-6]}
    pairs = {"oracle": {"a": 3.9e-4, "b": 1e-5, "c": 5e-5},
             "rechunk": {"a": 5e-7, "b": 2e-5, "c": 9e-5},
             "dtype": {"a": 1e-3, "b": 1e-7}}          # no `c`: a quantity a pair did not measure takes no part
    floors, excluded = merge_floors(null, pairs, ("oracle", "rechunk"))
    assert floors == {"a": 1e-3, "b": 1e-5, "c": 2e-6}   # c: every pair left, so the quietest twin
    assert excluded == {"oracle": ["a", "c"], "rechunk": ["b", "c"]}
    floors, excluded = merge_floors(null, {k: pairs[k] for k in ("oracle", "rechunk")}, ("oracle",))
    assert floors == {"a": 5e-7, "b": 2e-5, "c": 9e-5}   # a bf16 candidate's rechunk is not float32: it counts
    assert excluded == {"oracle": ["a", "c"]}


@pytest.mark.parametrize("model", ["tiny-f32", "tiny-real-mix", "tiny-mxfp4"])
def test_committed_envelopes_agree_with_their_null(model):
    doc = json.loads((TRACES / f"{model}.envelope.json").read_text())
    for dtype in doc["dtypes"]:
        env = load_envelope(TRACES / f"{model}.envelope.json", dtype)
        assert contradictions(env) == []
        assert all(len(v) == env.calibration["twins"] == 19 for v in env.null.values())


def test_the_oracle_pairs_code_flip_does_not_widen_the_f32_envelope():
    # the calibration run's float64 reference flips an FP8 code in layer 5 (3.9e-4 there, measured 2026-12-01);
    # the quietest of the 19 twins stays at plain round-off, so that pair is left out and the floor is the
    # rechunk pair's
    env = load_envelope(TRACES / "tiny-f32.envelope.json", "float32")
    assert env.components["oracle"]["blk.5"] > 100 * env.components["rechunk"]["blk.5"]
    assert "blk.5" in env.excluded["oracle"]
    assert env.checkpoints["blk.5"] == env.components["rechunk"]["blk.5"] < 1e-6


def test_an_inflated_or_pre_null_envelope_is_refused(tmp_path):
    doc = json.loads((TRACES / "tiny-f32.envelope.json").read_text())
    doc["dtypes"]["float32"]["checkpoints"]["blk.3"] *= 1e3
    bad = tmp_path / "inflated.envelope.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ParityError, match=r"1 floor\(s\) its round-off null contradicts \(blk\.3: floor"):
        load_envelope(bad, "float32")
    load_envelope(bad, "bfloat16")                      # the other section is still sound
    doc["version"] = 1
    bad.write_text(json.dumps(doc))
    with pytest.raises(ParityError, match="version 1 floors predate the round-off null"):
        load_envelope(bad, "bfloat16")
