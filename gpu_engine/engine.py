"""`TorchEngine`: the production-style torch implementation of the `parity.contract.engine.Engine` protocol.

Weights stay in their GGUF block formats on the device (CUDA when present with device=auto) and are
dequantized per use; prefill is batched over all new positions, decode reuses the same code with n = 1
on the per-layer caches. numpy arrays at the boundary: float32 (float64 with dtype=float64; the
approximate bfloat16 path also returns float32).
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from gpu_engine.attention import LayerCache, new_layer_cache, restore_keeping_rows
from gpu_engine.compressor import compressor_arrays
from gpu_engine.cpu_kernels import load as load_kernels
from gpu_engine.dequant import dequantize
from gpu_engine.draft import Ring, check_tap_carriers, check_taps, confidence, dspark_main
from gpu_engine.draft_blocks import dspark_stage, main_kv
from gpu_engine.faults import DRAFT_FAULTS, FAULTS, SPEC_FAULTS, Faults, compose, fault_layers
from gpu_engine.fit import fit_dspark, fit_mtp
from gpu_engine.hc import hc_head
from gpu_engine.linear import linear
from gpu_engine.model import BlockResult, LayerPlan, Ops, block_forward
from gpu_engine.ops import (
    fp4_e2m1_roundtrip,
    fp8_sim_nope,
    hadamard_matrix,
    identity,
    q8_0_roundtrip,
    rms_norm,
    rope_frequencies,
)
from gpu_engine.weights import UNQUANTIZED, DeviceWeights
from parity.contract.cpus import usable_cpus
from parity.contract.draft import DSparkRound, MTPOutput
from parity.contract.engine import (
    LayerDiag,
    LayerOutput,
    RunOptions,
    check_expert_ids,
    check_qat_shapes,
    check_tokens,
    refuse_roundoff,
)
from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig
from parity.gguf.drafter import Drafter, merged_weights, open_drafter
from parity.gguf.weights import Weights

__version__ = "0.1.0"
DEFAULT_CACHE_MB = 512  # kept dequantized dense matrices (speed only: the cached values are the exact dequantization)
DTYPES = {"float32": (torch.float32, torch.float32), "float64": (torch.float64, torch.float64),
          "bfloat16": (torch.float32, torch.bfloat16)}  # (activations/state, matmul operands)
ACT_QUANT = {"none": None, "q8_0": q8_0_roundtrip}  # act_quant values this engine implements
# what each approximate mode does, for the stderr announcement (keys as RunOptions.approximations() names them)
APPROXIMATIONS = {"dtype=bfloat16": "bf16 matmul operands, fp32 state",
                  "act_quant=q8_0": "activations rounded to Q8_0 blocks of 32 before every matmul with a quantized "
                                    "weight, as llama.cpp's CPU backend"}


MAX_EXPERT_THREADS = 8  # more threads than a decode step's 6 experts gain nothing


def thread_map(pool: ThreadPoolExecutor) -> Callable[..., Iterator]:
    """map(fn, items) on `pool`, results in item order; each call runs in inference mode (thread-local in torch)."""
    def run(fn: Callable, items: Iterable) -> Iterator:
        def call(item):
            with torch.inference_mode():
                return fn(item)

        return pool.map(call, items)

    return run


def check_options(options: RunOptions, cache_mb: int) -> None:
    """Refuse what the torch engine cannot honour, naming the option (no silent fallback to the exact path)."""
    if options.dtype not in DTYPES:
        raise ParityError(f"torch engine: unknown dtype {options.dtype!r}; expected {', '.join(DTYPES)}")
    refuse_roundoff(options, "torch engine")
    if cache_mb < 0:
        raise ParityError(f"torch engine: cache_mb must be >= 0, got {cache_mb}")
    if options.act_quant not in ACT_QUANT:
        raise ParityError(f"torch engine: act_quant={options.act_quant} is not implemented "
                          f"(implemented: {', '.join(ACT_QUANT)})")
    for name, exact in (("kv_cache", "f32"), ("rope_angles", "exact")):
        if getattr(options, name) != exact:
            raise ParityError(f"torch engine: {name}={getattr(options, name)} is not implemented "
                              f"(implemented: {exact})")
    engine_args(options)


def engine_args(options: RunOptions) -> tuple[str, int | None]:
    """The engine arguments (cpu_kernels, threads): cpu_kernels=native|torch (default native): on the CPU, dequantize
    and multiply by the compiled kernels of `gpu_engine.cpu_kernels`, or by torch ops only; threads=N (N >= 1):
    torch's intra-op threads, None when not given (`TorchEngine` then uses one per usable CPU). Any other engine
    argument is refused."""
    kernels, threads = "native", None
    for arg in options.engine_args:
        name, eq, value = arg.partition("=")
        if name == "cpu_kernels" and eq and value in ("native", "torch"):
            kernels = value
        elif name == "threads" and eq and value.isdigit() and int(value) >= 1:
            threads = int(value)
        else:
            raise ParityError(f"torch engine: unknown engine argument {arg!r}; the ones it takes are "
                              f"cpu_kernels=native|torch and threads=N (N >= 1)")
    return kernels, threads


def cpu_kernels(options: RunOptions) -> str:
    """The engine argument cpu_kernels=native|torch (default native); see `engine_args`."""
    return engine_args(options)[0]


def intra_op_threads(options: RunOptions) -> int:
    """torch's intra-op thread count for this engine: the engine argument threads=N, else one per usable CPU
    (`parity.contract.cpus.usable_cpus`: affinity and cgroup quota), whatever OMP_NUM_THREADS says. On a busy
    machine the scheduler shares the cores per runnable thread, so an engine held to one thread by an inherited
    OMP_NUM_THREADS=1 got about half the CPU time of a two-thread one (docs/bench.md "Under load")."""
    return engine_args(options)[1] or usable_cpus()


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available else cpu; an explicit cuda without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ParityError("device 'cuda' requested but torch sees no CUDA device (use --device cpu or auto)")
    if name not in ("cpu", "cuda"):
        raise ParityError(f"unknown device {name!r}; expected auto, cuda or cpu")
    return torch.device(name)


class TorchState:
    """Per-sequence state: one `LayerCache` per layer."""

    def __init__(self, layers: list[LayerCache]) -> None:
        self.layers = layers


class TorchEngine:
    name = "torch"
    layerwise_state = True   # capability LayerwiseState: one cache per layer in a state
    faults = FAULTS  # capability: the porting bugs of the trunk RunOptions.inject can switch on
    draft_faults = DRAFT_FAULTS  # those of the draft heads (RunOptions.inject takes them too; the trunk ignores them)
    spec_faults = SPEC_FAULTS  # those of the speculative path (verify batches, snapshots; plain decode ignores them)

    def __init__(self, model_path: str, options: RunOptions, cache_mb: int = DEFAULT_CACHE_MB,
                 expert_threads: int | None = None, draft: str | None = None) -> None:
        check_options(options, cache_mb)
        if expert_threads is not None and expert_threads < 1:
            raise ParityError(f"torch engine: expert_threads must be >= 1, got {expert_threads}")
        self.options = options
        self.switches = Faults.parse(options.inject)
        self.device = resolve_device(options.device)
        self.act, self.mm = DTYPES[options.dtype]
        # torch's intra-op threads: process-wide in torch, so set here and again by each forward_layer call
        self.threads = intra_op_threads(options)
        self._use_threads()
        self.expert_threads = expert_threads or (min(usable_cpus(), MAX_EXPERT_THREADS)
                                                 if self.device.type == "cpu" else 1)
        self._pool = ThreadPoolExecutor(self.expert_threads) if self.expert_threads > 1 else None
        run = thread_map(self._pool) if self._pool else map
        native = self.device.type == "cpu" and cpu_kernels(options) == "native"
        trunk = Weights(str(model_path))
        # the draft head (`draft`: a drafter GGUF): its blocks are layers L.. of drafter.model_config
        self.drafter: Drafter | None = open_drafter(draft, trunk.config) if draft is not None else None
        self.w = DeviceWeights(str(model_path), self.device, self.act, self.mm, cache_mb, ACT_QUANT[options.act_quant],
                               load_kernels() if native else None, run, self.expert_threads,
                               trunk if self.drafter is None else merged_weights(trunk, self.drafter))
        kernels = ", native CPU kernels" if native else ""
        self.version = (f"gpu_engine {__version__} (torch {torch.__version__}, {self.device.type}{kernels}, "
                        f"{self.threads} intra-op thread{'s' if self.threads > 1 else ''})")
        self.config = self.cfg = cfg = trunk.config
        self.identity = self.w.source.identity()
        check_qat_shapes(options, cfg.nope_dim, cfg.index_head_dim, "torch engine")
        self._check_hash_tables()
        self._check_act_quant()
        # the layer schedule: the compress-ratios-u32 fault reads it as empty (every layer ratio 0)
        u32 = self.switches.compress_ratios_u32
        self.ratios = tuple(0 for _ in cfg.compress_ratios) if u32 else cfg.compress_ratios
        self.plans = [LayerPlan(l, r, self._freqs(r)) for l, r in enumerate(self.ratios)]
        self._compose_ops(run)
        self._announce()

    def _compose_ops(self, run: Callable) -> None:
        """`ops` (the draft heads' and every layer's without FAULT@LAYERS) and `layer_ops` (per layer): the faults
        composed with the QAT simulations, experts mapped by `run`. FAULT@LAYERS: those faults act only in the
        named layers' ops (`faults.fault_layers`); the others, and the draft heads' ops, as named without layers."""
        self.fault_layers = fault_layers(self.options.inject, self.cfg.n_layers)
        qat = self._qat_ops()
        self.ops = replace(compose(self.switches.without(set(self.fault_layers)), qat), expert_map=run)
        self.layer_ops = [replace(compose(self.switches.without({f for f, at in self.fault_layers.items()
                                                                 if l not in at}), qat), expert_map=run)
                          if self.fault_layers else self.ops for l in range(self.cfg.n_layers)]

    def cache_stats(self) -> dict[str, int]:
        """Capability `CacheStats`: the kept dequantized matrices and scratch buffers (`DeviceWeights.cache_stats`)."""
        return self.w.cache_stats()

    def _use_threads(self) -> None:
        """torch's intra-op thread count is process-wide: make it this engine's (another engine may have set it)."""
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def _check_hash_tables(self) -> None:
        """Every hash layer's tid2eid entry names an expert in [0, n_routed_experts) (checked once, at load)."""
        for l in range(self.cfg.n_layers):
            if self.cfg.is_hash_layer(l):
                name = f"blk.{l}.ffn_gate_tid2eid.weight"
                check_expert_ids(self.w.table(name).cpu().numpy(), self.cfg.n_routed_experts, f"tensor {name}")

    def _check_act_quant(self) -> None:
        """The HC mixing matrices are applied outside `DeviceWeights`' products: act_quant is refused for a file
        where one of them is quantized (deepseek4 files store them F16 or F32)."""
        if self.w.act_quant is None:
            return
        hc = ["output_hc_fn.weight", *(f"blk.{l}.hc_{k}_fn.weight" for l in range(self.cfg.n_layers)
                                       for k in ("attn", "ffn"))]
        for name in hc:
            if self.w.q[name].qtype not in UNQUANTIZED:
                raise ParityError(f"torch engine: act_quant={self.options.act_quant} is not implemented for the "
                                  f"quantized HC matrix {name} ({self.w.q[name].qtype.name})")

    def _qat_ops(self) -> Ops:
        """The model's ops with the QAT round trips the options enable."""
        opts, cfg = self.options, self.cfg
        had = hadamard_matrix(cfg.index_head_dim, self.act, self.device)
        return Ops(kv_round=partial(fp8_sim_nope, nope_dim=cfg.nope_dim) if opts.fp8_kv else identity,
                   index_round=(lambda x: fp4_e2m1_roundtrip(x @ had)) if opts.fp4_indexer else identity)

    def _announce(self) -> None:
        for mode in self.options.approximations():
            print(f"torch engine: APPROXIMATE {mode} ({APPROXIMATIONS[mode]})", file=sys.stderr)
        if self.switches.active:
            named = [f + (f"@{','.join(map(str, sorted(self.fault_layers[f])))}" if f in self.fault_layers else "")
                     for f in self.switches.active]
            print(f"torch engine: FAULTS INJECTED: {', '.join(named)}", file=sys.stderr)

    def _freqs(self, ratio: int) -> torch.Tensor:
        cfg = self.cfg
        if ratio == 0:
            f = rope_frequencies(cfg.rope_head_dim, cfg.rope_theta, False, 1.0, 0, 0.0, 0.0)
        else:
            f = rope_frequencies(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.yarn, cfg.rope_factor,
                                 cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow)
        return f.to(dtype=self.act, device=self.device)

    # -- numpy boundary ---------------------------------------------------------------------------------
    def _in(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=self.device, dtype=self.act)

    def _out(self, t: torch.Tensor) -> np.ndarray:
        t = t.detach()
        if t.is_floating_point():
            t = t.to(torch.float64 if self.act == torch.float64 else torch.float32)
        return t.cpu().numpy()

    # -- Engine protocol -------------------------------------------------------------------------------
    def new_state(self) -> TorchState:
        return TorchState([new_layer_cache(self.cfg, r, self.device, self.act) for r in self.ratios])

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        tokens = check_tokens(tokens, self.cfg.vocab_size, "embed")
        e = self.w.rows("token_embd.weight", torch.from_numpy(tokens).to(self.device))
        return self._out(e[:, None, :].expand(-1, self.cfg.hc_mult, -1))

    def forward_layer(self, state: TorchState, layer: int, carrier: np.ndarray, tokens: np.ndarray,
                      start_pos: int, capture: bool = False) -> LayerOutput:
        cfg = self.cfg
        if not 0 <= layer < cfg.n_layers:
            raise ParityError(f"layer {layer} out of range [0, {cfg.n_layers})")
        cache = state.layers[layer]
        if cache.pos != start_pos:
            raise ParityError(f"layer {layer}: cache holds positions < {cache.pos}, call starts at {start_pos}")
        self._use_threads()
        n = carrier.shape[0]
        if carrier.shape != (n, cfg.hc_mult, cfg.dim) or len(tokens) != n or n < 1:
            raise ParityError(f"layer {layer}: carrier {carrier.shape} / tokens {len(tokens)} do not match "
                              f"[n >= 1, {cfg.hc_mult}, {cfg.dim}]")
        if not np.isfinite(carrier).all():
            raise ParityError(f"layer {layer}: the input carrier holds non-finite values")
        tok = torch.from_numpy(check_tokens(tokens, cfg.vocab_size, f"layer {layer}")).to(self.device)
        with torch.inference_mode():
            res = block_forward(self.w, cfg, self.layer_ops[layer], self.plans[layer], cache, self._in(carrier), tok,
                                start_pos, self.options.expert_override, capture)
            diag = self._diag(layer, res)
            return LayerOutput(self._out(res.attn_carrier), self._out(res.carrier), diag,
                               self._captures(res, diag) if capture else {})

    def _diag(self, layer: int, res: BlockResult) -> LayerDiag:
        """The layer's diagnostics.  index_sel follows the model (an array on the file's CSA layers, None elsewhere);
        a layer the engine ran without an indexer (compress-ratios-u32) reports no selection (-1)."""
        sel = None
        if self.cfg.has_indexer(layer):
            n, sel_t = res.carrier.shape[0], res.attn.index_sel
            sel = self._out(sel_t) if sel_t is not None else np.full((n, self.cfg.index_topk), -1, dtype=np.int64)
        r = res.routing
        pre_a, post_a, comb_a = (self._out(t) for t in res.hc_attn)
        pre_f, post_f, comb_f = (self._out(t) for t in res.hc_ffn)
        return LayerDiag(hc_attn=(pre_a, post_a, comb_a), hc_ffn=(pre_f, post_f, comb_f),
                         expert_ids=self._out(r.ids), expert_weights=self._out(r.weights),
                         router_margin=self._out(r.margin), n_comp_visible=self._out(res.attn.n_comp_visible),
                         index_sel=sel)

    def _captures(self, res: BlockResult, diag: LayerDiag) -> dict[str, np.ndarray]:
        """Every sub-op of `parity.contract.checkpoints.SUBOPS` (empty row sets where the layer emits none)."""
        cfg, n = self.cfg, res.carrier.shape[0]
        dt = np.float64 if self.act == torch.float64 else np.float32
        captures = {k: self._out(t) for k, t in res.captures.items()}
        captures.setdefault("comp_rows", np.zeros((0, cfg.head_dim), dt))
        captures.setdefault("index_rows", np.zeros((0, cfg.index_head_dim), dt))
        captures["index_sel"] = (diag.index_sel if diag.index_sel is not None
                                 else np.full((n, cfg.index_topk), -1, dtype=np.int64))
        captures.update(expert_ids=diag.expert_ids, expert_weights=diag.expert_weights)
        return captures

    # -- draft heads (spec v4-mtp-dspark §2-§3) ---------------------------------------------------------------
    def _draft(self, kind: str) -> ModelConfig:
        """The drafter's model config, when this engine was opened with a drafter of `kind` (else an error)."""
        if self.drafter is None or self.drafter.config.kind != kind:
            got = "no drafter" if self.drafter is None else f"a {self.drafter.config.kind} drafter"
            raise ParityError(f"torch engine: {kind} needs an engine opened with a {kind} drafter (draft=FILE); "
                              f"this one has {got}")
        if self.options.expert_override is not None:
            raise ParityError("torch engine: expert_override replays trunk layers; the draft heads do not take it")
        if self.options.approximations():  # the heads' own projections multiply dense matrices, unrounded
            raise ParityError(f"torch engine: {', '.join(self.options.approximations())} is not implemented for "
                              "the draft heads")
        return self.drafter.model_config

    def _draft_plan(self, layer: int) -> LayerPlan:
        return LayerPlan(layer, 0, self._freqs(0))

    def new_mtp_state(self) -> TorchState:
        """Fresh caches of the MTP block (layer L: its own raw window; the trunk layers stay unused)."""
        cfg = self._draft("mtp")
        return TorchState([new_layer_cache(cfg, cfg.ratio(l), self.device, self.act) for l in range(cfg.n_layers)])

    def mtp_forward(self, state: TorchState, carriers: np.ndarray, tokens: np.ndarray, start_pos: int,
                    pairing: str = "prev") -> MTPOutput:
        """The MTP block on the prev / same pairs of trunk rows of consecutive positions (as the reference's)."""
        self._draft("mtp")
        tokens = check_tokens(tokens, self.cfg.vocab_size, "mtp_forward")
        carriers = np.asarray(carriers)
        if carriers.shape != (len(tokens), self.cfg.hc_mult, self.cfg.dim):
            raise ParityError(f"mtp_forward: carriers of shape {carriers.shape} for {len(tokens)} tokens, expected "
                              f"({len(tokens)}, {self.cfg.hc_mult}, {self.cfg.dim})")
        G, tau = self.ops.mtp_pairs(self._in(carriers), torch.from_numpy(tokens).to(self.device), pairing)
        if len(tau) == 0:
            raise ParityError(f"mtp_forward: {len(tokens)} rows make no {pairing} pair")
        with torch.inference_mode():
            return self._mtp_rows(state, G, tau, start_pos)

    def mtp_chain(self, state: TorchState, last: MTPOutput, start_pos: int, depth: int) -> list[MTPOutput]:
        """Depths 2..depth after the pair `last`: X1 of depth k with its first-argmax draft, on a copy of `state`."""
        if depth < 1:
            raise ParityError(f"mtp_chain: depth must be >= 1, got {depth}")
        scratch = TorchState([copy.copy(c) for c in state.layers])  # tensors are replaced, never written in place
        G, logits, outs = last.carrier[-1:], last.logits[-1], []
        with torch.inference_mode():
            for k in range(depth - 1):
                tau = torch.tensor([int(np.argmax(logits))], device=self.device)
                out = self._mtp_rows(scratch, self._in(G), tau, start_pos + k)
                outs.append(out)
                G, logits = out.carrier, out.logits[0]
        return outs

    def _mtp_rows(self, state: TorchState, G: torch.Tensor, tau: torch.Tensor, start_pos: int) -> MTPOutput:
        """X0 = mtp_input(E[τ], G); X1 = Block_L(X0); logits = W_out norm(HC_head_mtp(X1))."""
        w, cfg, L = self.w, self._draft("mtp"), self.cfg.n_layers
        cache = state.layers[L]
        if cache.pos != start_pos:
            raise ParityError(f"mtp: the MTP ring holds positions < {cache.pos}, call starts at {start_pos}")
        X0 = self.ops.mtp_input(w.rows("token_embd.weight", tau), G, w.vector("mtp.enorm.weight"),
                                w.vector("mtp.hnorm.weight"), w.matrix("mtp.e_proj.weight", self.act),
                                w.matrix("mtp.h_proj.weight", self.act), cfg.norm_eps)
        res = block_forward(w, cfg, self.ops, self._draft_plan(L), cache, X0, tau, start_pos, None, False)
        X1 = self.ops.mtp_carrier(res.attn_carrier, res.carrier)
        z = self.ops.mtp_hc_head(w, cfg, X1)
        logits = linear(rms_norm(z, w.vector("mtp.norm.weight"), cfg.norm_eps), w.weight("output.weight"))
        return MTPOutput(*(self._out(t) for t in (X0, res.attn_carrier, X1, logits, res.routing.ids)))

    def new_dspark_state(self) -> list[Ring]:
        """One empty W-slot ring of committed main KV rows per DSpark stage."""
        cfg = self._draft("dspark")
        return [Ring.empty(cfg.window_size, cfg.head_dim, self.device, self.act)
                for _ in range(self.drafter.config.n_blocks)]

    def dspark_taps(self, carriers: list[np.ndarray]) -> np.ndarray:
        """The tap rows T [c, m·D] `dspark_round` takes: concat over the tapped layers of the stream mean of their
        output carriers (`carriers`: X^(l+1) [c, H, D] of each l in `drafter.config.target_layer_ids`, in order)."""
        cfg = self._draft("dspark")
        arrays = check_tap_carriers(carriers, self.drafter.config.target_layer_ids, cfg.hc_mult, cfg.dim)
        with torch.inference_mode():
            return self._out(self.ops.dspark_taps([self._in(a) for a in arrays]))

    def dspark_round(self, state: list[Ring], taps: np.ndarray, start_pos: int, anchor: int) -> DSparkRound:
        """Write the main rows of positions start_pos..p into each stage's ring, then draft the block [anchor,
        ν × (B-1)] at p+1..p+B from start position p = start_pos + c - 1 (as the reference's)."""
        cfg, dc, w, L = self._draft("dspark"), self.drafter.config, self.w, self.cfg.n_layers
        taps = check_taps(np.asarray(taps), len(dc.target_layer_ids), cfg.dim)
        p = int(start_pos) + len(taps) - 1
        if p < 1:
            raise ParityError("dspark_round: a draft needs start position p >= 1 (a 1-token prompt cannot draft)")
        block = check_tokens(np.array([anchor] + [dc.noise_token_id] * (dc.block_size - 1)), cfg.vocab_size,
                             "dspark_round")
        with torch.inference_mode():
            pos = torch.arange(int(start_pos), p + 1, device=self.device)
            M = dspark_main(self._in(taps), w.matrix("dspark.main_proj.weight", self.act),
                            w.vector("dspark.main_norm.weight"), cfg.norm_eps)
            plans = [self._draft_plan(L + k) for k in range(dc.n_blocks)]
            for k, plan in enumerate(plans):
                state[k] = self.ops.ring_write(state[k], main_kv(w, cfg, self.ops, plan, M, pos), pos)
            tok = torch.from_numpy(block).to(self.device)
            X = w.rows("token_embd.weight", tok)[:, None, :].expand(-1, cfg.hc_mult, -1)
            stages, ids = [], []
            for k, plan in enumerate(plans):
                _, X, r = dspark_stage(w, cfg, self.ops, plan, state[k], X, tok, p)
                stages.append(self._out(X))
                ids.append(self._out(r.ids))
            z = hc_head(X, w.matrix("dspark.hc_head_fn.weight", self.act), w.vector("dspark.hc_head_scale.weight"),
                        w.vector("dspark.hc_head_base.weight"), cfg.norm_eps, cfg.hc_eps)
            base = linear(rms_norm(z, w.vector("dspark.norm.weight"), cfg.norm_eps), w.weight("output.weight"))
            w2 = w.matrix("dspark.markov_w2.weight", self.act)
            drafts, biased, u = self.ops.markov_chain(base, int(anchor), w.matrix("dspark.markov_w1.weight", self.act),
                                                      w2)
            conf = confidence(z, u, w.matrix("dspark.conf_proj.weight", self.act))
            return DSparkRound(self._out(M[-1]), stages, ids, self._out(base), self._out(u @ w2.T),
                               self._out(biased), self._out(conf), self._out(drafts))

    def snapshot(self, state: TorchState | list[Ring]) -> TorchState | list[Ring]:
        """Capability `StateSnapshots`: a deep copy of a trunk or drafter state (every cached tensor cloned on its
        device). Cost: one copy of every cached tensor, O(L·(W + m + N_comp)·hd) elements for a trunk state."""
        return copy.deepcopy(state)

    def restore(self, state: TorchState | list[Ring], saved: TorchState | list[Ring]) -> TorchState | list[Ring]:
        """Capability `StateSnapshots`: the snapshot replaces the state (the fault spec-no-compressor-restore keeps
        the live compressors' emitted rows)."""
        if self.switches.spec_no_compressor_restore and isinstance(state, TorchState):
            return TorchState(restore_keeping_rows(state.layers, saved.layers))
        return saved

    def verify_argmax(self, logits: np.ndarray) -> np.ndarray:
        """Capability `VerifyPicks`: this engine's greedy pick of each verify row [q, V] -> [q] (`Ops.verify_argmax`:
        the first of equal maxima; the fault spec-tie-last-max takes the last)."""
        return self.ops.verify_argmax(logits)

    def next_row(self, accepted: int, verified: int) -> int:
        """Capability `VerifyPicks`: the verify row the next step continues from (`Ops.next_row`: row a' = accepted;
        the fault spec-logits-row-stale takes the last verify row after a partial accept)."""
        return self.ops.next_row(accepted, verified)

    def state_arrays(self, state: TorchState | list[Ring]) -> dict[str, np.ndarray]:
        """Capability `StateView`: a trunk / MTP state or the DSpark rings as named arrays (common layout)."""
        if isinstance(state, list):
            return {f"dspark.{k}.{f}": self._out(getattr(r, f)) for k, r in enumerate(state) for f in ("rows", "pos")}
        out = {}
        for l, cache in enumerate(state.layers):
            if cache.pos == 0:
                continue
            out[f"blk.{l}.raw"] = cache.raw
            m = self.ratios[l] if l < self.cfg.n_layers else 0
            for name, c in (("comp", cache.main), ("index", cache.index)):
                if c is not None and m:
                    out |= compressor_arrays(f"blk.{l}.{name}", c, m, cache.pos)
        return {k: self._out(v) for k, v in out.items()}

    def head(self, carrier: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cfg, w = self.cfg, self.w
        with torch.inference_mode():
            z = hc_head(self._in(carrier), w.matrix("output_hc_fn.weight", self.act),
                        w.vector("output_hc_scale.weight"), w.vector("output_hc_base.weight"), cfg.norm_eps, cfg.hc_eps)
            final = rms_norm(z, w.vector("output_norm.weight"), cfg.norm_eps)
            logits = linear(final, w.weight("output.weight"))
        return self._out(final), self._out(logits)

    # capabilities for `v4parity synth --draft mtp|dspark --fit`: Adam through this engine's own draft-head ops
    fit_mtp = staticmethod(fit_mtp)
    fit_dspark = staticmethod(fit_dspark)

    @staticmethod
    def dequantizer(raw: np.ndarray, ggml_type: int, shape: tuple[int, int], device: str) -> Callable[[], np.ndarray]:
        """Capability for benchmarks: the bytes staged on `device` and the float32 output allocated once (the engine
        dequantizes into reused scratch buffers too); the callable dequantizes into it, on the CPU by the native
        kernels as the engine does by default (the returned array on the CPU is a view of that buffer, rewritten by
        the next call)."""
        dev = torch.device(device)
        raw_t = torch.from_numpy(np.ascontiguousarray(raw)).to(dev)
        out = torch.empty(math.prod(shape), dtype=torch.float32, device=dev)
        kernels = load_kernels() if dev.type == "cpu" else None

        def run() -> np.ndarray:
            if kernels is not None:
                kernels.dequantize(raw_t, ggml_type, out)
                return out.reshape(shape).numpy()
            y = dequantize(raw_t, ggml_type, out).reshape(shape)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            return y.cpu().numpy()

        return run
