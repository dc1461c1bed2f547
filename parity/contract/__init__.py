"""The contract between the harness and every engine: the `Engine` protocol and its capabilities, `RunOptions`,
what a layer returns (`LayerOutput`, `LayerDiag`, the draft heads' results), checkpoint and sub-op names, the error
types, the one atomic file writer, the usable-CPU count and the work pool.

The bottom layer of parity: it imports no other part of it (one exception, ignored by import-linter: the type
annotation of `Engine.config`, `parity.gguf.config.ModelConfig`). The engines and every parity subpackage import it.
"""
