"""`check --workers N / --ray ADDRESS` and `bisect`'s: the per-layer runs spread over a `WorkPool`.

A unit is one layer of one engine over the candidate's whole chunk schedule (teacher-forced on given inputs, or
every sub-op on given inputs: op-level), optionally as round-off twin `seed`. Its result is a pure function of
(engine name, model file, drafter, run options, seed, layer, the inputs): a twin's perturbation is a hash of
(seed, op, element, value), never of the order units run in, and each layer has its own cache, so one layer run
alone equals the same layer in a pass over all layers. Results are merged in the order the serial code produces
them (`WorkPool.ordered`), so the report is the serial one byte for byte.

While a `Distributor` is active (`active(...)`, a context variable), the layer-running functions the verdict
calls — `attribution.teacher_forced`, `null.layer_nulls`, `opforce.op_verdict` and `hypotheses.defect_library` —
send their layers to the pool for engines it can rebuild in a worker: those made by an `EngineLoader` (a picklable
factory) and registered (`register`). Any other engine (a test fake, a routing replay with its callable, the
draft heads) runs in this process as before. Worker processes keep the engines they loaded (by loader and
options; reference variants share one opened file, as `Variants` does in this process).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from parity.contract.engine import Engine, LayerOutput, LayerwiseState, RunOptions, Variants, load_engine
from parity.contract.workpool import WorkPool
from parity.tracing.runner import ChunkResult


@dataclass(frozen=True)
class EngineLoader:
    """A picklable engine factory: `loader(options)` = load_engine(name, model, options, draft=draft)."""

    name: str
    model: str
    draft: str | None = None

    def __call__(self, options: RunOptions) -> Engine:
        return load_engine(self.name, self.model, options, draft=self.draft)


@dataclass(frozen=True)
class EngineRef:
    """What a worker needs to rebuild an engine: its loader and run options (no callables in them)."""

    loader: EngineLoader
    options: RunOptions


# ---------------------------------------------------------------- worker side

def warm(names: Sequence[str]) -> None:
    """A worker's start: import the engines `names` in a background thread (the torch engine's import of torch
    takes seconds), so the first units, the reference's, need not wait for it (`WorkPool(warm=(warm, (names,)))`)."""
    import threading

    from parity.contract.engine import engine_class

    def run() -> None:
        for name in names:
            with contextlib.suppress(Exception):   # a failing import is reported where the engine is loaded
                engine_class(name)

    threading.Thread(target=run, daemon=True).start()


_BASES: dict[EngineLoader, Engine] = {}       # the first engine each loader opened (variants share it)
_OTHERS: dict[EngineRef, tuple[Engine, str]] = {}
_KEEP = 4                                      # engines without `Variants` kept per worker (fault engines)


def _quiet_load(make: Callable[[], Engine]) -> tuple[Engine, str]:
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        engine = make()
    return engine, buf.getvalue()


def worker_engine(ref: EngineRef) -> tuple[Engine, str]:
    """The worker's engine for `ref` and what building it printed on stderr (the same text each time: a unit
    reports what the serial code's own construction of that engine would have printed)."""
    if ref in _OTHERS:
        return _OTHERS[ref]
    base = _BASES.get(ref.loader)
    if base is None:
        engine, said = _quiet_load(lambda: ref.loader(ref.options))
        _BASES[ref.loader] = engine
        if isinstance(engine, Variants):
            _OTHERS[ref] = (engine, said)
            return engine, said
    elif isinstance(base, Variants):
        engine, said = _quiet_load(lambda: base.variant(ref.options))
    else:
        engine, said = _quiet_load(lambda: ref.loader(ref.options))
    if not isinstance(engine, Variants):
        while len([k for k in _OTHERS if not isinstance(_OTHERS[k][0], Variants)]) >= _KEEP:
            del _OTHERS[next(k for k in _OTHERS if not isinstance(_OTHERS[k][0], Variants))]
    _OTHERS[ref] = (engine, said)
    return engine, said


Inputs = Sequence[tuple[int, np.ndarray, np.ndarray]]   # per chunk: (start_pos, tokens, carrier entering the layer)


