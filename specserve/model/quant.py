"""Weight-only quantization of the linear layers: fewer bytes read per decoded token.

A decode step reads every weight once and does little arithmetic with it, so on a CPU
its time is about the bytes of weights over the memory bandwidth. Storing the linear
weights in 8 or 4 bits (with bfloat16 scales) cuts those bytes 4x or ~7x against
float32; activations stay bfloat16, which is what PyTorch's CPU kernels for packed
weights take (with float32 activations they are 10x slower).

- `int8`: one scale per output channel, symmetric.
- `int4`: one scale and zero point per group of 32 inputs, asymmetric (the head and the
  attention's q/k/v projection stay int8). Groups of 32 match GGUF's Q4_K blocks, whose
  values form an affine 16-level grid per block: the scale search of `quantize_int4`
  finds that grid, so such a block comes back as it was (up to bfloat16 scales) where
  plain min..max rounding would shift it.

Our kernel (`native`) multiplies them by activations quantized to int8 per group of
32, where the CPU has AVX-512 VNNI and a C compiler is present; where it has AVX2
only, our kernel for it (`avx2`) does the same; elsewhere
`torch._weight_int8pack_mm` and `torch._weight_int4pack_mm_for_cpu` do, with
bfloat16 activations.

The quantized tensors are plain (`qweight`, `scales`) pairs, so they are saved and
loaded with safetensors (`quantized_state` / `QuantizedLinear.from_state`); packing into
a kernel's layout happens at load, because that layout is specific to the machine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import QUANTIZATIONS
from specserve.errors import ConfigError
from specserve.model import avx2, native

# Part of the cache file's name: a change to how weights are quantized bumps it, so
# files made by older code are not loaded as if they were current.
QUANTIZED_FORMAT_VERSION = 3  # 3: int4 models keep q/k/v in int8
INT4_GROUP_SIZE = 32
# What the packed kernels take as activations.
QUANTIZED_ACTIVATION_DTYPE = torch.bfloat16


def check_quantization(quantization: str, dtype: torch.dtype) -> None:
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if quantization != "none" and dtype != QUANTIZED_ACTIVATION_DTYPE:
        raise ConfigError(
            f"--quantization {quantization} runs with bfloat16 activations; use --dtype bfloat16 or --dtype auto"
        )


def quantize_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight [out, in] float -> qweight [out, in] int8, scales [out]."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127  # [out]
    qweight = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return {"qweight": qweight, "scales": scales.to(QUANTIZED_ACTIVATION_DTYPE)}


def quantize_int4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight [out, in] float -> qweight [out, in // 2] uint8 (two 4-bit levels per
    byte, even input first), scales_and_zeros [in // 32, out, 2] as the kernel takes
    them: w = (level - 8) * scale + zero."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    low = groups.amin(dim=-1, keepdim=True)  # [out, G, 1]
    span = (groups.amax(dim=-1, keepdim=True) - low).clamp_min(1e-12)  # [out, G, 1]
    # A group whose values sit on an affine grid (a GGUF Q4_K block: scale * level - min)
    # spans n steps of it for some n <= 15, not always 15: try every n, keep the closest.
    best_error = torch.full_like(span, float("inf"))
    scale = span / 15
    for steps in range(15, 0, -1):
        candidate = span / steps
        error = ((groups - low) / candidate).round().clamp(0, steps).mul(candidate).add(low).sub(groups)
        error = error.square().sum(dim=-1, keepdim=True)  # [out, G, 1]
        better = error < best_error * 0.999  # ties keep the finer grid
        scale = torch.where(better, candidate, scale)
        best_error = torch.where(better, error, best_error)
    levels = ((groups - low) / scale).round().clamp(0, 15).to(torch.uint8).view(out_features, in_features)
    zero = low + 8 * scale  # the value of level 8
    scales_and_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [G, out, 2]
    return {
        "qweight": levels[:, 0::2] | (levels[:, 1::2] << 4),
        "scales": scales_and_zeros.to(QUANTIZED_ACTIVATION_DTYPE),
    }


class QuantizedLinear(nn.Module):
    """A linear layer with int8 or int4 weights; x [T, in] bfloat16 -> [T, out] bfloat16.

    Runs our kernel (`native`: int8 activations, weights read once for all
    rows, rows batch invariant) where it can run, else our AVX2 kernel (`avx2`: int8
    activations, rows batch invariant) where that can, else PyTorch's."""

    def __init__(self, bits: int, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.bits = bits
        self.in_features = in_features = qweight.shape[1] * (8 // bits)
        self.out_features = qweight.shape[0]
        self.native = native.supports(in_features)
        self.avx2 = avx2.supports(in_features)
        zeros = None
        if self.native and bits == 8:
            qweight = native.pack_int8(qweight)  # [out, in] uint8
        elif self.native:
            qweight, scales, zeros = native.pack_int4(qweight, scales)  # [out, in/2], [out, in/32] x 2
        elif self.avx2 and bits == 8:
            qweight, scales, zeros = avx2.pack_int8(qweight, scales)  # [out, in] int8, [out] float32, None
        elif self.avx2:
            qweight, scales, zeros = avx2.pack_int4(qweight, scales)  # [out, in/2], [out, in/32] x 2 (s, m)
        elif bits == 8:
            # A copy: tensors read from a safetensors file can sit at any byte offset, and
            # the int8 kernel's multi-row path crashes on a weight that is not aligned.
            qweight = qweight.clone()  # [out, in] int8
        else:
            levels = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).view(qweight.shape[0], -1)
            qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels.to(torch.int32), 1)
        self.register_buffer("weight", qweight, persistent=False)  # the kernel's layout
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("zeros", zeros, persistent=False)
        self.register_buffer("bias", bias, persistent=False)  # [out] or None

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], bias: torch.Tensor | None) -> QuantizedLinear:
        bits = 8 if state["qweight"].dtype == torch.int8 else 4
        if bias is not None:
            bias = bias.detach().to(QUANTIZED_ACTIVATION_DTYPE)
        return cls(bits, state["qweight"], state["scales"], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if self.native or self.avx2:
            return native.quantized_matmul(self.bits, x, self.weight, self.scales, self.zeros, self.bias, lib=self.lib)
        if self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, INT4_GROUP_SIZE, self.scales)
        return y if self.bias is None else y + self.bias

    def first_rows(self, n: int) -> QuantizedLinear:
        """This layer computing only its outputs [0, n), on views of its weights: every
        layout here keeps an output's weights, scales and zeros in its own row, except
        PyTorch's int4 pack (our heads are int8 in any case)."""
        if self.bits == 4 and not (self.native or self.avx2):
            raise ConfigError("a layer on PyTorch's int4 kernel cannot be cut to its first rows")
        rows = QuantizedLinear.__new__(QuantizedLinear)
        nn.Module.__init__(rows)
        rows.bits, rows.in_features, rows.out_features = self.bits, self.in_features, n
        rows.native, rows.avx2 = self.native, self.avx2
        for name, tensor in self._buffers.items():
            rows.register_buffer(name, None if tensor is None else tensor[:n], persistent=False)  # [n, ...] views
        return rows

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """For a fused gate/up projection (the gate's rows first): silu(gate) * up,
        [T, in] -> [T, out / 2], in one kernel call where ours runs."""
        if self.native or self.avx2:
            weights = (self.weight, self.scales, self.zeros, self.bias)
            return native.quantized_matmul(self.bits, x, *weights, gated=True, lib=self.lib)
        return silu_and_mul(self(x))

    @property
    def lib(self):
        """The library whose `quantized_matmul` runs this layer (None: native's)."""
        return avx2.library() if self.avx2 else None


