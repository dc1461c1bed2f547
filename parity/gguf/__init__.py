"""The GGUF layer: the container reader and writer, `ModelConfig` (the deepseek4 metadata contract, a declarative
key table), the tensor inventory, memory-mapped weights, drafter files, synthetic models (tiny, real-dimension,
flash-shaped, drafters), the tokenizer, chat template and llama.cpp's names and type layouts.

Imports only `parity.contract` in parity. With `parity.contract` it is all of parity an engine may import
(pyproject.toml's import contracts); every harness layer above imports it too.
"""
