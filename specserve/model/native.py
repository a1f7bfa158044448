"""Our CPU kernels in C (kernels/*.c), compiled on first use, called through ctypes.

- `quantized_matmul`: int4/int8 weights x int8 activations (see kernels/quantized_matmul.c).
- `float_matmul`: float32 or bfloat16 weights x activations of the same type
  (kernels/float_matmul.c).
- `rms_norm`: RMSNorm of bfloat16 rows in one call instead of 8 PyTorch ops.
- `decode_attention`: each new token's RoPE, cache write and attention alone to the
  cache, all tokens and heads of a sequence in one call instead of a dozen PyTorch ops
  and one SDPA call per token.
- `decode_blocks`: every transformer block of a quantized or bfloat16 model, for tokens
  that attend one at a time, in one call that runs the others (`ModelInC`).
- `speculate_greedy`: a quantized draft model's k greedy steps and a quantized target's
  verification of them in one call (`spec/fused.py`).
- `dot_peak`: the CPU's int8, float32 and bfloat16 multiply-add throughput, and
  int8's with `quantized_matmul`'s scaling (the benchmarks' compute roofline).

This module decides whether they can run here, compiles them once into the artifacts
cache (`$SPECSERVE_CACHE/kernels/`), lays weights out the way the matmul reads them,
and calls them (ctypes releases the GIL for each call). They run on x86-64 Linux CPUs
with AVX-512 VNNI and a C compiler (`$CC`, else `cc`). Where either is missing, or
`SPECSERVE_NATIVE_KERNELS=0` is set, the callers use PyTorch instead: the same
weights, bfloat16 activations, slower (quantized layers on AVX2 CPUs: avx2.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "kernels"
SOURCES = sorted(KERNELS.glob("*.c"))
GROUP_SIZE = 32
BLOCK_GROUPS = 16  # groups per super-block, as in the C file
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
# -ffp-contract=off: a * b + c stays two roundings, as in PyTorch's elementwise ops
# (RoPE in decode_attention.c reproduces them); FMAs are written where wanted.
COMPILE_FLAGS = (
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512vnni",
    "-mavx512bf16",
    "-mfma",
    "-ffp-contract=off",
    "-fopenmp",
    "-shared",
    "-fPIC",
)


@lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def platform_reason() -> str | None:
    """Why no kernel of ours can run here whatever the CPU's flags, or None."""
    if os.environ.get("SPECSERVE_NATIVE_KERNELS", "1") == "0":
        return "SPECSERVE_NATIVE_KERNELS=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"it needs x86-64 Linux, not {platform.system()} {platform.machine()}"
    if _compiler() is None:
        return "no C compiler (set CC, or install gcc)"
    return None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in cpu_flags()]
    if missing and platform_reason() is None:
        return f"the CPU lacks {', '.join(missing)}"
    return platform_reason()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def built_library(stem: str, sources: list[Path], flags: tuple[str, ...]) -> Path:
    """The shared library of `sources` compiled with `flags`, in the artifacts cache as
    STEM-HASH.so (the hash of the sources, flags and compiler), compiled if missing."""
    from specserve.catalogue import cache_root  # models imports this package

    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    headers = sorted(KERNELS.rglob("*.h"))  # every header any of our kernels may include
    key = hashlib.sha256(b"".join(path.read_bytes() for path in sorted(sources) + headers))
    key.update(" ".join(flags).encode() + version.encode())
    target = cache_root() / "kernels" / f"{stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        logger.info("compiling our CPU kernels into %s", target)
        compile_kernels(target, sources, compiler, flags)
        # Libraries built from older sources are never loaded again (the name is their
        # sources' hash); a process that has one loaded keeps its mapping.
        for stale in target.parent.glob(f"{stem}-*.so"):
            if stale != target:
                stale.unlink(missing_ok=True)
    return target