def input_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype a linear layer takes its inputs in: bfloat16 for a `QuantizedLinear`,
    else its weight's."""
    return QUANTIZED_ACTIVATION_DTYPE if isinstance(layer, QuantizedLinear) else layer.weight.dtype


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] gate then up -> [T, I] silu(gate) * up: a SwiGLU MLP's activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _linear_layers(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(parent, attribute, dotted name) of every nn.Linear in the model."""
    found = []
    for parent_name, parent in model.named_modules():
        for attribute, child in parent.named_children():
            if isinstance(child, nn.Linear):
                found.append((parent, attribute, f"{parent_name}.{attribute}".lstrip(".")))
    return found


def keeps_int8(name: str) -> bool:
    """Whether int4 keeps the linear layer of this dotted name in int8: a head that
    scores tokens (a model's `lm_head`, a Medusa head's `lm_heads.i`) and a fused q/k/v
    projection, in a model and in a draft head alike.

    Measured on the default target (perplexity on the sonnets against float32 weights):
    the head, which Q4_K_M keeps at 6 bits (an int4 head: +6.4% -> +8.3%); and q/k/v, as
    Q4_K_M keeps the value projection at 6 bits in half the layers (+6.6% -> +4.1% for
    3% more bytes a token; the down projections Q4_K_M keeps at 6 bits took +6.8% of the
    bytes for 3 points more)."""
    return name == "lm_head" or name.startswith("lm_heads.") or name.endswith("qkv_proj")


def quantized_state(model: nn.Module, quantization: str) -> dict[str, torch.Tensor]:
    """A float model (or draft head) -> flat tensors to save: each linear layer's
    quantized weight and scales (and bias), every other floating tensor in bfloat16,
    integer buffers as they are. A tied head is quantized on its own; the embedding it
    shares weights with stays bfloat16 (a lookup reads one row). A layer whose inputs do
    not split into groups of 32 stays int8 under int4, as `keeps_int8` layers do."""
    state: dict[str, torch.Tensor] = {}
    linear_names = set()
    for parent, attribute, name in _linear_layers(model):
        linear = getattr(parent, attribute)
        bits4 = quantization == "int4" and linear.in_features % INT4_GROUP_SIZE == 0 and not keeps_int8(name)
        for key, tensor in (quantize_int4 if bits4 else quantize_int8)(linear.weight.detach()).items():
            state[f"{name}.{key}"] = tensor
        if linear.bias is not None:
            state[f"{name}.bias"] = linear.bias.detach().to(QUANTIZED_ACTIVATION_DTYPE)
        linear_names.add(name)
    for name, tensor in model.state_dict().items():
        if name.rsplit(".", 1)[0] not in linear_names:
            state[name] = tensor.to(QUANTIZED_ACTIVATION_DTYPE) if tensor.is_floating_point() else tensor
    return state


def load_quantized_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Swap each linear layer of `model` (on any device, meta included) for a
    QuantizedLinear built from `state`, and assign the other tensors."""
    linear_names = set()
    for parent, attribute, name in _linear_layers(model):
        if f"{name}.qweight" not in state:
            raise KeyError(f"quantized state has no {name}.qweight")
        layer_state = {key: state[f"{name}.{key}"] for key in ("qweight", "scales")}
        setattr(parent, attribute, QuantizedLinear.from_state(layer_state, state.get(f"{name}.bias")))
        linear_names.add(name)
    rest = {k: v for k, v in state.items() if k.rsplit(".", 1)[0] not in linear_names}
    model.load_state_dict(rest, strict=True, assign=True)  # the swapped layers hold no state
