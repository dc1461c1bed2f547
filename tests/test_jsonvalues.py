"""parity.compare.jsonvalues: the one strict-JSON spelling every report uses."""

from __future__ import annotations

import json

import numpy as np

from parity.compare.jsonvalues import json_safe


def test_non_finite_numpy_and_nested_values_are_spelled_for_strict_json():
    doc = {"nan": float("nan"), "f32_inf": np.float32("inf"), "neg": -np.inf, "i": np.int64(7), "b": np.bool_(True),
           "none": None, "nested": [(1.5, np.float64("nan")), {"x": np.int32(-2)}], "s": "text"}
    out = json_safe(doc)
    assert out == {"nan": "nan", "f32_inf": "inf", "neg": "-inf", "i": 7, "b": True, "none": None,
                   "nested": [[1.5, "nan"], {"x": -2}], "s": "text"}
    assert type(out["i"]) is int and type(out["b"]) is bool
    json.dumps(out, allow_nan=False)  # strict JSON: would raise on a bare NaN / inf


def test_nan_can_be_spelled_null_where_it_means_not_computed():
    assert json_safe({"max_abs": np.nan, "rel": [np.inf, np.nan]}, nan=None) == {"max_abs": None, "rel": ["inf", None]}


def test_a_diff_report_with_a_nan_metric_is_strict_json():
    """The diff's tables spell NaN (not computed / undefined) as null."""
    from trace_samples import toy_trace

    from parity import api

    a = toy_trace(0)
    zero = a.ckpt["fp"].copy()
    zero[0] = 0.0  # a zero reference row: cosine is nan there
    b = type(a)(a.header, type(a.ckpt)({**a.ckpt.cols, "fp": zero}), a.hc, a.moe, a.attn)
    doc = api.diff(b, a, force=True).to_dict()
    text = json.dumps(doc, allow_nan=False)
    assert '"cosine": null' in text


def test_numpy_arrays_become_nested_lists_with_every_element_spelled():
    """bisect's reports hold arrays (the step x layer excess): nested lists, non-finite elements spelled."""
    doc = {"excess": np.array([[1.5, np.inf], [np.nan, -np.inf]], np.float32), "ids": np.array([3, 1], np.int64)}
    out = json_safe(doc)
    assert out == {"excess": [[1.5, "inf"], ["nan", "-inf"]], "ids": [3, 1]}
    assert json_safe(np.array([np.nan]), nan=None) == [None]
    json.dumps(out, allow_nan=False)
