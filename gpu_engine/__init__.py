"""gpu_engine: the torch production engine for deepseek4 GGUFs (CUDA or CPU) with fault injection."""
