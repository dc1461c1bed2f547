"""Shared fixtures: synthetic tiny models written once per test session (never downloaded)."""

from __future__ import annotations

import os

# Tiny test matrices: multi-threaded BLAS only spins on a shared 2-core box (measured 60x slower under load).
# Set before anything imports numpy; an explicit user setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# OMP_NUM_THREADS no longer sets the torch engine's threads (its engine argument threads=N does, default one
# per usable CPU); kept for any other OpenMP user. torch waits passively (OMP_WAIT_POLICY, parity.contract.cpus).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from parity.gguf.synth import synthesize


@pytest.fixture(scope="session", autouse=True)
def user_cache(tmp_path_factory):
    """XDG_CACHE_HOME in a temporary directory for the whole session: `check` / `bisect` / `spec` cache measured
    envelopes there (parity.check.inputs.cache_dir), and a test must neither read the user's nor write into it."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("xdg-cache")
    mp.setenv("XDG_CACHE_HOME", str(path))
    yield path
    mp.undo()


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


@pytest.fixture(scope="session")
def llamacpp_quantized(tiny_f32, model_dir):
    """`get(file_type)` -> the tiny f32 model quantized by llama.cpp's own quantizer at that llama.cpp file type
    (`Q4_K_M`, `MXFP4_MOE`, ...), written once per session into the model dir. Without llama_cpp: a skip
    outside CI, a failure in CI (tests/requires.py)."""
    from requires import require

    require("llama_cpp")
    from parity import api

    def get(file_type: str):
        path = model_dir / f"tiny-lcp-{file_type.lower()}.gguf"
        if not path.exists():
            part = path.with_name(path.name + ".part")
            api.quantize_llamacpp(tiny_f32, part, file_type, threads=2)
            part.replace(path)   # a run cut short leaves no half-written model behind
        return path

    return get
