"""Hugging Face checkpoint folders: read one, or write one (our prepared artifacts).

A folder holds `config.json`, one or more `*.safetensors`, `tokenizer.json` and
`tokenizer_config.json`. The artifacts cache writes exactly this format, so a prepared
catalogue model and a user's own checkpoint take the same path into the decoder, and
transformers can open a prepared folder as a reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specserve.config import ModelConfig
from specserve.errors import ModelLoadError

WEIGHTS_FILE = "model.safetensors"


def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_config(path: Path) -> ModelConfig:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from None
    return ModelConfig.from_hf(raw)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights (PyTorch .bin files are not read)")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(file))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(
                f"cannot read {file} ({e}); if it is a prepared artifact, delete its folder "
                "and it will be prepared again"
            ) from None
    return weights


def write_checkpoint(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Write config.json and the weights (the tokenizer writes its own files)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
    if config.tie_word_embeddings:
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / WEIGHTS_FILE))
