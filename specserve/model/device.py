"""Where the models run: the CPU (with our C kernels) or a CUDA GPU (PyTorch's kernels).

Everything a forward pass touches lives on the decoder's device: weights, the RoPE
table, KV caches, the token ids fed in, logits, the draft's probabilities and each
request's random generator. What crosses to the host each step is the verdict: one
argmax list per target forward and per draft position (`Engine._forward_and_verify`,
`DraftModelProposer._draft`), which is also the step's only synchronisation, so the
timings adaptive k learns from include the GPU's work.

Only the CPU has our int8/int4 and float32 kernels, fused speculation, oneDNN-packed
float32 linears and batch invariance (its row blocking was measured on CPU kernels); on a GPU
the weights are float (bfloat16 by default) and those options are refused by name.
"""

from __future__ import annotations

import torch

from specserve.errors import ConfigError
from specserve.model.quant import QUANTIZED_ACTIVATION_DTYPE

CPU = torch.device("cpu")


def resolve_device(name: str) -> torch.device:
    """`auto` (a CUDA GPU where PyTorch sees one, else the CPU), `cpu`, `cuda` or
    `cuda:N`, checked against this machine."""
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else CPU
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return CPU
    if device.type != "cuda":
        raise ConfigError(f"device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"--device {name}: PyTorch sees no CUDA GPU here (a CPU-only torch build, or no driver); use --device cpu"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def check_device_format(device: torch.device, quantization: str, batch_invariant: bool) -> None:
    """Refuse, naming the fix, the weight options that only the CPU runs."""
    if device.type == "cpu":
        return
    if quantization != "none":
        raise ConfigError(
            f"--quantization {quantization} runs on our CPU kernels only; on {device} use "
            "--quantization none (bfloat16 weights), or --device cpu"
        )
    if batch_invariant:
        raise ConfigError(
            f"--batch-invariant is made for the CPU kernels only; drop it on {device}, or use --device cpu"
        )


def default_dtype(device: torch.device, quantization: str) -> torch.dtype:
    """What `--dtype auto` means: the quantized kernels' bfloat16 activations with
    --quantization, bfloat16 on a GPU (its tensor cores' format, half float32's
    bytes), float32 on the CPU otherwise (our float32 kernel, or oneDNN's packed linears)."""
    if quantization != "none" or device.type != "cpu":
        return QUANTIZED_ACTIVATION_DTYPE
    return torch.float32
