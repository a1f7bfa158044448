"""specserve: lossless speculative decoding for Llama-family models, CPU first."""

__version__ = "0.1.0"