def layer_run(engine: Engine, layer: int, inputs: Inputs, capture: bool = False,
              given: Sequence[Any] | None = None) -> list[LayerOutput]:
    """`layer` of `engine` over every chunk of `inputs` (per chunk (start_pos, tokens, carrier entering it)) in
    a fresh state; with `given` (per chunk) every sub-op on those values (`OpForcing.forward_ops`)."""
    return over_chunks(engine, (layer,), [inputs], capture, [given])[0]


def over_chunks(engine: Engine, layers: Sequence[int], inputs: Sequence[Inputs], capture: bool = False,
                given: Sequence[Sequence[Any] | None] | None = None) -> list[list[LayerOutput]]:
    """`layers` of `engine` (each on its own inputs, `given` sub-op values or None) over every chunk in one fresh
    state: layer after layer with `LayerwiseState` (a layer's weights dequantized once), else chunk after chunk
    (an engine whose caches are per sequence). Outputs per layer, per chunk."""
    given = given if given is not None else [None] * len(layers)

    def one(state: Any, k: int, i: int) -> LayerOutput:
        s, t, x = inputs[k][i]
        return (engine.forward_layer(state, layers[k], x, t, s, capture=capture) if given[k] is None else
                engine.forward_ops(state, layers[k], x, t, s, given[k][i]))   # type: ignore[attr-defined,index]

    state = engine.new_state()
    if isinstance(engine, LayerwiseState):
        return [[one(state, k, i) for i in range(len(inputs[k]))] for k in range(len(layers))]
    by_chunk = [[one(state, k, i) for k in range(len(layers))] for i in range(len(inputs[0]))]
    return [[row[k] for row in by_chunk] for k in range(len(layers))]


def run_layers(ref: EngineRef, seed: int | None, layers: tuple[int, ...], capture: bool, forced_ops: bool,
               *data: Any) -> tuple[list[list[LayerOutput]], str]:
    """One unit: `layers` of the engine `ref` (its round-off twin `seed` when not None) over every chunk, layer
    after layer (each layer has its own cache: the same outputs as each layer alone, and a layer's weights are
    dequantized once); `data`: each layer's inputs (per chunk (start_pos, tokens, carrier)), then with
    `forced_ops` each layer's given sub-op values per chunk (`OpForcing.forward_ops`: every sub-op on those).
    Top-level arguments, so Ray resolves shared ones. Returns the outputs per layer and what building the engine
    printed."""
    engine, said = worker_engine(ref)
    if seed is not None:
        engine = engine.roundoff_twin(seed)   # type: ignore[attr-defined]
    inputs = [[(s, t, np.ascontiguousarray(x)) for s, t, x in chunks]   # as `attribution.layer_input` gives them
              for chunks in data[: len(layers)]]
    given = data[len(layers):] if forced_ops else [None] * len(layers)
    return over_chunks(engine, layers, inputs, capture, given), said


def run_twin_null(ref: EngineRef, layer: int, n: int, exact: dict[str, np.ndarray], inputs: Inputs) -> Any:
    """One unit of the round-off null: `layer`'s n twins of the engine `ref` on `inputs`, reduced to their
    distances from `exact` (the exact run's carriers): `parity.check.null.twin_null` in a worker."""
    from parity.check.null import twin_null

    engine, _ = worker_engine(ref)
    inputs = [(s, t, np.ascontiguousarray(x)) for s, t, x in inputs]
    return twin_null(engine, inputs, exact, layer, n)


# ---------------------------------------------------------------- parent side

