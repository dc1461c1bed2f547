"""`TorchEngine`: the production-style torch implementation of the `parity.contract.engine.Engine` protocol.

Weights stay in their GGUF block formats on the device (CUDA when present with device=auto) and are
dequantized per use; prefill is batched over all new positions, decode reuses the same code with n = 1
on the per-layer caches. numpy arrays at the boundary: float32 (float64 with dtype=float64; the
approximate bfloat16 path also returns float32).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import torch

from gpu_engine.attention import AttentionLayer, LayerCache
from gpu_engine.dequant import dequantize
from gpu_engine.faults import FAULTS, Faults
from gpu_engine.hc import hc_head, hc_post, hc_pre
from gpu_engine.moe import route, routed_experts, shared_expert
from gpu_engine.ops import rms_norm, rope_frequencies
from gpu_engine.weights import DeviceWeights
from parity.contract.engine import LayerDiag, LayerOutput, RunOptions
from parity.contract.errors import ParityError

__version__ = "0.1.0"
DEFAULT_CACHE_MB = 512  # kept dequantized dense matrices (speed only: the cached values are the exact dequantization)
DTYPES = {"float32": (torch.float32, torch.float32), "float64": (torch.float64, torch.float64),
          "bfloat16": (torch.float32, torch.bfloat16)}  # (activations/state, matmul operands)


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
    faults = FAULTS  # capability: the porting bugs RunOptions.inject can switch on

    def __init__(self, model_path: str, options: RunOptions, cache_mb: int = DEFAULT_CACHE_MB) -> None:
        if options.dtype not in DTYPES:
            raise ParityError(f"torch engine: unknown dtype {options.dtype!r}; expected {', '.join(DTYPES)}")
        self.options = options
        self.switches = Faults.parse(options.inject)
        self.device = resolve_device(options.device)
        self.act, self.mm = DTYPES[options.dtype]
        self.version = f"gpu_engine {__version__} (torch {torch.__version__}, {self.device.type})"
        if cache_mb < 0:
            raise ParityError(f"torch engine: cache_mb must be >= 0, got {cache_mb}")
        self.w = DeviceWeights(str(model_path), self.device, self.act, cache_mb)
        self.config = self.cfg = self.w.config
        cfg = self.cfg
        if options.fp8_kv and cfg.nope_dim % 64:
            raise ParityError(f"--fp8-kv: non-rotary dims ({cfg.nope_dim}) are not a multiple of 64; the FP8 "
                              "simulation is undefined for this model (use --no-fp8-kv)")
        if options.fp4_indexer and cfg.index_head_dim % 32:
            raise ParityError(f"--fp4-indexer: indexer head dim {cfg.index_head_dim} is not a multiple of 32")
        # the layer schedule: the compress-ratios-u32 fault reads it as empty (every layer ratio 0)
        u32 = self.switches.compress_ratios_u32
        self.ratios = tuple(0 for _ in cfg.compress_ratios) if u32 else cfg.compress_ratios
        self.layers = [AttentionLayer(self, l, r, self._freqs(r)) for l, r in enumerate(self.ratios)]
        if options.dtype == "bfloat16":
            print("torch engine: APPROXIMATE bfloat16 path (bf16 matmul operands, fp32 state)", file=sys.stderr)
        if self.switches.active:
            print(f"torch engine: FAULTS INJECTED: {', '.join(self.switches.active)}", file=sys.stderr)

    def _freqs(self, ratio: int) -> torch.Tensor:
        cfg = self.cfg
        if ratio == 0:
            f = rope_frequencies(cfg.rope_head_dim, cfg.rope_theta, False, 1.0, 0, 0.0, 0.0)
        else:
            f = rope_frequencies(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.yarn, cfg.rope_factor,
                                 cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow)
        return f.to(dtype=self.act, device=self.device)

    # -- helpers ---------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """y = x Wᵀ with W dequantized from its blocks for this use.  x [n, in] -> [n, out] (activation dtype)."""
        return (x.to(self.mm) @ self.w.mat(name, self.mm).T).to(self.act)

    def _in(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=self.device, dtype=self.act)

    def _out(self, t: torch.Tensor) -> np.ndarray:
        t = t.detach()
        if t.is_floating_point():
            t = t.to(torch.float64 if self.act == torch.float64 else torch.float32)
        return t.cpu().numpy()

    # -- Engine protocol -------------------------------------------------------------------------------
    def new_state(self) -> TorchState:
        return TorchState([layer.new_cache() for layer in self.layers])

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ParityError(f"embed expects a non-empty 1-D token array, got shape {tokens.shape}")
        if tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size:
            raise ParityError(f"token id out of range [0, {self.cfg.vocab_size}): {tokens.min()}..{tokens.max()}")
        idx = torch.from_numpy(tokens.astype(np.int64)).to(self.device)
        e = self.w.q["token_embd.weight"].rows(idx, self.act)
        return self._out(e[:, None, :].expand(-1, self.cfg.hc_mult, -1))

    def forward_layer(self, state: TorchState, layer: int, carrier: np.ndarray, tokens: np.ndarray,
                      start_pos: int, capture: bool = False) -> LayerOutput:
        cfg = self.cfg
        if not 0 <= layer < cfg.n_layers:
            raise ParityError(f"layer {layer} out of range [0, {cfg.n_layers})")
        cache = state.layers[layer]
        if cache.pos != start_pos:
            raise ParityError(f"layer {layer}: cache holds positions < {cache.pos}, call starts at {start_pos}")
        n = carrier.shape[0]
        if carrier.shape != (n, cfg.hc_mult, cfg.dim) or len(tokens) != n or n < 1:
            raise ParityError(f"layer {layer}: carrier {carrier.shape} / tokens {len(tokens)} do not match "
                              f"[n >= 1, {cfg.hc_mult}, {cfg.dim}]")
        if not np.isfinite(carrier).all():
            raise ParityError(f"layer {layer}: the input carrier holds non-finite values")
        with torch.inference_mode():
            return self._layer(cache, layer, self._in(carrier), torch.from_numpy(np.asarray(tokens, dtype=np.int64))
                               .to(self.device), start_pos, capture)

    def _hc_pre(self, X: torch.Tensor, layer: int, kind: str):
        p = f"blk.{layer}.hc_{kind}_"
        return hc_pre(X, self.w.mat(p + "fn.weight", self.act), self.w.v(p + "scale.weight"),
                      self.w.v(p + "base.weight"), self.cfg.norm_eps, self.cfg.hc_eps, self.cfg.hc_sinkhorn_iters)

    def _layer(self, cache: LayerCache, layer: int, X: torch.Tensor, tokens: torch.Tensor, start_pos: int,
               capture: bool) -> LayerOutput:
        cfg, p, nt = self.cfg, f"blk.{layer}.", self.switches.comb_not_transposed
        u, pre_a, post_a, C_a = self._hc_pre(X, layer, "attn")
        x = rms_norm(u, self.w.v(p + "attn_norm.weight"), cfg.norm_eps)
        att = self.layers[layer].forward(cache, x, start_pos, capture)
        Y = hc_post(att.out, X, post_a, C_a, nt)
        v, pre_f, post_f, C_f = self._hc_pre(Y, layer, "ffn")
        xf = rms_norm(v, self.w.v(p + "ffn_norm.weight"), cfg.norm_eps)
        r = route(self, layer, xf, tokens, start_pos)
        routed = routed_experts(self, layer, xf, r)
        shared = shared_expert(self, layer, xf)
        X_out = hc_post(routed + shared, Y, post_f, C_f, nt)
        if not torch.isfinite(X_out).all():
            raise ParityError(f"layer {layer}: non-finite values in the carrier at positions {start_pos}.."
                              f"{start_pos + X.shape[0] - 1}")
        n = X.shape[0]
        diag = LayerDiag(
            hc_attn=(self._out(pre_a), self._out(post_a), self._out(C_a)),
            hc_ffn=(self._out(pre_f), self._out(post_f), self._out(C_f)),
            expert_ids=self._out(r.ids), expert_weights=self._out(r.weights), router_margin=self._out(r.margin),
            n_comp_visible=self._out(att.n_comp_visible),
            index_sel=self._index_sel_diag(layer, att.index_sel, n))
        captures: dict[str, np.ndarray] = {}
        if capture:
            dt = np.float64 if self.act == torch.float64 else np.float32
            captures = {k: self._out(t) for k, t in att.captures.items()}
            captures.setdefault("comp_rows", np.zeros((0, cfg.head_dim), dt))
            captures.setdefault("index_rows", np.zeros((0, cfg.index_head_dim), dt))
            captures["index_sel"] = (diag.index_sel if diag.index_sel is not None
                                     else np.full((n, cfg.index_topk), -1, dtype=np.int64))
            captures.update(hc_attn_pre=self._out(u), attn_norm=self._out(x), attn_out=self._out(att.out),
                            hc_attn_post=self._out(Y), hc_ffn_pre=self._out(v), ffn_norm=self._out(xf),
                            expert_ids=diag.expert_ids, expert_weights=diag.expert_weights,
                            routed_out=self._out(routed), shared_out=self._out(shared), hc_ffn_post=self._out(X_out))
        return LayerOutput(self._out(Y), self._out(X_out), diag, captures)

    def _index_sel_diag(self, layer: int, sel: torch.Tensor | None, n: int) -> np.ndarray | None:
        """The diagnostic's shape follows the model (an array on the file's CSA layers, None elsewhere); a layer the
        engine ran without an indexer (compress-ratios-u32) reports no selection (-1)."""
        if not self.cfg.has_indexer(layer):
            return None
        return self._out(sel) if sel is not None else np.full((n, self.cfg.index_topk), -1, dtype=np.int64)

    def head(self, carrier: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.cfg
        with torch.inference_mode():
            X = self._in(carrier)
            z = hc_head(X, self.w.mat("output_hc_fn.weight", self.act), self.w.v("output_hc_scale.weight"),
                        self.w.v("output_hc_base.weight"), cfg.norm_eps, cfg.hc_eps)
            final = rms_norm(z, self.w.v("output_norm.weight"), cfg.norm_eps)
            logits = self.linear(final, "output.weight")
        return self._out(final), self._out(logits)

    @staticmethod
    def dequantizer(raw: np.ndarray, ggml_type: int, shape: tuple[int, int], device: str) -> Callable[[], np.ndarray]:
        """Capability for benchmarks: the bytes staged on `device` once; the callable dequantizes them."""
        dev = torch.device(device)
        raw_t = torch.from_numpy(raw).to(dev)

        def run() -> np.ndarray:
            y = dequantize(raw_t, ggml_type).reshape(shape)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            return y.cpu().numpy()

        return run
