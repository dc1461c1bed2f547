"""The import contracts cover the whole tree: every registered engine package is behind the wall, and the engines'
forbidden list names every parity subpackage but the two they may import (a new subpackage cannot slip through)."""

from __future__ import annotations

import pkgutil
from importlib.metadata import entry_points
from pathlib import Path

import tomllib

import parity

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _contract(name_start: str) -> dict:
    return next(c for c in CONTRACTS if c["name"].startswith(name_start))


def test_every_registered_engine_is_behind_the_wall():
    # (tests/validate_plugin.py registers test-only engines of the package `validate_engines` for some tests)
    engines = {ep.value.split(".")[0] for ep in entry_points(group="v4parity.engines")} - {"validate_engines"}
    assert engines == {"reference_cpu", "gpu_engine", "llamacpp_engine", "hf_engine"}
    assert set(_contract("engines import only")["source_modules"]) == engines
    assert set(_contract("the engines are independent")["modules"]) == engines
    assert set(_contract("the harness never imports")["forbidden_modules"]) == engines


def test_engines_may_import_only_contract_and_gguf_of_parity():
    subpackages = {f"parity.{m.name}" for m in pkgutil.iter_modules(parity.__path__) if m.name != "schema"}
    assert set(_contract("engines import only")["forbidden_modules"]) == subpackages - {"parity.contract",
                                                                                         "parity.gguf"}
    layers = _contract("harness layers")["layers"]
    assert {p for layer in layers for p in layer.split(" | ")} == subpackages
