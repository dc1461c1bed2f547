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


def require_that(available: bool, what: str) -> None:
    """A test needs `what`: when it is not available, a failure in CI and a skip elsewhere."""
    if not available:
        (pytest.fail if in_ci() else pytest.skip)(f"{what}: required in CI, not available here")


def require_program(name: str, package: str) -> str:
    """The path of the program `name` (from the Debian package `package`); missing: a failure in CI, a skip
    elsewhere."""
    path = shutil.which(name)
    require_that(path is not None, f"{name} (Debian package {package!r})")
    return path
