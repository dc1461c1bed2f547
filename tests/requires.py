"""Optional dependencies of the tests: in CI (environment variable CI set) a missing one fails the test, since
`make test` installs every extra there; elsewhere the test is skipped with the reason."""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def require(module: str) -> ModuleType:
    """`import module`; missing: an ImportError (test failure) in CI, a skip elsewhere."""
    return importlib.import_module(module) if in_ci() else pytest.importorskip(module)


def require_program(name: str, package: str) -> str:
    """The path of the program `name` (from the Debian package `package`); missing: a failure in CI, a skip
    elsewhere."""
    path = shutil.which(name)
    if path is None:
        if in_ci():
            pytest.fail(f"{name} (Debian package {package!r}) is required in CI")
        pytest.skip(f"{name} not installed")
    return path
