"""A model's weights in transparent huge pages.

A decode step on the CPU streams every weight once, so its speed is the memory's read
bandwidth, and with 4 KB pages that stream crosses a page every 4 KB: a TLB miss and a
page walk each, and the hardware prefetchers stop at every page boundary. Linux backs
an anonymous mapping advised with MADV_HUGEPAGE by 2 MB pages where it can (most
distributions set transparent huge pages to `madvise`, and PyTorch's allocator does
not advise). `move_to_huge_pages` copies a model's tensors into one such mapping;
`SPECSERVE_HUGE_PAGES=0` leaves them where they are.

Measured on a Zen 5 (2 vCPUs, a 1 GiB stream of the 1.5B target's gate/up shape, the
two placements taking turns in one process): our int4 kernel at one row 35.8 -> 39.1
GB/s, `torch.sum` 43.7 -> 47.0 GB/s (per round 0.68-0.94x the time).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# Where each tensor starts in the mapping: the kernels' vector loads like 64-byte lines.
ALIGN = 64
# Bytes copied between handing the originals' memory back (`_return_freed_memory`), so
# that the process does not hold both whole copies at once.
TRIM_EVERY = 256 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def unavailable_reason() -> str | None:
    """Why huge pages cannot be had here (or are not wanted: SPECSERVE_HUGE_PAGES=0), or None."""
    if os.environ.get("SPECSERVE_HUGE_PAGES", "1") == "0":
        return "SPECSERVE_HUGE_PAGES=0"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "transparent huge pages are a Linux feature"
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return f"{THP_SETTING} is not readable"
    if "[never]" in setting:
        return "transparent huge pages are off ([never])"
    return None


def _movable(tensor: torch.Tensor | None) -> bool:
    # Small tensors too: a norm's weight read from a safetensors file is a view of the
    # file's mapping, and one such view keeps all of it mapped (6.9 GB of page cache
    # beside the copies, for the float32 1.5B target).
    return (
        tensor is not None
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_mkldnn
        and tensor.is_contiguous()
    )


def _place(tensor: torch.Tensor) -> tuple:
    """Where a tensor sits and what it is: tensors alike here are one tensor."""
    return tensor.data_ptr(), tensor.nbytes, tensor.dtype, tuple(tensor.shape)


def move_to_huge_pages(module: nn.Module) -> int:
    """Copy every dense CPU tensor of `module` (its parameters and buffers, each
    storage once: tied weights stay tied) into one private anonymous mapping advised for
    huge pages, and point the module at the copies. Returns the bytes moved (0 where huge
    pages cannot be had). Call it before anything keeps a tensor's address (the kernels'
    model descriptions, a common head's views)."""
    reason = unavailable_reason()
    if reason is not None:
        logger.info("weights stay in normal pages: %s", reason)
        return 0
    slots = []  # (owner, "_parameters" or "_buffers", name): no tensors held, so each original is freed once copied
    offsets: dict[tuple, int] = {}  # one copy per distinct tensor, by where it sits
    size = 0
    for owner in module.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(owner, kind).items():
                if _movable(tensor):
                    slots.append((owner, kind, name))
                    if _place(tensor) not in offsets:
                        offsets[_place(tensor)] = size
                        size += -(-tensor.nbytes // ALIGN) * ALIGN
    if not slots:
        return 0
    # One page more than needed, so that the copies can start on a 2 MB boundary.
    try:
        arena = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(mmap.MADV_HUGEPAGE)
    except OSError as error:  # no room to map it (strict overcommit), or a kernel without THP
        logger.warning("weights stay in normal pages: mapping %.0f MB for huge pages failed: %s", size / 1e6, error)
        return 0
    memory = torch.frombuffer(arena, dtype=torch.uint8)  # [size + HUGE_PAGE]
    start = -memory.data_ptr() % HUGE_PAGE
    # By where the original sat, and whether it was a Parameter: a tied weight stays one
    # object in both modules. Nothing is allocated from here on, so no address is reused.
    copies: dict[tuple, torch.Tensor] = {}
    untrimmed = 0  # bytes copied since the originals' memory was last handed back
    for owner, kind, name in slots:
        tensor = getattr(owner, kind)[name]
        key = (*_place(tensor), isinstance(tensor, nn.Parameter))
        if key not in copies:
            at = start + offsets[_place(tensor)]
            copy = memory[at : at + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            copy.copy_(tensor)
            copies[key] = nn.Parameter(copy, requires_grad=tensor.requires_grad) if key[-1] else copy
            untrimmed += tensor.nbytes
        getattr(owner, kind)[name] = copies[key]
        del tensor
        if untrimmed >= TRIM_EVERY:
            _return_freed_memory()
            untrimmed = 0
    _return_freed_memory()
    # Every copy holds a reference to the mapping: it is unmapped when the last one goes.
    logger.info("%.0f MB of weights in huge pages", size / 1e6)
    return size


def _return_freed_memory() -> None:
    """Hand the originals' memory back to the OS: glibc keeps freed blocks under 32 MB
    in its heaps (the int4 1.5B target's process stayed at 2.6 GB where 1.9 GB is live)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
