"""Hugging Face transformers DeepseekV4ForCausalLM behind the v4parity Engine protocol (entry point `hf`)."""
