"""Shared fixtures: synthetic tiny models written once per test session (never downloaded)."""

from __future__ import annotations

import os

# Tiny test matrices: multi-threaded BLAS only spins on a shared 2-core box (measured 60x slower under load).
# Set before anything imports numpy; an explicit user setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch CPU intra-op threads: same spinning (measured 20x)

import pytest

from parity.gguf.synth import synthesize


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def _model(model_dir, quant: str, preset: str = "tiny"):
    path = model_dir / f"{preset}-{quant}.gguf"
    if not path.exists():
        synthesize(path, preset, quant, seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_f32(model_dir):
    return _model(model_dir, "f32")


@pytest.fixture(scope="session")
def tiny_realmix(model_dir):
    return _model(model_dir, "real-mix")


@pytest.fixture(scope="session")
def tiny_mxfp4(model_dir):
    return _model(model_dir, "mxfp4")