def compile_kernels(
    target: Path, sources: list[Path] = SOURCES, compiler: str | None = None, flags: tuple[str, ...] = COMPILE_FLAGS
) -> None:
    """Compile the kernel sources into the shared library `target` (benchmarks/kernel_ab.py
    builds another revision's sources with it; avx2.py its own sources and flags)."""
    compiler = compiler or _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: a process loading it never sees half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *flags, *map(str, sources), "-lm", "-o", str(built)], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed to compile our kernels:\n{result.stderr[-2000:]}")
        os.replace(built, target)


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with the reason logged once) where it cannot run."""
    reason = unavailable_reason()
    if reason is None:
        try:
            return load_library(built_library("specserve-kernels", SOURCES, COMPILE_FLAGS))
        except (OSError, RuntimeError) as error:
            reason = str(error)
    logger.info("PyTorch runs the quantized layers and norms: our kernels are unavailable (%s)", reason)
    return None


def declare_quantized_matmul(lib: ctypes.CDLL) -> None:
    """The signature of `quantized_matmul`, ours and avx2.py's kernel's alike."""
    lib.quantized_matmul.restype = ctypes.c_int
    lib.quantized_matmul.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,  # bits, gated, x, T, K
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # weights, scale, zero, bias
        ctypes.c_int, ctypes.c_void_p,  # N, y
    ]  # fmt: skip


def load_library(path: Path) -> ctypes.CDLL:
    """A compiled kernel library with its functions' signatures declared."""
    lib = ctypes.CDLL(str(path))
    declare_quantized_matmul(lib)
    # Each line of arguments keeps its comment, which the formatter would move.
    # fmt: off
    lib.float_matmul.restype = None
    lib.float_matmul.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
    ]  # x, T, K, weights, bias, N, y
    lib.bf16_matmul.restype = ctypes.c_int
    lib.bf16_matmul.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int, ctypes.c_void_p,
    ]  # dot, gated, x, T, K, weights, bias, N, y
    lib.bf16_dot_available.restype = ctypes.c_int
    lib.bf16_dot_available.argtypes = []
    lib.rms_norm.restype = None
    lib.rms_norm.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p,
    ]  # x, weight, T, D, eps, out
    lib.decode_blocks.restype = ctypes.c_int
    lib.decode_blocks.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
    ]  # model, cos, rotated_sin, h, T, segments, number of segments
    lib.speculate_greedy.restype = ctypes.c_int
    lib.speculate_greedy.argtypes = [
        *[ctypes.c_void_p] * 7, ctypes.c_int, ctypes.c_float, ctypes.c_void_p,
    ]  # draft, its cos and rotated_sin, target, its cos and rotated_sin, sequences, count, threshold, seconds
    lib.dot_peak.restype = ctypes.c_double
    lib.dot_peak.argtypes = [ctypes.c_int, ctypes.c_double]  # kind (DOT_KINDS), seconds
    lib.decode_attention.restype = ctypes.c_int
    lib.decode_attention.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,  # qkv, row, cos, rotated_sin
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,  # q_norm, k_norm, eps
        ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int] * 7, ctypes.c_void_p,
    ]  # keys, values, n, heads, kv_heads, D, capacity, start, bf16, out
    # fmt: on
    return lib


def activation_order(in_features: int) -> torch.Tensor:
    """[K] long: which input feature sits at each position of the kernel's order."""
    groups = in_features // GROUP_SIZE
    order = torch.empty(in_features, dtype=torch.long)
    for g0 in range(0, groups, BLOCK_GROUPS):
        n = min(BLOCK_GROUPS, groups - g0)
        group = torch.arange(n).view(1, n, 1)  # [1, n, 1] group within the super-block
        quad = torch.arange(8).view(8, 1, 1)  # [8, 1, 1]
        byte = torch.arange(4).view(1, 1, 4)  # [1, 1, 4]
        feature = GROUP_SIZE * (g0 + group) + 4 * quad + byte  # [8, n, 4], in position order
        order[GROUP_SIZE * g0 : GROUP_SIZE * (g0 + n)] = feature.flatten()
    return order


