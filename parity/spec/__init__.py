"""Speculative decoding: the driver over the Engine protocol, acceptance attribution, fitted tiny drafters."""
