"""Our int4 and int8 kernel for x86-64 CPUs with AVX2 but without AVX-512 VNNI
(kernels/avx2/), where `native`'s kernels cannot run: compiled on first use, called
through ctypes.

On such a CPU PyTorch's int4 kernel is bound by its arithmetic: on a 2-core AVX2 EPYC
(Zen 3, 30 GB/s) it reads the weights at about a third of the bandwidth, and a decode
step of the int4 default target took longer than the int8 one's. This kernel quantizes
activations to int8 per group of 32, as `native` does, and multiplies them with
`vpmaddubsw`; its figures: benchmarks/EXPERIMENTS.md, "int4 and int8 on AVX2 CPUs".

Where `native` runs, it runs instead; `SPECSERVE_NATIVE_KERNELS=0` turns both off.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path

import torch

from specserve.model import native

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "kernels" / "avx2").glob("*.c"))
REQUIRED_CPU_FLAGS = ("avx2", "fma")
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
GROUP_SIZE = 32


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    reason = native.platform_reason()
    if reason is not None:
        return reason
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in native.cpu_flags()]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with the reason logged once) where it cannot run."""
    reason = unavailable_reason()
    if reason is None:
        try:
            lib = ctypes.CDLL(str(native.built_library("specserve-avx2", SOURCES, COMPILE_FLAGS)))
            native.declare_quantized_matmul(lib)
            return lib
        except (OSError, RuntimeError) as error:
            reason = str(error)
    logger.info("PyTorch runs the quantized layers: our AVX2 kernel is unavailable (%s)", reason)
    return None


def supports(in_features: int) -> bool:
    """Whether a quantized layer with this many inputs runs on this kernel (and not `native`'s)."""
    return in_features % GROUP_SIZE == 0 and not native.supports(in_features) and library() is not None


def pack_int4(qweight: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our int4 format (qweight [N, K/2] uint8, scales_and_zeros [K/32, N, 2] bfloat16:
    w = (level - 8) * scale + zero) -> the kernel's levels [N, K/2] uint8 (the same
    bytes, in memory of their own), s [N, K/32] and m = zero - 8 s [N, K/32] float32."""
    scale = scales_and_zeros[:, :, 0].t().float()  # [N, G]
    zero = scales_and_zeros[:, :, 1].t().float()  # [N, G]
    return qweight.contiguous().clone(), scale.contiguous(), (zero - 8 * scale).contiguous()


def pack_int8(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Our int8 format (qweight [N, K] int8 in [-127, 127], scales [N] bfloat16) -> the
    kernel's weights [N, K] int8 (the same, in memory of their own) and s [N] float32."""
    return qweight.contiguous().clone(), scales.float().contiguous(), None