def pack_int4(qweight: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our int4 format (qweight [N, K/2] uint8, even input in the low nibble;
    scales_and_zeros [K/32, N, 2] bfloat16) -> the kernel's weights [N, K/2] uint8,
    scale [N, K/32] and zero [N, K/32] bfloat16 (see the C file for the order)."""
    out_features, half = qweight.shape
    in_features = 2 * half
    levels = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).view(out_features, in_features)
    levels = levels[:, activation_order(in_features)]  # [N, K] in position order
    packed = torch.empty(out_features, half, dtype=torch.uint8)
    groups = in_features // GROUP_SIZE
    for g0 in range(0, groups, BLOCK_GROUPS):
        n = min(BLOCK_GROUPS, groups - g0)
        block = levels[:, GROUP_SIZE * g0 : GROUP_SIZE * (g0 + n)]  # [N, 32n]: quads 0-3, then 4-7
        packed[:, 16 * g0 : 16 * (g0 + n)] = block[:, : 16 * n] | (block[:, 16 * n :] << 4)
    scale = scales_and_zeros[:, :, 0].t().contiguous()
    zero = scales_and_zeros[:, :, 1].t().contiguous()
    return packed, scale, zero


def pack_int8(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [N, K] int8 -> the kernel's levels [N, K] uint8 (weight + 128, in
    position order); the per-row scales go to the kernel as they are."""
    levels = (qweight.to(torch.int16) + 128).to(torch.uint8)
    return levels[:, activation_order(qweight.shape[1])].contiguous()


def supports(in_features: int) -> bool:
    """Whether a layer with this many inputs can run on the kernel (groups of 32)."""
    return in_features % GROUP_SIZE == 0 and library() is not None


def quantized_matmul(
    bits: int,
    x: torch.Tensor,
    weights: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    gated: bool = False,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [T, K] bfloat16 -> [T, N] bfloat16 with weights [N, ...] from `pack_int4` or
    `pack_int8`; gated: -> [T, N/2] silu(gate) * up, the first N/2 rows being the gate's.
    lib: the library whose kernel runs (avx2.py's, with its own packing); ours by default."""
    lib = lib or library()
    assert lib is not None, "quantized_matmul called where the kernel is unavailable"
    x = x.contiguous()
    rows, in_features = x.shape
    out_features = weights.shape[0]
    y = torch.empty(rows, out_features // 2 if gated else out_features, dtype=torch.bfloat16)
    if rows == 0:
        return y
    status = lib.quantized_matmul(
        bits,
        int(gated),
        x.data_ptr(),
        rows,
        in_features,
        weights.data_ptr(),
        scale.data_ptr(),
        None if zero is None else zero.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out_features,
        y.data_ptr(),
    )
    if status != 0:
        raise MemoryError("quantized_matmul could not allocate its activation buffers")
    return y


@lru_cache(maxsize=1)
def has_bf16_dot() -> bool:
    """Whether our kernels run here on a CPU with vdpbf16ps (avx512_bf16), which
    `float_matmul` uses for bfloat16 (the same sums bit for bit, twice the multiply-adds)."""
    lib = library()
    return lib is not None and bool(lib.bf16_dot_available())


def float_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool = False,
    bf16_dot: bool | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N]: x weight^T + bias, with weight [N, K] and bias [N]
    contiguous, all float32 or all bfloat16 (float32 sums, rounded once). Each output
    row depends on its input row only. gated (bfloat16 only): weight holds a SwiGLU's
    gate rows then its up rows, and the result [..., N/2] is silu(gate) * up.
    bf16_dot: bfloat16 on vdpbf16ps (None: where the CPU has it; False: widening the
    weights, for tests)."""
    lib = library()
    assert lib is not None, "float_matmul called where the kernel is unavailable"
    assert x.dtype == weight.dtype in (torch.float32, torch.bfloat16), (x.dtype, weight.dtype)
    assert not gated or x.dtype == torch.bfloat16, "the gated float kernel takes bfloat16"
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features).contiguous()  # [T, K]
    y = torch.empty(*x.shape[:-1], out_features // 2 if gated else out_features, dtype=x.dtype)
    if rows.shape[0] == 0:
        return y
    bias_pointer = None if bias is None else bias.data_ptr()
    if x.dtype == torch.float32:
        lib.float_matmul(
            rows.data_ptr(), rows.shape[0], in_features, weight.data_ptr(), bias_pointer, out_features, y.data_ptr()
        )
    else:
        dot = has_bf16_dot() if bf16_dot is None else bf16_dot
        status = lib.bf16_matmul(
            int(dot),
            int(gated),
            rows.data_ptr(),
            rows.shape[0],
            in_features,
            weight.data_ptr(),
            bias_pointer,
            out_features,
            y.data_ptr(),
        )
        if status != 0:
            raise MemoryError("bf16_matmul could not allocate its buffers")
    return y


DOT_KINDS = {"int8": 0, "float32": 1, "bfloat16": 2, "int8_groups": 3}


def dot_peak(kind: str, seconds: float = 0.3) -> float:
    """Multiply-adds per second of `kind` ("int8": vpdpbusd, "float32": FMA,
    "bfloat16": vdpbf16ps where `has_bf16_dot`, else the FMAs our kernel widens to,
    "int8_groups": vpdpbusd with the per-group scaling `quantized_matmul` does, the most
    its arithmetic can reach; see kernels/dot_peak.c) on every OpenMP thread, measured
    for `seconds`. Needs the kernels (see `library`)."""
    lib = library()
    assert lib is not None, "dot_peak called where the kernels are unavailable"
    if kind == "bfloat16" and not has_bf16_dot():
        kind = "float32"
    return lib.dot_peak(DOT_KINDS[kind], seconds)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] bfloat16, weight [D] bfloat16 -> [..., D] bfloat16."""
    lib = library()
    assert lib is not None, "rms_norm called where the kernel is unavailable"
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    lib.rms_norm(x.data_ptr(), weight.data_ptr(), x.numel() // dim, dim, eps, out.data_ptr())
    return out


def supports_decode_attention(qkv: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `decode_attention` takes these: float32 or bfloat16 on the CPU, rows of
    qkv contiguous, a head size of 16..256 in steps of 16, one layer's contiguous cache."""
    head_dim = keys.shape[-1]
    return (
        qkv.dtype in (torch.float32, torch.bfloat16)
        and keys.dtype == qkv.dtype
        and qkv.is_cpu
        and qkv.stride(-1) == 1
        and head_dim % 16 == 0
        and head_dim <= 256
        and keys.is_contiguous()
        and library() is not None
    )


def decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    rotated_sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    heads: int,
) -> torch.Tensor:
    """New tokens attending one at a time, with their RoPE and cache writes (see the C file).

    qkv [n, (heads + 2 kv_heads) D] before RoPE; cos, rotated_sin [n, D] (see
    `decoder.apply_rope`); q_norm, k_norm [D] or None; keys, values [kv_heads, capacity,
    D]: positions start .. start + n - 1 are written, and query i attends to positions
    0 .. start + i (scale 1/sqrt(D)) -> [n, heads D] in qkv's dtype."""
    lib = library()
    assert lib is not None, "decode_attention called where the kernel is unavailable"
    n = qkv.shape[0]
    kv_heads, capacity, dim = keys.shape
    assert qkv.shape[1] >= (heads + 2 * kv_heads) * dim and start + n <= capacity
    cos, rotated_sin = cos.contiguous(), rotated_sin.contiguous()
    out = qkv.new_empty(n, heads * dim)
    status = lib.decode_attention(
        qkv.data_ptr(),
        qkv.stride(0),
        cos.data_ptr(),
        rotated_sin.data_ptr(),
        None if q_norm is None else q_norm.data_ptr(),
        None if k_norm is None else k_norm.data_ptr(),
        eps,
        keys.data_ptr(),
        values.data_ptr(),
        n,
        heads,
        kv_heads,
        dim,
        capacity,
        start,
        int(qkv.dtype == torch.bfloat16),
        out.data_ptr(),
    )
    if status != 0:
        raise MemoryError("decode_attention could not allocate its score buffer")
    return out


class _Linear(ctypes.Structure):  # struct quantized_linear in kernels.h
    _fields_ = [
        ("weights", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("zero", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("bits", ctypes.c_int),
        ("in_features", ctypes.c_int),
        ("out_features", ctypes.c_int),
    ]


class _Block(ctypes.Structure):  # struct block
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_attention_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
    ]


class _Model(ctypes.Structure):  # struct model
    _fields_ = [
        ("blocks", ctypes.c_void_p),
        *[(name, ctypes.c_int) for name in ("num_layers", "hidden", "heads", "kv_heads", "D", "intermediate", "vocab")],
        ("eps", ctypes.c_float),
        ("embed", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("head", _Linear),
    ]


class _Segment(ctypes.Structure):  # struct segment
    _fields_ = [
        ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        ("n", ctypes.c_int),
        ("capacity", ctypes.c_int),
        ("start", ctypes.c_int),
    ]


class _Sequence(ctypes.Structure):  # struct sequence in speculate.c
    _fields_ = [
        ("draft", _Segment),
        ("target", _Segment),
        ("unseen", ctypes.c_void_p),
        ("num_unseen", ctypes.c_int),
        ("newest", ctypes.c_int64),
        ("max_drafts", ctypes.c_int),
        ("drafted", ctypes.c_void_p),
        ("num_drafted", ctypes.c_int),
        ("target_argmax", ctypes.c_void_p),
        ("target_logits", ctypes.c_void_p),
    ]


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _linear(layer: Any) -> _Linear:
    """A QuantizedLinear, or a bfloat16 FloatLinear as 16 bits (no scales)."""
    if not hasattr(layer, "bits"):
        out_features, in_features = layer.weight.shape
        return _Linear(layer.weight.data_ptr(), None, None, _pointer(layer.bias), 16, in_features, out_features)
    return _Linear(
        layer.weight.data_ptr(),
        _pointer(layer.scales),
        _pointer(layer.zeros),
        _pointer(layer.bias),
        layer.bits,
        layer.in_features,
        layer.out_features,
    )


@dataclass(frozen=True)
class BlockWeights:
    """One transformer block's tensors as `decode_blocks` reads them: bfloat16 norms
    (q_norm and k_norm None without qk_norm) and four linear layers on our kernels
    (`QuantizedLinear`s, or bfloat16 `FloatLinear`s)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: Any
    o: Any
    gate_up: Any
    down: Any


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float


class ModelInC:
    """A quantized or bfloat16 model described once for `decode_blocks` and
    `speculate_greedy`: its blocks, bfloat16 embedding [vocab, hidden] and final norm,
    and its head (a `QuantizedLinear` or bfloat16 `FloatLinear` on our kernels).

    The description holds raw pointers: the tensors must stay where they are (the
    decoder keeps them; its weights are never moved after loading)."""

    def __init__(
        self, blocks: list[BlockWeights], embed: torch.Tensor, final_norm: torch.Tensor, head: Any, shape: ModelShape
    ):
        self._tensors = (blocks, embed, final_norm, head)  # keeps them alive
        self._blocks = (_Block * len(blocks))(
            *[
                _Block(
                    _pointer(b.input_norm),
                    _pointer(b.post_attention_norm),
                    _pointer(b.q_norm),
                    _pointer(b.k_norm),
                    *[_linear(layer) for layer in (b.qkv, b.o, b.gate_up, b.down)],
                )
                for b in blocks
            ]
        )
        self.described = _Model(
            ctypes.addressof(self._blocks),
            len(blocks),
            shape.hidden,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            shape.intermediate,
            shape.vocab,
            shape.eps,
            embed.data_ptr(),
            final_norm.data_ptr(),
            _linear(head),
        )

    def run_blocks(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        segments: list[tuple[torch.Tensor, torch.Tensor, int, int]],
        layers: range | None = None,
    ) -> None:
        """h [T, hidden] bfloat16, updated in place; rope: the (cos, rotated_sin) tables
        [positions, head_dim] (`Decoder.rope_table`); segments: (keys, values, new tokens,
        start) per sequence, covering h's rows in order, keys and values [layers,
        kv_heads, capacity, head_dim] with room for them; `layers`: the blocks to run
        (all by default), as the C code sees a model of those blocks alone."""
        lib = library()
        assert lib is not None and h.is_contiguous() and h.dtype == torch.bfloat16
        layers = layers if layers is not None else range(self.described.num_layers)
        model = self.described
        if len(layers) != model.num_layers:
            model = _Model(*[getattr(self.described, name) for name, _ in _Model._fields_])
            model.blocks += layers.start * ctypes.sizeof(_Block)
            model.num_layers = len(layers)
        described = (_Segment * len(segments))(
            *[
                _Segment(keys[layers.start].data_ptr(), values[layers.start].data_ptr(), n, keys.shape[2], start)
                for keys, values, n, start in segments
            ]
        )
        status = lib.decode_blocks(
            ctypes.byref(model),
            rope[0].data_ptr(),
            rope[1].data_ptr(),
            h.data_ptr(),
            h.shape[0],
            described,
            len(segments),
        )
        if status != 0:
            raise MemoryError("decode_blocks could not allocate its buffers")


@dataclass
class GreedySpeculation:
    """One sequence's share of `speculate_greedy`. In: the caches' tensors (keys,
    values [layers, kv_heads, capacity, head_dim], with room for what is read) and
    lengths, the tokens the draft has not read (ending with the newest), the newest
    token, k, and whether the verified rows' logits are wanted. Out: `drafted`, and when
    the call verified, `target_argmax` [len(drafted) + 1] and, where wanted,
    `target_logits` [len(drafted) + 1, vocab] bfloat16."""

    draft_cache: tuple[torch.Tensor, torch.Tensor, int]
    target_cache: tuple[torch.Tensor, torch.Tensor, int] | None
    unseen: list[int]
    newest: int
    max_drafts: int
    wants_logits: bool = False
    drafted: list[int] = field(default_factory=list)
    target_argmax: list[int] = field(default_factory=list)
    target_logits: torch.Tensor | None = None


def speculate_greedy(
    draft: ModelInC,
    draft_rope: tuple[torch.Tensor, torch.Tensor],
    target: tuple[ModelInC, tuple[torch.Tensor, torch.Tensor]] | None,
    seqs: list[GreedySpeculation],
    confidence_threshold: float,
) -> tuple[float, float]:
    """Draft greedily for every sequence, then verify with `target` (model and RoPE
    tables) when given; see kernels/speculate.c. Fills each sequence's outputs and
    returns the seconds spent drafting and verifying."""
    lib = library()
    assert lib is not None
    unseen = torch.tensor([t for s in seqs for t in s.unseen], dtype=torch.int64)
    room = sum(s.max_drafts for s in seqs) + len(seqs)
    drafted = torch.empty(room, dtype=torch.int64)
    target_argmax = torch.empty(room, dtype=torch.int64)

    def segment(cache: tuple[torch.Tensor, torch.Tensor, int] | None) -> _Segment:
        if cache is None:
            return _Segment()
        keys, values, length = cache
        return _Segment(keys.data_ptr(), values.data_ptr(), 0, keys.shape[2], length)

    described = (_Sequence * len(seqs))()
    vocab = None if target is None else target[0].described.vocab
    logits = [
        torch.empty(s.max_drafts + 1, vocab, dtype=torch.bfloat16) if vocab and s.wants_logits else None for s in seqs
    ]
    read = written = 0
    for slot, s, rows in zip(described, seqs, logits):
        slot.draft, slot.target = segment(s.draft_cache), segment(s.target_cache)
        slot.unseen, slot.num_unseen = unseen.data_ptr() + 8 * read, len(s.unseen)
        slot.newest, slot.max_drafts = s.newest, s.max_drafts
        slot.drafted, slot.target_argmax = drafted.data_ptr() + 8 * written, target_argmax.data_ptr() + 8 * written
        slot.target_logits = _pointer(rows)
        read += len(s.unseen)
        written += s.max_drafts + 1
    seconds = (ctypes.c_double * 2)()
    target_model, target_rope = target if target is not None else (None, (None, None))
    status = lib.speculate_greedy(
        ctypes.byref(draft.described),
        draft_rope[0].data_ptr(),
        draft_rope[1].data_ptr(),
        None if target_model is None else ctypes.byref(target_model.described),
        _pointer(target_rope[0]),
        _pointer(target_rope[1]),
        described,
        len(seqs),
        confidence_threshold,
        seconds,
    )
    if status != 0:
        raise MemoryError("speculate_greedy could not allocate its buffers")
    drafted_list, argmax_list = drafted.tolist(), target_argmax.tolist()
    written = 0
    for slot, s, rows in zip(described, seqs, logits):
        s.drafted = drafted_list[written : written + slot.num_drafted]
        if target is not None:
            s.target_argmax = argmax_list[written : written + slot.num_drafted + 1]
            s.target_logits = None if rows is None else rows[: slot.num_drafted + 1]
        written += s.max_drafts + 1
    return seconds[0], seconds[1]
