"""Comparing traces: the metrics (defined once), the differ and its one judged row per checkpoint, printers, HTML,
plots, the CI gate, arbitration among several engines, the verdict vocabulary and the strict-JSON spelling of
report values.

Imports `parity.contract`, `parity.gguf` and `parity.tracing`; imported by bisect, logprobs and the layers above
them (validate, spec, api, bench, cli).
"""
