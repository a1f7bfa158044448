"""Head checkpoint folders (EAGLE, Medusa): `load_head` and `save_head`.

A folder holds config.json and the weights: *.safetensors, else PyTorch files
(pytorch_model.bin, Medusa's medusa_lm_head.pt) read with `weights_only=True`, so no
pickled code runs. config.json says which head the folder holds (layouts.py); the method
asked for must agree, and the head must fit the target. Every refusal names the folder.
A head is written as config.json + model.safetensors in its public layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specserve.config import ModelConfig
from specserve.errors import ConfigError, ModelLoadError, SpecserveError
from specserve.model import checkpoint
from specserve.spec.heads.eagle import EagleHead
from specserve.spec.heads.layouts import LAYOUT_MARKERS, LAYOUTS, READERS, WRITERS, Tensors, layout_of
from specserve.spec.heads.medusa import MedusaHeads

Head = EagleHead | MedusaHeads


def load_head(path: str | Path, target: ModelConfig, method: str, dtype: torch.dtype = torch.float32) -> Head:
    """The head in folder `path` for `method` (vLLM's "eagle", "eagle3" or "medusa"),
    checked against the target it will draft for; floating weights in `dtype`, on the CPU."""
    if method not in LAYOUTS:
        raise ConfigError(f"unknown head method {method!r}; heads come for {', '.join(LAYOUTS)}")
    folder = Path(path)
    try:
        config = read_config(folder)
        layout = layout_of(config)
        if layout is None:
            named = config.get("architectures") or config.get("model_type")
            raise ModelLoadError(
                f"config.json names {named!r}, which is no head specserve reads; known: {LAYOUT_MARKERS}"
            )
        if layout != method:
            raise ConfigError(f'the folder holds {LAYOUTS[layout]}, not {LAYOUTS[method]}: use "method": "{layout}"')
        return READERS[layout](config, Tensors(read_weights(folder), dtype), target)
    except SpecserveError as error:
        raise type(error)(f"head checkpoint {folder}: {error}") from None


def read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise ModelLoadError("no such folder")
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ModelLoadError("the folder has no config.json") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read config.json: {e}") from None
    if not isinstance(config, dict):
        raise ModelLoadError("config.json is not a JSON object")
    return config


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if any(folder.glob("*.safetensors")):
        return checkpoint.read_weights(folder)
    files = sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))
    if not files:
        raise ModelLoadError("the folder has no weights (*.safetensors, *.bin or *.pt)")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # a damaged pickle fails in many ways (unpickling, zip, EOF)
            raise ModelLoadError(f"cannot read {file.name} ({type(e).__name__}: {str(e)[:200]})") from None
        if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
            raise ModelLoadError(f"{file.name} holds no mapping of names to tensors")
        weights.update(loaded)
    return weights


def save_head(head: Head, folder: str | Path) -> None:
    """Write config.json and model.safetensors in the head's public layout (vLLM reads it)."""
    from safetensors.torch import save_file

    config, tensors = WRITERS[type(head)](head)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    # Copies: safetensors refuses tensors that share memory (q, k and v are views of one matrix).
    save_file(
        {name: t.detach().cpu().clone(memory_format=torch.contiguous_format) for name, t in tensors.items()},
        str(folder / checkpoint.WEIGHTS_FILE),
    )
