"""The Llama-family decoder, its KV cache, and the loaders that feed it weights."""
