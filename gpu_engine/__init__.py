"""gpu_engine: the torch production engine for deepseek4 GGUFs (CUDA or CPU) with fault injection."""

from parity.contract.cpus import passive_openmp

passive_openmp()  # before gpu_engine's modules import torch (speed only; see parity.contract.cpus)
