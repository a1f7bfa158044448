"""Shared fixtures: tiny random-weight configs of each architecture."""

from __future__ import annotations

import os

import pytest
import torch

from specserve.config import ModelConfig

torch.set_num_threads(2)

# Without a GPU, Triton's kernels (model/slot_attention.py) run on Triton's interpreter.
# It is read when triton is first imported, which torch.compile may do, so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def skip_unless_triton_runs_on(device: str) -> None:
    """Triton's kernels run on the GPU, and on the CPU only under its interpreter, which
    is on where there is no GPU."""
    from specserve.model import slot_attention

    if not slot_attention.available():
        pytest.skip("Triton is not installed")
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("Triton's kernels run on the GPU here; its interpreter runs them on a CPU without one")


def tiny_config(arch: str, **overrides) -> ModelConfig:
    fields = dict(
        arch=arch,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def prepared_cache(tmp_path_factory):
    """Prepared artifacts for the whole test session, in a cache of its own.

    SPECSERVE_TEST_CACHE reuses a cache across runs (handy locally; CI starts clean).
    """
    import os

    root = os.environ.get("SPECSERVE_TEST_CACHE") or str(tmp_path_factory.mktemp("specserve-cache"))
    previous = os.environ.get("SPECSERVE_CACHE")
    os.environ["SPECSERVE_CACHE"] = root
    yield root
    if previous is None:
        os.environ.pop("SPECSERVE_CACHE", None)
    else:
        os.environ["SPECSERVE_CACHE"] = previous


# Tests that take a `device` argument run on the CPU everywhere and again on a CUDA GPU
# where one is present; CI has none, so there the CUDA cases are skipped.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")),
]
