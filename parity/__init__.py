"""v4parity: layer-bisection reference parity for DeepSeek-V4 (deepseek4 GGUF) engines.

The Python API (`parity.trace`, `parity.load_trace`, `parity.save_trace`, `parity.diff`, `parity.gate`,
`parity.export`, `parity.plot`, `parity.follow`) lives in `parity.api` and is loaded on first use, so `import parity`
stays light (no torch, no pandas).
"""

from __future__ import annotations

from typing import Any

from parity.contract.cpus import passive_openmp

passive_openmp()  # before anything imports torch: idle OpenMP threads sleep instead of spinning (speed only)

API = ("trace", "load_trace", "save_trace", "diff", "gate", "export", "plot", "follow")


def __getattr__(name: str) -> Any:
    if name in API:
        from parity import api

        return getattr(api, name)
    raise AttributeError(f"module 'parity' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *API])
