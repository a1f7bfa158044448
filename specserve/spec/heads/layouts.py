"""The public checkpoint layouts of heads: their config keys and tensor names, read and written.

- EAGLE-3 (SafeAILab EAGLE-3, SpecForge; vLLM's llama_eagle3.py reads it): config.json of
  architectures ["LlamaForCausalLMEagle3"], a one-layer Llama config plus draft_vocab_size
  (optional: target_hidden_size, norm_before_residual, eagle_aux_hidden_state_layer_ids);
  tensors midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
  midlayer.self_attn.{q,k,v}_proj.weight [.., 2H], midlayer.self_attn.o_proj.weight,
  midlayer.mlp.{gate,up,down}_proj.weight, fc.weight [H, 3H], norm.weight,
  lm_head.weight [draft_vocab, H], d2t [draft_vocab] (target id = draft id + d2t[draft id])
  and t2d [vocab] bool (both optional where draft_vocab_size is the whole vocabulary).
- EAGLE-1/2 (SafeAILab EAGLE; vLLM's llama_eagle.py): a one-layer config.json of
  architectures ["LlamaForCausalLM"]; tensors fc.weight [H, 2H], fc.bias [H] where the
  head has one, layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
  layers.0.post_attention_layernorm.weight (the layer has no input norm).
- Medusa of FasterDecoding/Medusa: config.json with medusa_num_heads, medusa_num_layers;
  medusa_lm_head.{pt,safetensors} holding head i's block j as {i}.{j}.linear.{weight,bias}
  and its LM head as {i}.{medusa_num_layers}.weight (the state of their `medusa_head`;
  a `medusa_head.` prefix, as in a whole model's file, is accepted).
- Medusa of vLLM (medusa.py): config.json of model_type "medusa" with num_heads (or
  medusa_num_heads), num_hidden_layers (or medusa_num_layers), hidden_size, vocab_size,
  medusa_fc_bias, original_lm_head (one shared LM head), truncated_vocab_size; tensors
  blocks.{i}.layers.{j}.{weight,bias}, lm_heads.{i}.weight or lm_head.weight (shared),
  token_map [truncated_vocab_size] target ids; a `medusa_heads.` prefix is accepted.

Both EAGLE layouts may carry embed_tokens.weight, a frozen copy of the target's table: its
shape is checked, the target's own is used. Written: the EAGLE layouts as read, without
embed_tokens; Medusa in vLLM's layout, so that vLLM loads what we write.

Reading checks the head against the target first (ConfigError naming what differs), then
every tensor's name and shape against the head's own config (ModelLoadError naming the
key); a tensor no part of the head takes is an error too.
"""

from __future__ import annotations

from typing import Any

import torch

from specserve.config import ModelConfig
from specserve.errors import ConfigError, ModelLoadError
from specserve.model.decoder import Block, rope_inverse_frequencies
from specserve.spec.heads.eagle import EagleConfig, EagleHead, feature_layers_for
from specserve.spec.heads.medusa import MedusaConfig, MedusaHeads

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE1_ARCHITECTURE = "LlamaForCausalLM"
MEDUSA_ARCHITECTURE = "MedusaModel"
# vLLM's method names, and what each holds.
LAYOUTS = {"eagle": "an EAGLE-1/2 head", "eagle3": "an EAGLE-3 head", "medusa": "Medusa heads"}
LAYOUT_MARKERS = (
    f"architectures {EAGLE3_ARCHITECTURE} (EAGLE-3), {EAGLE1_ARCHITECTURE} of one layer (EAGLE-1/2), "
    f"{MEDUSA_ARCHITECTURE}, model_type medusa or medusa_num_heads (Medusa)"
)


def layout_of(config: dict[str, Any]) -> str | None:
    """Which head a config.json describes, by the keys its layout writes; None: no head."""
    architectures = config.get("architectures") or []
    if EAGLE3_ARCHITECTURE in architectures:
        return "eagle3"
    if config.get("model_type") == "medusa" or MEDUSA_ARCHITECTURE in architectures or "medusa_num_heads" in config:
        return "medusa"
    if architectures == [EAGLE1_ARCHITECTURE] and config.get("num_hidden_layers") == 1:
        return "eagle"
    return None