@dataclass
class Distributor:
    """The pool and the engines it may rebuild (by object id; the engine is kept so the id stays its own)."""

    pool: WorkPool
    announced: list[str] | None = None    # where the units' engine announcements go (check's silenced count)
    refs: dict[int, tuple[Engine, EngineRef]] = field(default_factory=dict)

    def register(self, engine: Engine, loader: EngineLoader, options: RunOptions) -> Engine:
        if options.expert_override is None:   # a routing replay's callable does not travel
            self.refs[id(engine)] = (engine, EngineRef(loader, options))
        return engine

    def ref_of(self, engine: Engine) -> EngineRef | None:
        hit = self.refs.get(id(engine))
        return hit[1] if hit is not None and hit[0] is engine else None

    def layers(self, jobs: Sequence[tuple[EngineRef, int | None, int]], cand: Sequence[ChunkResult],
               capture: bool = False, dumps: Sequence[ChunkResult] | None = None
               ) -> Iterator[tuple[list[LayerOutput], str]]:
        """(outputs, what building the engine printed) of every (engine, seed, layer) job on the candidate's
        inputs (with `dumps`: every sub-op on the candidate's dumped inputs), in the order of `jobs`."""
        for outs, said in self.groups([(r, s, (l,)) for r, s, l in jobs], cand, capture, dumps):
            yield outs[0], said

    def groups(self, jobs: Sequence[tuple[EngineRef, int | None, tuple[int, ...]]], cand: Sequence[ChunkResult],
               capture: bool = False, dumps: Sequence[ChunkResult] | None = None
               ) -> Iterator[tuple[list[list[LayerOutput]], str]]:
        """As `layers`, a job running several layers in one unit (outputs per layer, in the job's order)."""
        shared: dict[int, Any] = {}
        given: dict[int, Any] = {}
        for _, _, group in jobs:
            for layer in group:
                if layer not in shared:
                    shared[layer] = self.pool.share(layer_inputs(cand, layer))
                    if dumps is not None:
                        from parity.check.opforce import given_of

                        given[layer] = self.pool.share([given_of(d, layer) for d in dumps])
        units = [(ref, seed, group, capture, dumps is not None, *(shared[l] for l in group),
                  *((given[l] for l in group) if dumps is not None else ())) for ref, seed, group in jobs]
        yield from self.pool.ordered(run_layers, units)

    def twin_nulls(self, ref: EngineRef, layers: Sequence[int], n: int, cand: Sequence[ChunkResult],
                   exact: dict[int, dict[str, np.ndarray]]) -> Iterator[Any]:
        """The round-off null of every layer (one unit a layer: its n twins, so a worker dequantizes the layer
        once), in the order of `layers`."""
        units = [(ref, l, n, self.pool.share(exact[l]), self.pool.share(layer_inputs(cand, l))) for l in layers]
        yield from self.pool.ordered(run_twin_null, units)

    def said(self, text: str) -> None:
        """Count what building a unit's engine printed, where the serial code built (and silenced) that engine."""
        if self.announced is not None:
            self.announced.extend(line for line in text.splitlines() if line)

    def build(self, ref: EngineRef) -> Engine:
        """`ref`'s engine in this process, its announcements discarded (a unit already reported them)."""
        return _quiet_load(lambda: ref.loader(ref.options))[0]


def layer_inputs(cand: Sequence[ChunkResult], layer: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per chunk (start_pos, tokens, the carrier entering `layer`: embed for 0, else blk.{layer-1}; contiguous)."""
    from parity.check.attribution import layer_input

    return [(c.start_pos, c.tokens, layer_input(c, layer)) for c in cand]


_ACTIVE: ContextVar[Distributor | None] = ContextVar("parity_distributor", default=None)


@contextlib.contextmanager
def active(pool: WorkPool, announced: list[str] | None = None) -> Iterator[Distributor | None]:
    """While the block runs, registered engines' layers go to `pool` (nothing changes for a serial pool)."""
    if pool.serial:
        yield None
        return
    d = Distributor(pool, announced)
    token = _ACTIVE.set(d)
    try:
        yield d
    finally:
        _ACTIVE.reset(token)


def current() -> Distributor | None:
    return _ACTIVE.get()


def for_engine(engine: Engine) -> tuple[Distributor, EngineRef] | None:
    """The active distributor and `engine`'s ref when the engine can be rebuilt in a worker, else None."""
    d = _ACTIVE.get()
    ref = d.ref_of(engine) if d is not None else None
    return (d, ref) if d is not None and ref is not None else None


def loader_of(factory: Any) -> EngineLoader | None:
    """The EngineLoader behind a factory (through wrappers that keep it as `.loader` or `.factory`)."""
    seen = 0
    while factory is not None and seen < 8:
        if isinstance(factory, EngineLoader):
            return factory
        factory = getattr(factory, "loader", None) or getattr(factory, "factory", None)
        seen += 1
    return None


def with_options(ref: EngineRef, **changes: Any) -> EngineRef:
    return EngineRef(ref.loader, replace(ref.options, **changes))
