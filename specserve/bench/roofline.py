"""The memory roofline of a decode step: weight bytes read per token, and bandwidth.

Decoding one token at batch 1 reads every weight the step uses once and does little
arithmetic with each byte, so the step is bound by memory bandwidth: no decoder can
emit more than `bandwidth / bytes_per_token` tokens per second (the KV cache and
activations add a little more traffic; at the context lengths of the suites they are
small next to the weights and are left out, so the limit is an upper bound).

What a step reads is counted by `specserve.model.footprint.weight_bytes_per_token`;
this module adds the same count for a GGUF file, and the bandwidth.

Speculation meets a second limit. Verifying k drafts runs k + 1 rows through weights
read once, so its price is arithmetic: on a CPU with few cores a verified row costs
its multiply-adds over the arithmetic peak (`measure_dot_peaks`; for quantized weights
the peak of our kernel's instruction mix, int8 dot products with their scaling). With a plain step
and a draft position at the memory limit and every row at that peak,
`speculation_ceiling` gives the most any k can gain with every draft accepted: how
far speculation can pay on this machine, before any acceptance is lost.
"""

from __future__ import annotations

import time

import gguf
import torch

from specserve.model import native
from specserve.model.footprint import tensor_bytes

BANDWIDTH_PASSES = 5
MAX_CEILING_K = 32  # the longest draft the ceiling considers


def gguf_weight_bytes_per_token(reader: gguf.GGUFReader) -> int:
    """The same count for a GGUF file, from its tensors' stored (quantized) sizes."""
    tensors = {t.name: t for t in reader.tensors}
    total = sum(t.n_bytes for name, t in tensors.items() if name != "token_embd.weight")
    table = tensors.get("token_embd.weight")
    if table is not None:
        tied = "output.weight" not in tensors  # llama.cpp's head is then the table itself
        num_rows = int(table.shape[-1])  # GGUF shapes run innermost first: [hidden, vocab]
        total += table.n_bytes if tied else table.n_bytes // num_rows
    return total


def measure_read_bandwidth(
    gib: float | None = None, passes: int = BANDWIDTH_PASSES, device: torch.device = torch.device("cpu")
) -> tuple[float, str]:
    """(bytes/s, how it was measured): the best of `passes` torch.sum passes over a
    float32 tensor far bigger than the caches, on the device the models use (on the
    CPU with torch's threads, as a decode uses; a GPU is waited for around each pass).
    gib: the tensor's size; by default 1 GiB, and 8 on a GPU, which reads 1 GiB in well
    under a millisecond (8 keeps the launch out of the figure)."""
    if gib is None:
        gib = 1.0 if device.type == "cpu" else 8.0
    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32, device=device)  # [N]
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    data.sum()  # first touch: page faults are not bandwidth
    best = float("inf")
    for _ in range(passes):
        wait()
        start = time.perf_counter()
        data.sum()
        wait()
        best = min(best, time.perf_counter() - start)
    num_bytes = tensor_bytes(data)
    del data
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the GPU's memory back to the models measured next
    where = f"on {device}" if device.type != "cpu" else f"{torch.get_num_threads()} threads"
    method = f"best of {passes} torch.sum passes over a {gib:g} GiB float32 tensor, {where}"
    return num_bytes / best, method


def measure_dot_peaks(device: torch.device = torch.device("cpu")) -> tuple[dict[str, float], str] | None:
    """({"int8": multiply-adds/s, "float32": ..., "bfloat16": ..., "int8_groups": ...},
    how) of this CPU on torch's threads, or None off the CPU or where our kernels cannot
    run (see `native.library`)."""
    if device.type != "cpu" or native.library() is None:
        return None
    peaks = {kind: native.dot_peak(kind) for kind in native.DOT_KINDS}
    bfloat16 = "vdpbf16ps" if native.has_bf16_dot() else "FMA for bfloat16"
    return peaks, (
        f"vpdpbusd (alone, and with quantized_matmul's scaling per group), FMA and {bfloat16} "
        f"chains in registers, {torch.get_num_threads()} threads"
    )


def arithmetic_of(fmt: str) -> str | None:
    """The multiply-adds a row of a model stored as `fmt` ("float32", "int4", peers.py's
    "int4/bfloat16", ...) costs on our kernels: int8 dot products scaled group by group
    for int4/int8 weights (not vpdpbusd's bare peak: the scaling takes ports it needs,
    see kernels/dot_peak.c), float32 FMAs for float32, bfloat16 pairs for bfloat16; None
    for other formats."""
    if fmt.startswith(("int4", "int8")):
        return "int8_groups"
    return fmt if fmt in ("float32", "bfloat16") else None


def ceiling(target_bytes: int, target_macs: int, draft_bytes: int, bandwidth: float, peak: float) -> dict:
    """The prices of a plain step and a draft position at the memory limit (`bandwidth`)
    and of a verified row at the arithmetic peak, and the most any k could gain with
    them (`speculation_ceiling`). draft_bytes 0: free drafts (n-gram, lookup)."""
    plain_s, row_s, draft_s = target_bytes / bandwidth, target_macs / peak, draft_bytes / bandwidth
    speedup, k = speculation_ceiling(plain_s, row_s, draft_s)
    return {
        "plain_step_s": plain_s,
        "verified_row_s": row_s,
        "draft_position_s": draft_s,
        "max_speedup": speedup,
        "best_k": k,
    }


def speculation_ceiling(plain_s: float, row_s: float, draft_s: float) -> tuple[float, int]:
    """(speedup, k): the best over k of (k + 1) plain steps over the time of one
    speculative step that accepts every draft, k draft positions of draft_s and a
    verification of k + 1 rows costing the larger of a plain step (memory) and k + 1
    rows of row_s (arithmetic). Of equal speedups, the shortest k."""
    best = (0.0, 0)
    for k in range(1, MAX_CEILING_K + 1):
        speedup = (k + 1) * plain_s / (k * draft_s + max(plain_s, (k + 1) * row_s))
        if speedup > best[0] * (1 + 1e-9):
            best = (speedup, k)
    return best
