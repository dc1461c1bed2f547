"""`ReferenceEngine`: the pure-NumPy reference behind the `parity.contract.engine.Engine` protocol.

    engine = ReferenceEngine("model.gguf", RunOptions(fp8_kv=True, fp4_indexer=True, dtype="float64"))
    state = engine.new_state()
    X = engine.embed(tokens); out = engine.forward_layer(state, 0, X, tokens, start_pos=0); ...

Any chunk size at any start position runs through the same caches (prefill, chunked prefill, decode).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import numpy as np

from parity.contract.cpus import usable_cpus
from parity.contract.draft import DSparkRound, MTPOutput
from parity.contract.engine import LayerOutput, RunOptions, check_qat_shapes, check_tokens
from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig
from parity.gguf.drafter import Drafter, merged_weights, open_drafter
from parity.gguf.weights import Weights
from reference_cpu.allocator import keep_freed_memory
from reference_cpu.dequant import dequantize
from reference_cpu.draft import (
    Ring,
    check_tap_carriers,
    check_taps,
    confidence,
    dspark_main,
    dspark_stage,
    dspark_taps,
    first_max,
    main_kv,
    markov_chain,
    mtp_input,
    mtp_pairs,
    ring_write,
)
from reference_cpu.hc import hc_head, hc_init
from reference_cpu.linear import linear
from reference_cpu.model import Numerics, Tap, block_forward
from reference_cpu.norms import rms_norm
from reference_cpu.numerics import f16_round
from reference_cpu.rope import RopeSpec, RopeTable
from reference_cpu.roundoff import jitter
from reference_cpu.state import SequenceState, state_arrays
from reference_cpu.threads import Workers
from reference_cpu.weights_cache import WeightStore

VERSION = "0.1.0"
DTYPES = {"float32": np.float32, "float64": np.float64}


def check_options(options: RunOptions, cfg: ModelConfig) -> None:
    """Refuse options the reference cannot honour, naming the option (no silent fallback)."""
    if options.inject:
        raise ParityError(f"the reference engine does not inject faults (got {list(options.inject)}); "
                          "faults live in the torch engine")
    if options.dtype not in DTYPES:
        raise ParityError(f"reference dtype must be one of {', '.join(DTYPES)}, got {options.dtype!r}")
    arg_threads(options)
    if options.device != "cpu":
        raise ParityError(f"the reference engine (NumPy) runs on the CPU; device {options.device!r} is the torch "
                          "engine's option")
    check_qat_shapes(options, cfg.nope_dim, cfg.index_head_dim, "reference engine")


def arg_threads(options: RunOptions) -> int | None:
    """The engine argument threads=N (N >= 1), or None when not given; any other engine argument is refused."""
    threads = None
    for arg in options.engine_args:
        name, eq, value = arg.partition("=")
        if name != "threads" or not eq or not value.isdigit() or int(value) < 1:
            raise ParityError(f"the reference engine: unknown engine argument {arg!r}; the one it takes is "
                              f"threads=N (N >= 1)")
        threads = int(value)
    return threads


def layer_rope_spec(cfg: ModelConfig, layer: int) -> RopeSpec:
    """RoPE of a layer: plain rope_theta when ratio = 0, compress_rope_theta (+ YaRN if the file says so) else."""
    if cfg.ratio(layer) == 0:
        return RopeSpec(cfg.rope_head_dim, cfg.rope_theta, yarn=False)
    return RopeSpec(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.yarn, cfg.rope_factor, cfg.original_seq_len,
                    cfg.beta_fast, cfg.beta_slow)


class ReferenceEngine:
    """Exact-to-the-definition NumPy engine; weights memory-mapped and dequantized lazily under `options.cache_gb`.

    `threads` (or the engine argument threads=N): worker threads for independent experts, queries and output groups
    (neither given: the CPUs this process may use, `parity.contract.cpus.usable_cpus`); results are bit-identical
    for any count.
    """

    name = "reference"
    layerwise_state = True   # capability LayerwiseState: one cache per layer in a state

    def __init__(self, model_path: str, options: RunOptions, threads: int | None = None,
                 draft: str | None = None) -> None:
        keep_freed_memory()  # speed only: dequantized arrays reuse freed pages instead of faulting fresh ones
        self.weights = Weights(model_path)
        self.config: ModelConfig = self.weights.config
        # the draft head (`draft`: a drafter GGUF): its blocks are layers L.. of drafter.model_config
        self.drafter: Drafter | None = open_drafter(draft, self.config) if draft is not None else None
        source = self.weights if self.drafter is None else merged_weights(self.weights, self.drafter)
        self.identity = source.identity()
        check_options(options, self.config)
        self.options = options
        self.dtype = np.dtype(DTYPES[options.dtype])
        self.version = f"reference_cpu {VERSION} (numpy {np.__version__})"
        given = arg_threads(options)
        if threads is not None and given is not None and threads != given:
            raise ParityError(f"the reference engine: threads={threads} contradicts the engine argument "
                              f"threads={given}")
        self.workers = Workers(threads or given or usable_cpus())
        self.store = WeightStore(source, self.dtype, options.cache_gb, options.act_quant)
        self._configure(options)

    def _configure(self, options: RunOptions) -> None:
        """Everything that follows from the run options but the weights and their cache."""
        self.options = options
        self.numerics = Numerics(options.fp8_kv, options.fp4_indexer, options.expert_override,
                                 f16_round if options.kv_cache == "f16" else None)
        self.rope = [RopeTable.build(layer_rope_spec(self.config, l), self.dtype, options.rope_angles)
                     for l in range(self.config.n_layers)]
        if self.drafter is not None:
            dcfg = self.drafter.model_config
            self.rope += [RopeTable.build(layer_rope_spec(dcfg, l), self.dtype, options.rope_angles)
                          for l in range(self.config.n_layers, dcfg.n_layers)]
        self.jitter = None
        if options.roundoff_seed is not None:
            self._set_seed(options.roundoff_seed)
        if options.approximations():
            print(f"reference engine: APPROXIMATE {', '.join(options.approximations())}", file=sys.stderr)

    def variant(self, options: RunOptions) -> ReferenceEngine:
        """Capability `Variants`: this engine under other run options, sharing the opened file, the dequantized-
        weight cache and the threads (the cache holds plain dequantized arrays, which no option changes), so a
        variant costs no second copy of the weights. dtype and cache_gb must stay; other changes are refused as
        by the constructor."""
        for name in ("dtype", "cache_gb", "device", "engine_args"):
            if getattr(options, name) != getattr(self.options, name):
                raise ParityError(f"the reference engine: a variant cannot change {name} "
                                  f"({getattr(self.options, name)!r} -> {getattr(options, name)!r}); open a new engine")
        check_options(options, self.config)
        twin = copy.copy(self)
        twin.store = self.store.with_act_quant(options.act_quant)
        twin._configure(options)
        return twin

    def new_state(self) -> SequenceState:
        return SequenceState.empty(self.config, self.dtype)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """tokens [n] -> carrier [n, H, D]: H copies of the embedding row, no scaling (spec residual-ffn §6)."""
        tokens = check_tokens(tokens, self.config.vocab_size, "embed")
        return hc_init(self.store.rows("token_embd.weight", tokens), self.config.hc_mult)

    def forward_layer(self, state: SequenceState, layer: int, carrier: np.ndarray, tokens: np.ndarray,
                      start_pos: int, capture: bool = False) -> LayerOutput:
        """Layer `layer` on positions start_pos..start_pos+n-1 through `state` (any n >= 1)."""
        return self._layer(state, layer, carrier, tokens, start_pos, Tap({} if capture else None))

    def roundoff_twin(self, seed: int) -> ReferenceEngine:
        """Capability `RoundoffTwins`: this engine with roundoff_seed=seed, sharing weights, caches and threads."""
        twin = copy.copy(self)
        twin.options = replace(self.options, roundoff_seed=int(seed))
        twin._set_seed(int(seed))
        return twin

    def _set_seed(self, seed: int) -> None:
        """Monte-Carlo round-off with `seed`: every sub-op output, and every matmul input that gets rounded."""
        self.jitter = partial(jitter, seed=seed)
        self.numerics = replace(self.numerics, tie_seed=seed)
        self.store = self.store.with_input_jitter(lambda x, name, k: jitter(x, seed, f"in:{name}", k))

    def forward_ops(self, state: SequenceState, layer: int, carrier: np.ndarray, tokens: np.ndarray,
                    start_pos: int, given: dict[str, np.ndarray]) -> LayerOutput:
        """Capability `OpForcing`: every sub-op on the candidate's value of its inputs (`given`), captured."""
        return self._layer(state, layer, carrier, tokens, start_pos, Tap({}, given))

    def _layer(self, state: SequenceState, layer: int, carrier: np.ndarray, tokens: np.ndarray, start_pos: int,
               tap: Tap) -> LayerOutput:
        cfg = self.config
        if not 0 <= layer < cfg.n_layers:
            raise ParityError(f"layer {layer} out of range [0, {cfg.n_layers})")
        carrier = np.asarray(carrier)
        n = carrier.shape[0] if carrier.ndim == 3 else -1
        if carrier.shape != (n, cfg.hc_mult, cfg.dim) or n < 1:
            raise ParityError(f"layer {layer}: carrier shape {carrier.shape}, expected (n, {cfg.hc_mult}, {cfg.dim})")
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.shape != (n,):
            raise ParityError(f"layer {layer}: {len(tokens)} tokens for a carrier of {n} positions")
        if not np.isfinite(carrier).all():
            raise ParityError(f"layer {layer}: the input carrier holds non-finite values")
        if self.jitter is not None:
            tap.jitter = lambda y, name, k: self.jitter(y, name=f"{layer}:{name}", k=k)
        return block_forward(self.store, cfg, layer, state.layers[layer], carrier.astype(self.dtype, copy=False),
                             tokens, int(start_pos), self.rope[layer], self.numerics, tap, self.workers)

    def head(self, carrier: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """carrier [n, H, D] -> (final_norm [n, D], logits [n, V]): HC head, output_norm, output (§8.3)."""
        s, cfg = self.store, self.config
        z = hc_head(np.asarray(carrier).astype(self.dtype, copy=False), s.matrix("output_hc_fn.weight"),
                    float(s.dense("output_hc_scale.weight")[0]), s.dense("output_hc_base.weight"), cfg.norm_eps,
                    cfg.hc_eps)
        final = rms_norm(z, s.dense("output_norm.weight"), cfg.norm_eps)
        return final, linear(final, s.matrix("output.weight"))

    # -- draft heads (spec v4-mtp-dspark §2-§3) ---------------------------------------------------------------
    def _draft(self, kind: str) -> ModelConfig:
        """The drafter's model config, when this engine was opened with a drafter of `kind` (else an error)."""
        if self.drafter is None or self.drafter.config.kind != kind:
            got = "no drafter" if self.drafter is None else f"a {self.drafter.config.kind} drafter"
            raise ParityError(f"the reference engine: {kind} needs an engine opened with a {kind} drafter "
                              f"(draft=FILE); this one has {got}")
        if self.options.expert_override is not None:
            raise ParityError("the reference engine: expert_override replays trunk layers; the draft heads do not "
                              "take it")
        return self.drafter.model_config

    def new_mtp_state(self) -> SequenceState:
        """Fresh caches of the MTP block (layer L: its own window of W-1 raw rows; the trunk layers stay unused)."""
        return SequenceState.empty(self._draft("mtp"), self.dtype)

    def mtp_forward(self, state: SequenceState, carriers: np.ndarray, tokens: np.ndarray, start_pos: int,
                    pairing: str = "prev") -> MTPOutput:
        """The MTP block on the pairs of trunk rows of consecutive positions q0.. (carriers X^(L) [n, H, D], tokens
        t [n]): prev pairs X^(L)_{q-1} with t_q (n-1 pairs), same X^(L)_q with t_q (n pairs), §2.3. A pair's MTP
        position is its carrier's position, start_pos = q0: the MTP ring runs 0, 1, … in both pairings."""
        self._draft("mtp")
        tokens = check_tokens(tokens, self.config.vocab_size, "mtp_forward")
        carriers = np.asarray(carriers)
        if carriers.shape != (len(tokens), self.config.hc_mult, self.config.dim):
            raise ParityError(f"mtp_forward: carriers of shape {carriers.shape} for {len(tokens)} tokens, expected "
                              f"({len(tokens)}, {self.config.hc_mult}, {self.config.dim})")
        G, tau = mtp_pairs(carriers, tokens, pairing)
        if len(tau) == 0:
            raise ParityError(f"mtp_forward: {len(tokens)} rows make no {pairing} pair")
        return self._mtp_rows(state, G, tau, start_pos)

    def mtp_chain(self, state: SequenceState, last: MTPOutput, start_pos: int, depth: int) -> list[MTPOutput]:
        """Depths 2..depth after the pair `last` (its last row): depth k+1 feeds the block's own output carrier X1
        of depth k with its draft d_k = first argmax of its logits, at the next MTP position (start_pos = the
        position after `last`'s, §2.4). The chain rows go to a copy of `state` (scratch rows, §2.5 replay)."""
        if depth < 1:
            raise ParityError(f"mtp_chain: depth must be >= 1, got {depth}")
        scratch = copy.deepcopy(state)
        G, logits, outs = last.carrier[-1:], last.logits[-1], []
        for k in range(depth - 1):
            out = self._mtp_rows(scratch, G, np.array([first_max(logits)]), start_pos + k)
            outs.append(out)
            G, logits = out.carrier, out.logits[0]
        return outs

    def _mtp_rows(self, state: SequenceState, G: np.ndarray, tau: np.ndarray, start_pos: int) -> MTPOutput:
        """X0 = mtp_input(E[τ], G); X1 = Block_L(X0); logits = W_out norm(HC_head_mtp(X1)) (§2.2)."""
        s, cfg, L = self.store, self._draft("mtp"), self.config.n_layers
        X0 = self._jit(mtp_input(s.rows("token_embd.weight", tau), G.astype(self.dtype, copy=False),
                                 s.dense("mtp.enorm.weight"), s.dense("mtp.hnorm.weight"),
                                 s.matrix("mtp.e_proj.weight"), s.matrix("mtp.h_proj.weight"), cfg.norm_eps),
                       "mtp_input", 2 * cfg.dim)
        out = block_forward(s, cfg, L, state.layers[L], X0, tau, int(start_pos), self.rope[L], self.numerics,
                            Tap(None, jitter=self._draft_jitter(L)), self.workers)
        z = hc_head(out.carrier, s.matrix("mtp.hc_head_fn.weight"), float(s.dense("mtp.hc_head_scale.weight")[0]),
                    s.dense("mtp.hc_head_base.weight"), cfg.norm_eps, cfg.hc_eps)
        logits = self._jit(linear(rms_norm(z, s.dense("mtp.norm.weight"), cfg.norm_eps), s.matrix("output.weight")),
                           "mtp_logits", cfg.dim)
        return MTPOutput(X0, out.attn_carrier, out.carrier, logits, out.diag.expert_ids)

    def _draft_jitter(self, layer: int) -> Callable[[np.ndarray, str, int], np.ndarray] | None:
        """A round-off twin's per-sub-op perturbation inside draft block `layer` (None in the exact engine)."""
        jit = self.jitter
        return None if jit is None else lambda y, name, k: jit(y, name=f"{layer}:{name}", k=k)

    def _jit(self, y: np.ndarray, name: str, k: int) -> np.ndarray:
        """A round-off twin's perturbation of a draft-head output outside the blocks (y itself when exact)."""
        return y if self.jitter is None else self.jitter(y, name=f"draft:{name}", k=k)

    def new_dspark_state(self) -> list[Ring]:
        """One empty W-slot ring of committed main KV rows per DSpark stage."""
        cfg = self._draft("dspark")
        return [Ring.empty(cfg.window_size, cfg.head_dim, self.dtype) for _ in range(self.drafter.config.n_blocks)]

    def dspark_taps(self, carriers: list[np.ndarray]) -> np.ndarray:
        """The tap rows T [c, m·D] `dspark_round` takes: `draft.dspark_taps` of the output carriers X^(l+1) [c, H, D]
        of the tapped layers `drafter.config.target_layer_ids`, in that order (§3.2)."""
        cfg = self._draft("dspark")
        arrays = check_tap_carriers(carriers, self.drafter.config.target_layer_ids, cfg.hc_mult, cfg.dim)
        return dspark_taps([a.astype(self.dtype, copy=False) for a in arrays])

    def dspark_round(self, state: list[Ring], taps: np.ndarray, start_pos: int, anchor: int) -> DSparkRound:
        """Write the main rows of positions start_pos..p (taps [c, m·D], `draft.dspark_taps` of the trunk rows;
        prefill: every prompt row; later: every newly committed row, §3.5) into each stage's ring, then draft the
        block [anchor, ν × (B-1)] at positions p+1..p+B from start position p = start_pos + c - 1 (§3.3)."""
        cfg, dc, s, L = self._draft("dspark"), self.drafter.config, self.store, self.config.n_layers
        taps = check_taps(np.asarray(taps), len(dc.target_layer_ids), cfg.dim).astype(self.dtype, copy=False)
        pos = int(start_pos) + np.arange(len(taps))
        p = int(pos[-1])
        if p < 1:
            raise ParityError("dspark_round: a draft needs start position p >= 1 (a 1-token prompt cannot draft)")
        M = self._jit(dspark_main(taps, s.matrix("dspark.main_proj.weight"), s.dense("dspark.main_norm.weight"),
                                  cfg.norm_eps), "dspark_main", taps.shape[1])
        for k in range(dc.n_blocks):
            state[k] = ring_write(state[k], main_kv(s, cfg, L + k, M, pos, self.rope[L + k], self.numerics), pos)
        block = check_tokens(np.array([anchor] + [dc.noise_token_id] * (dc.block_size - 1)), cfg.vocab_size,
                             "dspark_round")
        X, stages, ids = hc_init(s.rows("token_embd.weight", block), cfg.hc_mult), [], []
        for k in range(dc.n_blocks):
            out = dspark_stage(s, cfg, L + k, state[k], X, block, p, self.rope[L + k], self.numerics, self.workers,
                               self._draft_jitter(L + k))
            X = out.carrier
            stages.append(X)
            ids.append(out.diag.expert_ids)
        z = hc_head(X, s.matrix("dspark.hc_head_fn.weight"), float(s.dense("dspark.hc_head_scale.weight")[0]),
                    s.dense("dspark.hc_head_base.weight"), cfg.norm_eps, cfg.hc_eps)
        base = self._jit(linear(rms_norm(z, s.dense("dspark.norm.weight"), cfg.norm_eps), s.matrix("output.weight")),
                         "dspark_base_logits", cfg.dim)
        w2 = s.matrix("dspark.markov_w2.weight")
        drafts, biased, u = markov_chain(base, int(anchor), s.dense("dspark.markov_w1.weight"), w2)
        return DSparkRound(M[-1], stages, ids, base, self._jit(linear(u, w2), "dspark_bias", u.shape[1]), biased,
                           self._jit(confidence(z, u, s.matrix("dspark.conf_proj.weight")), "dspark_confidence",
                                     cfg.dim + u.shape[1]), drafts)

    def snapshot(self, state: SequenceState | list[Ring]) -> SequenceState | list[Ring]:
        """Capability `StateSnapshots`: a deep copy of a trunk or drafter state (plain dataclasses of numpy arrays).
        Cost: one copy of every cached array, O(L·(W + m + N_comp)·hd) floats for a trunk state."""
        return copy.deepcopy(state)

    def restore(self, state: SequenceState | list[Ring], saved: SequenceState | list[Ring]
                ) -> SequenceState | list[Ring]:
        """Capability `StateSnapshots`: the snapshot replaces the state (it is a deep copy)."""
        return saved

    def state_arrays(self, state: SequenceState | list[Ring]) -> dict[str, np.ndarray]:
        """Capability `StateView`: a trunk / MTP state or the DSpark rings as named arrays (common layout)."""
        if isinstance(state, list):
            return {f"dspark.{k}.{f}": np.asarray(getattr(r, f)) for k, r in enumerate(state) for f in ("rows", "pos")}
        return state_arrays(state)

    def cache_stats(self) -> dict[str, int]:
        """Capability: statistics of the dequantized-weight LRU cache."""
        return self.store.cache.stats()

    @staticmethod
    def dequantizer(raw: np.ndarray, ggml_type: int, shape: tuple[int, int], device: str) -> Callable[[], np.ndarray]:
        """Capability for benchmarks: a callable dequantizing `raw` on the CPU (the only device it has), with the
        allocator tuning the engine applies at load (`allocator.keep_freed_memory`)."""
        if device != "cpu":
            raise ParityError(f"reference engine: dequantizer runs on the CPU only, not {device!r}")
        keep_freed_memory()
        flat = raw.reshape(-1)
        return lambda: dequantize(flat, ggml_type, shape)
