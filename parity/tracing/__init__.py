"""Traces: running an engine over a token sequence (runner, the frozen run plan), recording it (records, recorder,
stats, sub-op and draft records), storing it (text and `.npz` io, validation, export, importers of other engines'
dumps).

The first harness layer above the import wall: imports `parity.contract` and `parity.gguf`, reaches engines only
through the `Engine` protocol. Imported by compare, bisect, logprobs, validate, spec, api, bench and cli.
"""
