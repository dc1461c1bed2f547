"""Finding and judging a departure: `bisect`'s search (which layer, sub-op, step), teacher-forced attribution,
the noise envelope, `check` (the full verdict of a trace: the round-off null, op-level forcing, the hypotheses that
explain a layer, draft checkpoints) with its report printers, the per-layer work spread over a work pool.

Imports `parity.contract`, `parity.gguf`, `parity.tracing` and `parity.compare`, never `parity.logprobs` (its
sibling layer); imported by validate, spec, api, bench and cli.
"""
