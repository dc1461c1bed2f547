"""Test engine plugins for `v4parity validate` (registered for the tests only, through a `*.dist-info` entry
point that `validate_plugin.install` puts on sys.path and PYTHONPATH).

All are `FakeEngine` with an approximate mode bolted on: activations after every layer rounded to Q8_0 blocks
(32 values, one scale max|x|/127), the exact path untouched.
* vfake:        act_quant=q8_0 is honoured and announced on stderr;
* vfake-mute:   act_quant=q8_0 is honoured (declared in the header flags) but never printed;
* vfake-silent: always approximate, with exact options and nothing printed (a silent approximation);
* vfake-drift:  vfake, except that a repeated run of the same prompt with the same options in one process moves
                one logit by one float32 ulp (a run-to-run drift the exactness pin must catch).
"""

from __future__ import annotations

import sys
from typing import ClassVar

import numpy as np
from fake_engine import FakeEngine

from parity.contract.engine import LayerOutput


def q8_0(x: np.ndarray) -> np.ndarray:
    """Round the last axis to Q8_0 blocks of 32: q = round(x / d), d = max|x| / 127 per block."""
    b = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    d = np.abs(b).max(axis=-1, keepdims=True) / 127
    q = np.where(d > 0, np.round(b / np.where(d > 0, d, 1)), 0)
    return (q * d).reshape(x.shape).astype(np.float32)


class ApproxFake(FakeEngine):
    name = "vfake"
    announce = True
    always = False

    def __init__(self, model_path, options=None):
        super().__init__(model_path, options)
        self.approx = self.always or self.options.act_quant == "q8_0"
        if self.options.act_quant not in ("none", "q8_0"):
            raise ValueError(f"{self.name}: act_quant={self.options.act_quant} not supported")
        if self.approx and self.announce:
            print(f"{self.name}: APPROXIMATE act_quant=q8_0 (activations rounded to Q8_0 blocks)", file=sys.stderr)

    def forward_layer(self, state, layer, carrier, tokens, start_pos, capture=False) -> LayerOutput:
        out = super().forward_layer(state, layer, carrier, tokens, start_pos, capture)
        if self.approx:
            out.carrier = q8_0(out.carrier)
        return out


class MuteFake(ApproxFake):
    name = "vfake-mute"
    announce = False


class SilentFake(ApproxFake):
    name = "vfake-silent"
    announce = False
    always = True


class DriftFake(ApproxFake):
    name = "vfake-drift"
    seen: ClassVar[set] = set()

    def forward_layer(self, state, layer, carrier, tokens, start_pos, capture=False) -> LayerOutput:
        if layer == 0 and start_pos == 0:
            key = (repr(self.options.flags()), tuple(int(t) for t in tokens))
            self.repeat = key in DriftFake.seen
            DriftFake.seen.add(key)
        return super().forward_layer(state, layer, carrier, tokens, start_pos, capture)

    def head(self, carrier):
        final, logits = super().head(carrier)
        if self.repeat:
            logits = logits.copy()
            logits[:, 0] = np.nextafter(logits[:, 0], np.float32(np.inf))
        return final, logits


ENTRY_POINTS = {"vfake": "ApproxFake", "vfake-mute": "MuteFake", "vfake-silent": "SilentFake",
                "vfake-drift": "DriftFake"}