class Tensors:
    """A checkpoint's tensors, taken by name with their shapes checked (floating ones
    converted to `dtype`) and copied; `finish` refuses any left over."""

    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype):
        self.remaining = dict(weights)
        self.dtype = dtype

    def __contains__(self, name: str) -> bool:
        return name in self.remaining

    def strip_prefix(self, prefix: str) -> None:
        self.remaining = {name.removeprefix(prefix): tensor for name, tensor in self.remaining.items()}

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.remaining:
            raise ModelLoadError(f"the checkpoint has no tensor {name!r}")
        return tuple(self.remaining[name].shape)

    def take(self, name: str, *shapes: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name`, which must have one of `shapes`."""
        shape = self.shape(name)
        if shape not in shapes:
            implied = " or ".join(str(s) for s in shapes)
            raise ModelLoadError(f"tensor {name!r} has shape {shape}, the config implies {implied}")
        tensor = self.remaining.pop(name)
        # A copy in memory of our own: MKL's float32 GEMM rounds differently at different
        # alignments, and a file's offsets would otherwise decide a head's last bits.
        return (tensor.to(self.dtype) if tensor.is_floating_point() else tensor).clone(
            memory_format=torch.contiguous_format
        )

    def take_if_present(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.take(name, shape) if name in self else None

    def finish(self) -> None:
        if self.remaining:
            unused = sorted(self.remaining)[:3]
            raise ModelLoadError(f"the checkpoint has tensors this head does not use, e.g. {unused}")


def required(config: dict[str, Any], *keys: str) -> Any:
    """The value of the first of `keys` config.json has (several: names of one setting in different layouts)."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    raise ModelLoadError(f"config.json has no {' or '.join(repr(k) for k in keys)}")


def refuse_other_target(hidden_size: int, vocab_size: int, target: ModelConfig) -> None:
    if hidden_size != target.hidden_size:
        raise ConfigError(f"the head was made for hidden size {hidden_size}, the target has {target.hidden_size}")
    if vocab_size != target.vocab_size:
        raise ConfigError(f"the head was made for a vocabulary of {vocab_size} ids, the target has {target.vocab_size}")


def check_target_ids(target_ids: torch.Tensor, vocab_size: int, key: str) -> None:
    if target_ids.numel() and not (0 <= int(target_ids.min()) and int(target_ids.max()) < vocab_size):
        raise ModelLoadError(f"{key!r} maps to target ids outside the vocabulary [0, {vocab_size})")
    if torch.unique(target_ids).numel() != target_ids.numel():
        raise ModelLoadError(f"{key!r} maps two draft ids to one target id")


# ---- EAGLE ----


def eagle_config(version: int, config: dict[str, Any], target: ModelConfig, fc_bias: bool) -> EagleConfig:
    hidden, vocab = required(config, "hidden_size"), required(config, "vocab_size")
    refuse_other_target(config.get("target_hidden_size") or hidden, vocab, target)
    if hidden != target.hidden_size:  # it reads tokens through the target's embedding
        raise ConfigError(
            f"the head's layer is {hidden} wide, the target's embedding {target.hidden_size}: "
            "a head of its own width needs an embedding of its own, which specserve does not read"
        )
    if config.get("num_hidden_layers", 1) != 1:
        layers = config["num_hidden_layers"]
        raise ConfigError(f"EAGLE heads of {layers} layers are not supported (published ones have 1)")
    if config.get("attention_bias"):
        raise ConfigError("EAGLE heads with attention biases are not supported")
    try:
        layer = ModelConfig.from_hf({**config, "model_type": "llama", "tie_word_embeddings": False})
    except KeyError as missing:
        raise ModelLoadError(f"config.json has no {missing.args[0]!r}") from None
    if version == 1:
        return EagleConfig(1, layer, vocab, fc_bias=fc_bias)
    feature_layers = feature_layers_for(target, config.get("eagle_aux_hidden_state_layer_ids"))
    draft_vocab = config.get("draft_vocab_size") or vocab
    if draft_vocab > vocab:
        raise ModelLoadError(f"draft_vocab_size {draft_vocab} exceeds the vocabulary's {vocab} ids")
    return EagleConfig(
        3, layer, draft_vocab, feature_layers, norm_before_residual=bool(config.get("norm_before_residual", False))
    )


def read_layer(tensors: Tensors, prefix: str, layer: ModelConfig, qkv_input: int) -> dict[str, torch.Tensor]:
    """Our Block's fused weights (q/k/v, gate/up) from a Llama layer's tensors named `prefix`..."""
    hidden, intermediate = layer.hidden_size, layer.intermediate_size
    q_size, kv_size = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    attention, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
    return {
        "layer.self_attn.qkv_proj.weight": torch.cat(
            [
                tensors.take(f"{attention}q_proj.weight", (q_size, qkv_input)),
                tensors.take(f"{attention}k_proj.weight", (kv_size, qkv_input)),
                tensors.take(f"{attention}v_proj.weight", (kv_size, qkv_input)),
            ]
        ),
        "layer.self_attn.o_proj.weight": tensors.take(f"{attention}o_proj.weight", (hidden, q_size)),
        "layer.mlp.gate_up_proj.weight": torch.cat(
            [
                tensors.take(f"{mlp}gate_proj.weight", (intermediate, hidden)),
                tensors.take(f"{mlp}up_proj.weight", (intermediate, hidden)),
            ]
        ),
        "layer.mlp.down_proj.weight": tensors.take(f"{mlp}down_proj.weight", (hidden, intermediate)),
        "layer.post_attention_layernorm.weight": tensors.take(f"{prefix}post_attention_layernorm.weight", (hidden,)),
    }


def layer_tensors(layer: Block, prefix: str) -> dict[str, torch.Tensor]:
    """`read_layer` undone: a Llama layer's tensors named `prefix`..."""
    attention, mlp = layer.self_attn, layer.mlp
    q, k, v = attention.qkv_proj.weight.split(attention.qkv_sizes)
    gate, up = mlp.gate_up_proj.weight.chunk(2)
    return {
        f"{prefix}self_attn.q_proj.weight": q,
        f"{prefix}self_attn.k_proj.weight": k,
        f"{prefix}self_attn.v_proj.weight": v,
        f"{prefix}self_attn.o_proj.weight": attention.o_proj.weight,
        f"{prefix}mlp.gate_proj.weight": gate,
        f"{prefix}mlp.up_proj.weight": up,
        f"{prefix}mlp.down_proj.weight": mlp.down_proj.weight,
        f"{prefix}post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
    }


def read_draft_vocab(tensors: Tensors, draft_vocab: int, vocab: int) -> torch.Tensor:  # [draft_vocab] target ids
    d2t = tensors.take_if_present("d2t", (draft_vocab,))
    t2d = tensors.take_if_present("t2d", (vocab,))
    if d2t is None and draft_vocab < vocab:
        raise ModelLoadError(f"the checkpoint has no tensor 'd2t', which a draft vocabulary of {draft_vocab} ids needs")
    target_ids = torch.arange(draft_vocab) + (0 if d2t is None else d2t.long())
    check_target_ids(target_ids, vocab, "d2t")
    if t2d is not None and not (int(t2d.bool().sum()) == draft_vocab and bool(t2d.bool()[target_ids].all())):
        raise ModelLoadError("'t2d' and 'd2t' disagree on which target ids the head drafts")
    return target_ids


def read_eagle(version: int, config: dict[str, Any], tensors: Tensors, target: ModelConfig) -> EagleHead:
    head_config = eagle_config(version, config, target, fc_bias="fc.bias" in tensors)
    hidden = head_config.hidden_size
    if version == 3:
        state = read_layer(tensors, "midlayer.", head_config.layer, 2 * hidden)
        state |= {
            "layer.input_layernorm.weight": tensors.take("midlayer.input_layernorm.weight", (hidden,)),
            "hidden_norm.weight": tensors.take("midlayer.hidden_norm.weight", (hidden,)),
            "fc.weight": tensors.take("fc.weight", (hidden, head_config.target_feature_size)),
            "norm.weight": tensors.take("norm.weight", (hidden,)),
            "lm_head.weight": tensors.take("lm_head.weight", (head_config.draft_vocab_size, hidden)),
            "target_ids": read_draft_vocab(tensors, head_config.draft_vocab_size, target.vocab_size),
        }
    else:
        state = read_layer(tensors, "layers.0.", head_config.layer, hidden)
        state["fc.weight"] = tensors.take("fc.weight", (hidden, 2 * hidden))
        if head_config.fc_bias:
            state["fc.bias"] = tensors.take("fc.bias", (hidden,))
    tensors.take_if_present("embed_tokens.weight", (target.vocab_size, hidden))  # the target's, frozen
    tensors.finish()
    with torch.device("meta"):
        head = EagleHead(head_config)
    head.load_state_dict(state, assign=True)
    head.inv_freq = rope_inverse_frequencies(head_config.layer)  # buffers are not in the state dict
    return head.eval()


def eagle_checkpoint(head: EagleHead) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = head.config
    hf_config = config.layer.to_hf() | {"torch_dtype": str(head.dtype).removeprefix("torch.")}
    if config.version == 1:
        hf_config["bias"] = config.fc_bias  # SafeAILab's key; vLLM reads fc.bias's presence
        tensors = layer_tensors(head.layer, "layers.0.") | {"fc.weight": head.fc.weight}
        if config.fc_bias:
            tensors["fc.bias"] = head.fc.bias
        return hf_config, tensors
    hf_config |= {
        "architectures": [EAGLE3_ARCHITECTURE],
        "draft_vocab_size": config.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
        "norm_before_residual": config.norm_before_residual,
    }
    t2d = torch.zeros(config.layer.vocab_size, dtype=torch.bool)
    t2d[head.target_ids.cpu()] = True
    tensors = layer_tensors(head.layer, "midlayer.") | {
        "midlayer.input_layernorm.weight": head.layer.input_layernorm.weight,
        "midlayer.hidden_norm.weight": head.hidden_norm.weight,
        "fc.weight": head.fc.weight,
        "norm.weight": head.norm.weight,
        "lm_head.weight": head.lm_head.weight,
        "d2t": head.target_ids - torch.arange(config.draft_vocab_size, device=head.target_ids.device),
        "t2d": t2d,
    }
    return hf_config, tensors


# ---- Medusa ----


def read_medusa(config: dict[str, Any], tensors: Tensors, target: ModelConfig) -> MedusaHeads:
    for prefix in ("medusa_heads.", "medusa_head."):
        tensors.strip_prefix(prefix)
    num_heads = required(config, "num_heads", "medusa_num_heads")
    num_layers = required(config, "num_hidden_layers", "medusa_num_layers")
    token_map = None
    if any(name.startswith("blocks.") for name in tensors.remaining):  # vLLM's layout
        hidden, vocab = required(config, "hidden_size"), required(config, "vocab_size")
        refuse_other_target(hidden, vocab, target)
        truncated = config.get("truncated_vocab_size")
        head_config = MedusaConfig(
            num_heads,
            num_layers,
            hidden,
            vocab,
            bias=bool(config.get("medusa_fc_bias", False)),
            shared_lm_head=bool(config.get("original_lm_head", False)),
            truncated_vocab_size=None if truncated in (None, vocab) else truncated,
        )
        if head_config.truncated_vocab_size is not None:
            token_map = tensors.take("token_map", (head_config.truncated_vocab_size,)).long()
            check_target_ids(token_map, vocab, "token_map")
        block_tensor = "blocks.{i}.layers.{j}.{kind}".format
        shared = "lm_head.weight" if "lm_head.weight" in tensors else "lm_heads.0.weight"
        lm_heads = [shared] if head_config.shared_lm_head else [f"lm_heads.{i}.weight" for i in range(num_heads)]
    else:  # FasterDecoding's: hidden size and vocabulary only in the LM head's shape
        vocab, hidden = tensors.shape(f"0.{num_layers}.weight")
        refuse_other_target(hidden, vocab, target)
        head_config = MedusaConfig(num_heads, num_layers, hidden, vocab)
        block_tensor = "{i}.{j}.linear.{kind}".format
        lm_heads = [f"{i}.{num_layers}.weight" for i in range(num_heads)]
    state = {}
    for i in range(num_heads):
        for j in range(num_layers):
            state[f"blocks.{i}.{j}.weight"] = tensors.take(block_tensor(i=i, j=j, kind="weight"), (hidden, hidden))
            if head_config.bias:
                state[f"blocks.{i}.{j}.bias"] = tensors.take(block_tensor(i=i, j=j, kind="bias"), (hidden,))
    width = head_config.head_width
    for k, name in enumerate(lm_heads):
        weight = tensors.take(name, (width, hidden), (vocab, hidden))
        # vLLM takes an LM head over the whole vocabulary too, and keeps token_map's rows.
        state[f"lm_heads.{k}.weight"] = weight[token_map] if weight.shape[0] != width else weight
    if token_map is not None:
        state["target_ids"] = token_map
    tensors.finish()
    with torch.device("meta"):
        heads = MedusaHeads(head_config)
    heads.load_state_dict(state, assign=True)
    return heads.eval()


def medusa_checkpoint(heads: MedusaHeads) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = heads.config
    hf_config = {
        "architectures": [MEDUSA_ARCHITECTURE],
        "model_type": "medusa",
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "medusa_fc_bias": config.bias,
        "original_lm_head": config.shared_lm_head,
        "truncated_vocab_size": config.head_width,
        "torch_dtype": str(heads.lm_heads[0].weight.dtype).removeprefix("torch."),
    }
    tensors = {}
    for i, block in enumerate(heads.blocks):
        for j, linear in enumerate(block):
            tensors[f"blocks.{i}.layers.{j}.weight"] = linear.weight
            if linear.bias is not None:
                tensors[f"blocks.{i}.layers.{j}.bias"] = linear.bias
    if config.shared_lm_head:
        tensors["lm_head.weight"] = heads.lm_heads[0].weight
    else:
        tensors |= {f"lm_heads.{i}.weight": lm_head.weight for i, lm_head in enumerate(heads.lm_heads)}
    if heads.target_ids is not None:
        tensors["token_map"] = heads.target_ids
    return hf_config, tensors


READERS = {
    "eagle": lambda config, tensors, target: read_eagle(1, config, tensors, target),
    "eagle3": lambda config, tensors, target: read_eagle(3, config, tensors, target),
    "medusa": read_medusa,
}
WRITERS = {EagleHead: eagle_checkpoint, MedusaHeads: medusa_checkpoint}
