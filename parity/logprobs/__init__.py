"""Top-k logprob runs: readers of ds4 dumps, official-API vectors and `official.vec`, the ds4 dump writer, the
step-by-step comparison and its printers.

Imports `parity.contract`, `parity.gguf`, `parity.tracing` and `parity.compare`, never `parity.bisect` (its sibling
layer); imported by validate, api and cli.
"""
