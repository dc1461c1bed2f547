"""The project's error types. Every failure on user input is one of these, never a bare crash."""

from __future__ import annotations

from typing import Any

import numpy as np


def quote(v: Any, limit: int = 60) -> str:
    """repr(v) capped at `limit` characters, for error messages (an error line never carries a whole array)."""
    if isinstance(v, np.ndarray) and v.size > 8:
        v = f"<{v.size} x {v.dtype}: {np.array2string(v.ravel()[:4], separator=', ')[:-1]}, ...]>"
        return v if len(v) <= limit else v[: limit - 3] + "..."
    s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


class ParityError(Exception):
    """Base class of every error v4parity raises on bad input."""


class GGUFError(ParityError):
    """The file is not a well-formed GGUF container (bad magic, truncated, out-of-bounds, ...)."""


class MetadataError(ParityError):
    """A metadata key is missing, mistyped or out of range for the deepseek4 contract."""


class TensorError(ParityError):
    """A tensor is missing, has the wrong shape/type, or holds non-finite values."""


class TraceError(ParityError):
    """A trace file is malformed; the message names file, line and field."""
