"""`--inject FAULT@LAYERS` (issue 27 point 4): a fault that acts only in the named layers of the torch engine.

The trace test's expectation is independent of the fault's code: a fault restricted to layer 3 must leave every
recorded vector before blk.3.attn bit-identical to the clean run's and change blk.3.attn (comb-not-transposed acts
in the attention's HC_post, the first thing layer 3 writes). That `check` calls the same candidate a DEFECT at
layer 3 naming the fault is tests/test_check_workers.py::test_serial_verdicts.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from parity import api
from parity.cli import cli
from parity.contract.checkpoints import block, block_attn
from parity.contract.engine import RunOptions, load_engine
from parity.contract.errors import ParityError

PROMPT = [1, 17, 42, 5, 99, 3, 64, 8, 21, 30, 11, 2, 7, 45, 19, 60, 33, 28]


def test_a_fault_at_layer_3_changes_nothing_before_blk_3(tiny_f32, tmp_path):
    clean = api.trace("torch", tiny_f32, PROMPT, positions="all", full="all", decode=2)
    path = tmp_path / "at3.trace"
    r = CliRunner().invoke(cli, ["trace", "--engine", "torch", "-m", str(tiny_f32), "--tokens",
                                 ",".join(map(str, PROMPT)), "--decode", "2", "--positions", "all", "--full", "all",
                                 "--inject", "comb-not-transposed@3", "-o", str(path)])
    assert r.exit_code == 0, r.output
    faulty = api.load_trace(path)
    assert faulty.header.flags["inject"] == ["comb-not-transposed@3"]
    order = ["embed", *(n for l in range(clean.n_layers) for n in (block_attn(l), block(l)))]
    same = [n for n in order if np.array_equal(clean.vectors[n], faulty.vectors[n])]
    assert same == order[: order.index(block_attn(3))]


def test_layers_lists_and_ranges(tiny_f32):
    """Two layers and a range: the engine's per-layer ops carry the fault exactly there."""
    for inject, layers in ((("sink-dropped@1,4",), {1, 4}), (("sink-dropped@2-4",), {2, 3, 4}),
                           (("sink-dropped@0,2-3",), {0, 2, 3})):
        e = load_engine("torch", str(tiny_f32), RunOptions(inject=inject))
        assert {l for l, ops in enumerate(e.layer_ops) if ops.attention is not e.ops.attention} == layers, inject


@pytest.mark.parametrize("entry, says", [
    ("sink-dropped@6", "layer 6 out of range [0, 6)"),
    ("sink-dropped@x", "bad layer list 'x'"),
    ("sink-dropped@", "bad layer list ''"),
    ("sink-dropped@4-2", "empty layer range '4-2'"),
    ("compress-ratios-u32@1", "takes no @LAYERS"),
    ("mtp-no-hc-post@1", "takes no @LAYERS"),
])
def test_a_bad_layer_list_is_refused_naming_it(tiny_f32, entry, says):
    with pytest.raises(ParityError) as e:
        load_engine("torch", str(tiny_f32), RunOptions(inject=(entry,)))
    assert repr(entry) in str(e.value) and says in str(e.value)


@pytest.mark.parametrize("entry", ["nosuch@3", "sink-dropped@9"])
def test_bisect_refuses_a_bad_entry_before_any_work(tiny_f32, entry):
    r = CliRunner().invoke(cli, ["bisect", "-m", str(tiny_f32), "--inject", entry])
    assert r.exit_code != 0 and repr(entry) in str(r.exception), r.output
