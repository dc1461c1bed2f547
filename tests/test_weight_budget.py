"""The engines' dequantized-weight memory bounds on the tiny model (issue 27, point 2).

Reference: `RunOptions.cache_gb` is a budget evicted by layer (`reference_cpu.weights_cache.LayerCache`); a budget
smaller than the model evicts whole layers and changes no result bit; expert slices that do not fit beside their
layer are streamed (announced, counted, same bits); a layer whose dense weights alone need more is an error.
Torch: nothing is dequantized at load; the kept matrices stay within `cache_mb` and a smaller budget changes no
result bit (`gpu_engine.weights.DeviceWeights.cache_stats` / `memory_bound`).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest

from gpu_engine.engine import TorchEngine
from parity.contract.engine import RunOptions
from parity.contract.errors import TensorError
from parity.gguf.weights import Weights
from parity.tracing.runner import run_sequence, stack
from reference_cpu.engine import ReferenceEngine
from reference_cpu.weights_cache import NON_LAYER, LayerCache, layer_of

PROMPT = np.random.default_rng(11).integers(2, 290, 40)  # > 32 rows: the torch engine's dense (not matvec) path


def float32_bytes_by_layer(path, experts: bool = True) -> dict[str, int]:
    """Every tensor's float32 size summed per block (`blk.N`), from the file's tensor table: a layer's worst case
    (every expert dequantized), an upper bound of what the reference caches for it; without the routed expert
    tensors when `experts` is False."""
    w, out = Weights(str(path)), defaultdict(int)
    for name in w.names:
        if name.startswith("blk.") and (experts or "_exps." not in name):
            out[".".join(name.split(".")[:2])] += math.prod(w.info(name).shape) * 4
    return dict(out)


def run(engine) -> dict[str, np.ndarray]:
    """Every checkpoint and the logits of the prompt and 2 greedy decode steps, stacked over the chunks."""
    res = run_sequence(engine, PROMPT, decode_steps=2)
    return {name: stack(res, name) for name in [*res[0].checkpoints, "logits"]}


def assert_bit_identical(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys() and len(want) > 8
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_layer_of_groups_block_tensors_experts_and_mins():
    assert layer_of("blk.12.attn_q_a.weight") == "blk.12"
    assert layer_of(("blk.3.ffn_up_exps.weight", 5)) == "blk.3"
    assert layer_of(("mins", "blk.7.attn_kv.weight")) == layer_of(("mins", "blk.7.ffn_down_exps.weight", 2)) == "blk.7"
    assert layer_of("output.weight") == layer_of("output_hc_fn.weight") == NON_LAYER


def test_layer_cache_evicts_least_recently_used_layer_whole():
    cache = LayerCache(budget_bytes=1000)
    arr = lambda n: (lambda: np.zeros(n, dtype=np.uint8))  # noqa: E731
    cache.get("blk.0.a", arr(300))
    cache.get(("blk.0.e", 1), arr(100))
    cache.get("blk.1.a", arr(400))
    cache.get("blk.0.a", arr(300))  # hit: blk.0 becomes the most recently used layer
    cache.get("blk.2.a", arr(300))  # 1100 > 1000: blk.1 (least recently used) leaves, blk.0 stays whole
    st = cache.stats()
    assert (st["hits"], st["misses"], st["evictions"], st["layer_evictions"]) == (1, 4, 1, 1)
    assert (st["entries"], st["bytes"], st["layers"], st["peak_bytes"]) == (3, 700, 2, 800)
    cache.get("blk.3.a", arr(500))  # 1200 > 1000: blk.0 leaves with both its arrays
    st = cache.stats()
    assert (st["evictions"], st["layer_evictions"], st["entries"], st["bytes"]) == (3, 2, 2, 800)
    with pytest.raises(TensorError, match=r"layer blk\.3 needs at least .* raise cache_gb"):
        cache.get(("blk.3.e", 0), arr(501))  # blk.3 alone would hold 1001 bytes
    assert cache.stats()["bytes"] == 800  # nothing was evicted for the refused array


def test_room_is_made_before_an_array_of_known_size_is_made():
    cache = LayerCache(budget_bytes=1000)
    cache.get("blk.0.a", lambda: np.zeros(600, dtype=np.uint8))
    held_while_making = []

    def make() -> np.ndarray:
        held_while_making.append(cache.stats()["bytes"])
        return np.zeros(500, dtype=np.uint8)

    cache.get("blk.1.a", make, nbytes=500)
    assert held_while_making == [0]  # blk.0 left before blk.1's array existed: at most 1000 bytes at any time
    with pytest.raises(TensorError, match=r"layer blk\.1 needs at least"):
        cache.get("blk.1.b", lambda: pytest.fail("made although it cannot fit"), nbytes=501)


def test_reference_budget_below_the_model_evicts_by_layer_bit_identical(tiny_realmix):
    sizes = float32_bytes_by_layer(tiny_realmix)
    budget = int(max(sizes.values()) * 1.05)
    assert budget * 3 < sum(sizes.values())  # the budget holds at most a few of the 6 layers
    unbounded = ReferenceEngine(str(tiny_realmix), RunOptions(cache_gb=1.0))
    bounded = ReferenceEngine(str(tiny_realmix), RunOptions(cache_gb=budget / 2**30))
    assert_bit_identical(run(bounded), run(unbounded))
    st, free = bounded.cache_stats(), unbounded.cache_stats()
    assert free["evictions"] == free["layer_evictions"] == 0
    assert st["layer_evictions"] >= 6 and st["evictions"] > st["layer_evictions"]  # whole layers of several arrays
    assert st["peak_bytes"] <= st["budget"] and st["bytes"] <= st["budget"]
    assert st["misses"] > free["misses"]  # evicted layers were dequantized again


def test_reference_experts_beyond_the_budget_are_streamed_announced_bit_identical(tiny_realmix, capsys):
    w = Weights(str(tiny_realmix))
    dense = float32_bytes_by_layer(tiny_realmix, experts=False)
    slice_bytes = math.prod(w.info("blk.0.ffn_gate_exps.weight").shape[1:]) * 4  # one expert of one tensor
    budget = max(dense.values()) + 4 * slice_bytes  # every layer's dense weights + 4 expert slices
    bounded = ReferenceEngine(str(tiny_realmix), RunOptions(cache_gb=budget / 2**30))
    capsys.readouterr()
    got = run(bounded)
    assert "experts that do not fit are dequantized per use" in capsys.readouterr().err
    assert_bit_identical(got, run(ReferenceEngine(str(tiny_realmix), RunOptions(cache_gb=1.0))))
    st = bounded.cache_stats()
    assert st["streamed"] > 0 and st["peak_bytes"] <= st["budget"]


def test_reference_layer_over_the_budget_is_an_error(tiny_realmix):
    engine = ReferenceEngine(str(tiny_realmix), RunOptions(cache_gb=100e3 / 2**30))  # < one tiny attention layer
    with pytest.raises(TensorError, match=r"layer blk\.0 needs at least .*cache_gb = 0\.000 GiB"):
        run(engine)


def test_torch_small_budget_keeps_within_it_bit_identical(tiny_realmix):
    options = RunOptions(fp8_kv=False, fp4_indexer=False)
    sizes = float32_bytes_by_layer(tiny_realmix)
    roomy = TorchEngine(str(tiny_realmix), options, cache_mb=512)
    tight = TorchEngine(str(tiny_realmix), options, cache_mb=1)
    assert_bit_identical(run(tight), run(roomy))
    st = tight.cache_stats()
    assert 0 < st["bytes"] <= st["budget"] == 1 << 20
    assert st["not_kept"] > 0 and roomy.cache_stats()["not_kept"] == 0
    bound = tight.w.memory_bound()
    assert st["scratch_bytes"] <= bound["scratch"] + bound["expert_blocks"]
    assert bound["total"] < sum(sizes.values())  # bounded below the model's float32 size (48 MB)
