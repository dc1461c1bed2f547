"""The one strict-JSON spelling of report values (diff, check, bisect, logprobs, arbitrate, validate, bench).

numpy scalars become Python values, numpy arrays nested lists (each element spelled as below); ±inf becomes the
string "inf" / "-inf" (JSON has no such numbers); NaN the string "nan" (it stays visible), or null in the diff's
tables, where a NaN cell means "not computed" (max_abs on fingerprints, a router margin never recorded); dicts,
lists and tuples are converted element by element.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def json_safe(x: Any, nan: Any = "nan") -> Any:
    """x with every value spelled for strict JSON (see the module docstring); `nan`: what a NaN becomes."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (float, np.floating)):
        v = float(x)
        return v if math.isfinite(v) else "inf" if v > 0 else "-inf" if v < 0 else nan
    if isinstance(x, np.ndarray):
        return json_safe(x.tolist(), nan)
    if isinstance(x, dict):
        return {k: json_safe(v, nan) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v, nan) for v in x]
    return x
