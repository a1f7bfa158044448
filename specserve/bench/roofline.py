"""The memory roofline of a decode step: weight bytes read per token, and bandwidth.

Decoding one token at batch 1 reads every weight the step uses once and does little
arithmetic with each byte, so the step is bound by memory bandwidth: no decoder can
emit more than `bandwidth / bytes_per_token` tokens per second (the KV cache and
activations add a little more traffic; at the context lengths of the suites they are
small next to the weights and are left out, so the limit is an upper bound).

What a step reads is counted by `specserve.model.footprint.weight_bytes_per_token`;
this module adds the same count for a GGUF file, and the bandwidth.
"""

from __future__ import annotations

import time

import gguf
import torch

from specserve.model.footprint import tensor_bytes

BANDWIDTH_PASSES = 5


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


def measure_read_bandwidth(gib: float | None = None, passes: int = BANDWIDTH_PASSES,
                           device: torch.device = torch.device("cpu")) -> tuple[float, str]:
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
