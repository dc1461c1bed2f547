"""Which ggml types each engine reads, asked of the engines themselves (never by importing an engine module).

An engine class answers through one of two capabilities, in this order:
* `TypeReader`: a static method `readable_types()` returning the ggml type ids it reads (the `llamacpp`
  engine: every type the ggml under llama-cpp-python knows; a ParityError when llama_cpp is not importable);
* the `Dequantizer` capability (`parity.contract.engine`): the harness asks it to dequantize one all-zero
  block of each type; a TensorError/ParityError means the engine does not read that type.
I32 is the contract's integer-table type (`ffn_gate_tid2eid`): engines read it as integers, never through a
dequantizer, so a dequantizer probe does not ask about it and reports it as read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

from parity.contract.engine import Dequantizer, engine_class
from parity.contract.errors import ParityError

ENGINES = ("reference", "torch", "llamacpp")   # the engines `inspect` asks
INTEGER_TABLES = frozenset({Q.I32})


@runtime_checkable
class TypeReader(Protocol):
    """Capability of an engine class: the ggml types it reads, declared."""

    @staticmethod
    def readable_types() -> frozenset[int]:
        """ggml type ids the engine reads (a ParityError when the engine cannot tell, naming why)."""


def _probe(cls: Any, qtype: Q) -> bool:
    """Ask the class's dequantizer to decode one all-zero block of `qtype` on the CPU."""
    block, size = GGML_QUANT_SIZES[qtype]
    try:
        cls.dequantizer(np.zeros(size, np.uint8), int(qtype), (1, block), "cpu")()
    except ParityError:
        return False
    return True


def engine_reads(name: str, types: Iterable[int]) -> dict[str, Any]:
    """Whether engine `name` reads each of `types` -> {engine, available, how, reads: {type name: bool},
    runs, error}. `available` False (with `error`) when the engine cannot be loaded or cannot tell;
    `runs`: it reads every type given."""
    qtypes = sorted({Q(int(t)) for t in types})
    out: dict[str, Any] = {"engine": name, "available": False, "how": None, "reads": {}, "runs": False,
                           "error": None}
    try:
        cls = engine_class(name)
        if isinstance(cls, TypeReader):
            known = frozenset(int(t) for t in cls.readable_types())
            out["how"] = "declared"
            reads = {q.name: int(q) in known for q in qtypes}
        elif isinstance(cls, Dequantizer):
            out["how"] = "dequantizer probe"
            reads = {q.name: q in INTEGER_TABLES or _probe(cls, q) for q in qtypes}
        else:
            out["error"] = "the engine declares no readable types and offers no dequantizer"
            return out
    except (ImportError, ParityError) as exc:   # an engine whose module or library is missing here
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out.update(available=True, reads=reads, runs=all(reads.values()))
    return out


def support(types: Iterable[int], engines: Iterable[str] = ENGINES) -> list[dict[str, Any]]:
    """`engine_reads` for each engine in `engines`."""
    types = list(types)
    return [engine_reads(name, types) for name in engines]
