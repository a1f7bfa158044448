"""Speculative decoding: proposers draft tokens, the verifier keeps the output lossless."""
