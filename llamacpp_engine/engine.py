"""`LlamaCppEngine`: llama.cpp's deepseek4 graph, in-process on the CPU, behind the Engine protocol.

llama.cpp runs a whole graph per ubatch, so the protocol's per-layer calls are served from one run:
* the first `forward_layer` of a new chunk runs the chunk once through the graph, its input carrier written
  into that layer's input tensor (`hc_init` for layer 0, `l_last-{l-1}` else); later layers of the chunk are
  served from the captured tensors when the carrier they are given is bit-identical to the one llama.cpp
  computed (the free-running case);
* a layer given a different carrier (teacher forcing, splicing) is run on it: the chunk is re-run with that
  carrier written into the layer's input tensor, after replaying the sequence's earlier chunks with their own
  written inputs (llama.cpp's compressor state is not restored exactly by its state save/load, so the
  context is rebuilt by replay: a re-run of chunk c costs c + 1 graph runs);
* `embed` and a `head` on a carrier no run produced use a scratch context (the embedding lookup and the head
  are position-independent); `embed` ends the graph as soon as `hc_init` is computed.
Writing a layer's input also fixes the caches that layer builds (KV, compressed rows): they come from the
given carriers, as teacher forcing requires.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import numpy as np

from llamacpp_engine import quantize as _quantize
from llamacpp_engine import rollback
from llamacpp_engine.constraints import check_model
from llamacpp_engine.mtp import MTPHead, MTPState
from llamacpp_engine.session import KV_TYPES, Context, Model, Settings
from llamacpp_engine.stateview import committed_rows, last_committed_rows
from parity.contract.draft import MTPOutput
from parity.contract.engine import LayerOutput, RunOptions, check_tokens, refuse_roundoff
from parity.contract.errors import ParityError
from parity.gguf.config import ModelConfig
from parity.gguf.drafter import check_pair, merged_weights, open_drafter
from parity.gguf.llamacpp import (
    CACHE_ROWS,
    EMBED_NAME,
    LOGITS_NAME,
    all_names,
    base_name,
    embed_output,
    head_output,
    key,
    layer_input_name,
    layer_output,
)
from parity.gguf.weights import Weights

VERSION = "0.1.0"


def settings_from(options: RunOptions) -> Settings:
    """llama.cpp settings: kv from `options.kv_cache`, the rest from `options.engine_args` (lcp_*=VALUE)."""
    known = {"lcp_flash_attn", "lcp_threads", "lcp_ctx", "lcp_ubatch", "lcp_kv", "lcp_rs_seq"}
    args: dict[str, str] = {}
    for a in options.engine_args:
        name, eq, value = a.partition("=")
        if not eq or name not in known:
            raise ParityError(f"llamacpp: unknown engine argument {a!r}; expected NAME=VALUE with NAME one of "
                              f"{', '.join(sorted(known))}")
        args[name] = value
    if "lcp_kv" in args and args["lcp_kv"] != options.kv_cache:
        raise ParityError(f"llamacpp: lcp_kv={args['lcp_kv']} contradicts kv_cache={options.kv_cache}")
    if options.kv_cache not in KV_TYPES:
        raise ParityError(f"llamacpp: kv_cache={options.kv_cache!r}; llama.cpp runs {', '.join(KV_TYPES)}")

    def integer(name: str, default: int, lo: int) -> int:
        v = args.get(name, str(default))
        if not v.isdigit() or int(v) < lo:
            raise ParityError(f"llamacpp: {name}={v!r}; expected an integer >= {lo}")
        return int(v)

    flash = args.get("lcp_flash_attn", "off")
    if flash not in ("on", "off"):
        raise ParityError(f"llamacpp: lcp_flash_attn={flash!r}; expected on or off")
    return Settings(kv=options.kv_cache, flash_attn=flash == "on",
                    threads=integer("lcp_threads", 1, 1),
                    n_ctx=integer("lcp_ctx", 4096, 1), n_ubatch=integer("lcp_ubatch", 512, 1),
                    rs_seq=integer("lcp_rs_seq", Settings.rs_seq, 0))


def check_options(options: RunOptions) -> None:
    """Refuse what llama.cpp does not do, naming the option (no silent substitute)."""
    if options.dtype != "float32":
        raise ParityError(f"llamacpp: llama.cpp's CPU graph computes in float32; --dtype {options.dtype} is not "
                          "available")
    if options.fp8_kv or options.fp4_indexer:
        raise ParityError("llamacpp: llama.cpp does not implement the FP8 KV / FP4 indexer QAT round trips; run "
                          "with --no-fp8-kv --no-fp4-indexer (the reference then omits them too)")
    refuse_roundoff(options, "llamacpp")
    if options.inject:
        raise ParityError(f"llamacpp: llama.cpp cannot inject faults (got {list(options.inject)})")
    if options.device != "cpu":
        raise ParityError(f"llamacpp: llama.cpp runs its CPU backend here; device {options.device!r} is the torch "
                          "engine's option")
    if options.expert_override is not None:
        raise ParityError("llamacpp: llama.cpp cannot replay another engine's expert choices (routing replay)")
    if options.act_quant != "none":
        raise ParityError(f"llamacpp: act_quant={options.act_quant} cannot be imposed on llama.cpp (its CPU backend "
                          "rounds activations to Q8_0 before quantized matmuls by itself)")


@dataclass
class Chunk:
    start: int
    tokens: np.ndarray
    overrides: dict[str, np.ndarray] = field(default_factory=dict)   # input tensors written, by capture key
    tensors: dict[str, np.ndarray] | None = None


@dataclass
class LlamaState:
    """One sequence: its llama.cpp context, the chunks fed so far (for replay) and the current one; `pending`: a
    `restore` whose `llama_memory_seq_rm` waits for the replay of the rolled-back chunk (llamacpp_engine.rollback)."""

    ctx: Context
    done: list[Chunk] = field(default_factory=list)
    current: Chunk | None = None
    pending: rollback.Mark | None = None

    @property
    def next_pos(self) -> int:
        return self.current.start + len(self.current.tokens) if self.current else 0


class LlamaCppEngine:
    name = "llamacpp"
    # capabilities of the class (no model loaded): llama.cpp's own quantizer (parity.gguf.llamacpp.Quantizer)
    # and the ggml types it reads (parity.gguf.support.TypeReader)
    file_types = staticmethod(_quantize.file_types)
    quantize = staticmethod(_quantize.quantize)

    @staticmethod
    def readable_types() -> frozenset[int]:
        """Every ggml type the ggml library under llama-cpp-python knows."""
        return frozenset(_quantize.ggml_types())

    def __init__(self, model_path: str, options: RunOptions, draft: str | None = None) -> None:
        check_options(options)
        weights = Weights(model_path)
        self.config: ModelConfig = weights.config
        check_model(self.config, weights)
        # the draft head (`draft`: an MTP file in llama.cpp's layout, run by llama.cpp's own MTP graph)
        self.drafter = open_drafter(draft, self.config) if draft is not None else None
        if self.drafter is not None:
            if self.drafter.config.layout != "llamacpp-mtp":
                raise ParityError(f"llamacpp: {draft} is a {self.drafter.config.layout} drafter; llama.cpp runs "
                                  "only its own MTP layout (llamacpp-mtp: blk.L.nextn.*; docs/drafters.md)")
            check_pair(weights, self.drafter)   # llama.cpp drafts with the file's copies of embedding and head
        self.identity = (weights if self.drafter is None else merged_weights(weights, self.drafter)).identity()
        settings = settings_from(options)
        # what llama.cpp does, declared: ggml's RoPE angle recurrence, the K/V cache type, its settings
        self.options = replace(options, rope_angles="recurrence", engine_args=settings.args())
        import llama_cpp

        self.version = f"llama.cpp via llama-cpp-python {llama_cpp.__version__} ({VERSION})"
        self.model = Model(model_path, settings, all_names(self.config))
        self._mtp = MTPHead(draft, settings, self.config) if self.drafter is not None else None
        self._scratch: Context | None = None
        self._heads: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []   # recent (carrier, norm, logits)
        print(f"llamacpp: {', '.join(settings.args())}; RoPE angles by ggml's recurrence", file=sys.stderr)

    # -- protocol -------------------------------------------------------------------------------
    def new_state(self) -> LlamaState:
        return LlamaState(Context(self.model))

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        tokens = self._tokens(tokens, "embed")
        t = self._scratch_run(tokens, {}, stop_after=EMBED_NAME)   # the graph ends once hc_init is computed
        return embed_output(t, self.config, len(tokens))

    def forward_layer(self, state: LlamaState, layer: int, carrier: np.ndarray, tokens: np.ndarray,
                      start_pos: int, capture: bool = False) -> LayerOutput:
        cfg = self.config
        if not 0 <= layer < cfg.n_layers:
            raise ParityError(f"layer {layer} out of range [0, {cfg.n_layers})")
        tokens = self._tokens(tokens, f"layer {layer}")
        carrier = np.asarray(carrier, dtype=np.float32)
        if carrier.shape != (len(tokens), cfg.hc_mult, cfg.dim):
            raise ParityError(f"layer {layer}: carrier shape {carrier.shape}, expected ({len(tokens)}, "
                              f"{cfg.hc_mult}, {cfg.dim})")
        chunk = self._chunk(state, tokens, int(start_pos))
        inp = layer_input_name(layer)
        if chunk.tensors is None:
            chunk.overrides[inp] = carrier
            self._run(state, chunk)
        elif not np.array_equal(chunk.tensors[inp], carrier):
            order = [layer_input_name(l) for l in range(cfg.n_layers)]
            chunk.overrides = {k: v for k, v in chunk.overrides.items() if order.index(k) < layer}
            chunk.overrides[inp] = carrier
            self._replay(state)
            self._run(state, chunk)
        out = layer_output(chunk.tensors, cfg, layer, start_pos + np.arange(len(tokens)), capture)
        if layer == cfg.n_layers - 1:
            norm, logits = head_output(chunk.tensors, cfg, len(tokens))
            self._heads = [*self._heads[-3:], (out.carrier, norm, logits)]
        return out

    def head(self, carrier: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        carrier = np.asarray(carrier, dtype=np.float32)
        for x, norm, logits in reversed(self._heads):
            if x.shape == carrier.shape and np.array_equal(x, carrier):
                return norm, logits
        n = len(carrier)  # a carrier no run produced: the head of a scratch run on it
        t = self._scratch_run(np.full(n, self.config.bos_token_id, np.int64),
                              {key("l_last", self.config.n_layers - 1): carrier})
        return head_output(t, self.config, n)

    # -- draft head: llama.cpp's MTP graph (llamacpp_engine.mtp) --------------------------------------------
    def new_mtp_state(self) -> MTPState:
        """A fresh MTP context (its own window of rows)."""
        return self._head().new_state()

    def mtp_forward(self, state: MTPState, carriers: np.ndarray, tokens: np.ndarray, start_pos: int,
                    pairing: str = "prev") -> MTPOutput:
        """llama.cpp's MTP graph on the pairs of trunk rows at consecutive positions start_pos.. (carriers X^(L)
        [n, H, D], tokens [n]): prev pairs X^(L)_{q-1} with t_q, same X^(L)_q with t_q (spec v4-mtp-dspark §2.3).
        llama.cpp places each pair at its token's position."""
        head = self._head()
        return head.forward(state, np.asarray(carriers), self._tokens(tokens, "mtp_forward"), start_pos, pairing)

    def mtp_chain(self, state: MTPState, last: MTPOutput, start_pos: int, depth: int) -> list[MTPOutput]:
        """Depths 2..depth after `last` (the state's latest mtp_forward), start_pos = the carrier position after
        `last`'s last pair; the chain rows are removed from the state afterwards."""
        return self._head().chain(state, last, start_pos, depth)

    def new_dspark_state(self) -> None:
        raise ParityError(self._no_dspark())

    def dspark_round(self, state: None, taps: np.ndarray, start_pos: int, anchor: int) -> None:
        raise ParityError(self._no_dspark())

    def _no_dspark(self) -> str:
        got = "no drafter" if self.drafter is None else f"a {self.drafter.config.kind} drafter"
        return (f"llamacpp: dspark is not run through llama.cpp here (its dflash graph is not driven; docs/peers.md); "
                f"this engine has {got}")

    def _head(self) -> MTPHead:
        if self._mtp is None:
            raise ParityError("llamacpp: mtp needs an engine opened with a mtp drafter (draft=FILE); this one has "
                              "no drafter")
        return self._mtp

    # -- capability: snapshot / restore through llama.cpp's own rollback (llamacpp_engine.rollback) ----------------
    def snapshot(self, state: LlamaState | MTPState) -> rollback.Mark:
        """Capability `StateSnapshots`: where the trunk or MTP sequence stands (no copy: `restore` rolls llama.cpp's
        memory back with `llama_memory_seq_rm`)."""
        if isinstance(state, MTPState):
            return rollback.Mark(state.ctx.next_pos, 0)
        return rollback.mark(state)

    def restore(self, state: LlamaState | MTPState, saved: rollback.Mark) -> LlamaState | MTPState:
        """Capability `StateSnapshots`: the same state, rolled back to `saved` by llama.cpp (`llama_memory_seq_rm`
        of the rows fed since; for the trunk, of the rejected rows once the accepted prefix is fed again)."""
        if isinstance(state, MTPState):
            state.ctx.truncate(saved.pos)
        else:
            rollback.request(state, saved)
        return state

    def committed_rows(self, state: LlamaState) -> list[tuple[int, dict[str, np.ndarray]]]:
        """The compressed rows llama.cpp's captures show after each committed chunk (llamacpp_engine.stateview):
        [(T, {blk.l.comp.rows | blk.l.index.rows: rows emitted before T})]."""
        return committed_rows(state, self.config)

    # -- capability: PartialStateView (the compressed rows; state parity as far as the captures show it) ----------
    def visible_state(self, state: LlamaState) -> tuple[dict[str, np.ndarray], str]:
        """Capability `PartialStateView`: the compressed rows emitted before the end of the last committed chunk
        (`blk.l.comp.rows`, `blk.l.index.rows`) and what llama.cpp's captures do not show."""
        return last_committed_rows(state, self.config), (
            "compressed rows only (comp and index rows of every compressed layer after each commit): llama.cpp's "
            "captures show neither the raw window rows, the compressors' pending accumulators nor the MTP state")

    # -- capability: a raw llama.cpp capture (the `v4parity capture llamacpp` file) ----------------
    def capture(self, prompt: list[int], chunks: list[int], decode: int) -> dict[str, np.ndarray]:
        """Free-running greedy run: prompt in `chunks`, then `decode` steps. Returns every mapped tensor by its
        llama.cpp capture key with tokens on axis 0 (cache views: rows emitted by the end), plus input_ids,
        output_positions, chunks and n_prompt."""
        if sum(chunks) != len(prompt):
            raise ParityError(f"chunks {chunks} do not cover the {len(prompt)}-token prompt")
        ctx = Context(self.model)
        parts: dict[str, list[np.ndarray]] = {}
        fed: list[int] = []
        pos = 0
        schedule = [np.asarray(prompt[sum(chunks[:i]):sum(chunks[: i + 1])], np.int64) for i in range(len(chunks))]
        for i in range(len(chunks) + decode):
            toks = schedule[i] if i < len(chunks) else np.array([int(np.argmax(parts[LOGITS_NAME][-1][-1]))])
            t = ctx.decode(toks, pos)
            for k, v in t.items():
                parts.setdefault(k, []).append(v)
            fed += toks.tolist()
            pos += len(toks)
        out = {}
        for k, v in parts.items():  # cache views: the last one, cut to the rows emitted by the end
            layer = k.rpartition("-")[2]
            out[k] = v[-1][: pos // self.config.ratio(int(layer))] if base_name(k) in CACHE_ROWS else np.concatenate(v)
        out |= {"input_ids": np.array(fed, np.int64), "output_positions": np.arange(pos, dtype=np.int64),
                "chunks": np.array([*chunks, *([1] * decode)], np.int64), "n_prompt": np.array(len(prompt))}
        return out

    # -- capability: PlainDecode (timing: llama.cpp as its users run it) --------------------------
    def new_plain(self) -> Context:
        return Context(self.model, observed=False)

    def plain_decode(self, plain: Context, tokens: np.ndarray, start_pos: int) -> None:
        plain.feed(self._tokens(tokens, "plain_decode"), start_pos)

    # -- internals ------------------------------------------------------------------------------
    def _tokens(self, tokens: np.ndarray, where: str) -> np.ndarray:
        return check_tokens(tokens, self.config.vocab_size, where)

    def _chunk(self, state: LlamaState, tokens: np.ndarray, start: int) -> Chunk:
        if state.pending is not None:
            rollback.settle(state, tokens, start)
        cur = state.current
        if cur is not None and cur.start == start and np.array_equal(cur.tokens, tokens):
            return cur
        if start != state.next_pos:
            raise ParityError(f"llamacpp: chunk starts at position {start} but the state expects {state.next_pos} "
                              "(feed positions in order through one state)")
        if cur is not None:
            state.done.append(cur)
        state.current = Chunk(start, tokens)
        return state.current

    def _run(self, state: LlamaState, chunk: Chunk) -> None:
        chunk.tensors = state.ctx.decode(chunk.tokens, chunk.start, chunk.overrides)

    def _replay(self, state: LlamaState) -> None:
        """Rebuild the context up to the current chunk: clear it and re-feed the earlier chunks as they ran."""
        state.ctx.clear()
        for c in state.done:
            state.ctx.decode(c.tokens, c.start, c.overrides, capture=False)

    def _scratch_run(self, tokens: np.ndarray, overrides: dict[str, np.ndarray],
                     stop_after: str | None = None) -> dict[str, np.ndarray]:
        if self._scratch is None:
            self._scratch = Context(self.model)
        self._scratch.clear()
        return self._scratch.decode(tokens, 0, overrides, stop_after=stop_after)

