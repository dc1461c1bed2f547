"""Helpers shared by the draft-head tests: synthesized drafter files and a trunk's own carriers."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from parity.gguf.synth_draft import synthesize_drafter


def drafter_files(directory: Path, trunk: Path, kind: str, layouts: tuple[str, ...]) -> dict[str, Path]:
    """layout -> a tiny `kind` drafter of `trunk` written in that layout (same seed: the same weights in each)."""
    return {layout: synthesize_drafter(directory / f"{layout}.gguf", trunk, kind, layout) for layout in layouts}


def layer_carriers(engine, tokens: np.ndarray) -> list[np.ndarray]:
    """Every layer's output carrier X^(l+1) [N, H, D] of one free-running prefill of `tokens` on `engine`."""
    state, X, outs = engine.new_state(), engine.embed(tokens), []
    for layer in range(engine.config.n_layers):
        X = engine.forward_layer(state, layer, X, tokens, 0).carrier
        outs.append(X)
    return outs
