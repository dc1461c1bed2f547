"""llama.cpp (llama-cpp-python, in-process, CPU) behind the v4parity Engine protocol (entry point `llamacpp`)."""
