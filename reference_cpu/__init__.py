"""Pure-NumPy reference of DeepSeek-V4 (`deepseek4` GGUF): one function per op, as in the model definition.

Modules follow the order of DeepSeek's official `inference/model.py`: norms, hyper-connections (hc),
RoPE, the QAT round trips (quant_sim), compressor, indexer, attention, MoE, the layer (model), the
per-sequence caches (state), weight access (weights_cache) and the `Engine` implementation (engine).
"""
