"""Tiny targets and heads for the engine tests of head proposers (EAGLE-1, EAGLE-3, Medusa).

`permutation_target` is a target whose every block adds nothing: each position's features
(its layer inputs, its final hidden state) are its token's embedding, and its next token is
`perm` of the current one. Embeddings have equal norms (RMSNorm leaves them as they are)
and share a constant first coordinate, which the heads use as a bias. On it, `right_head`
builds heads that guess right by construction (no training needed); noise on the
target's blocks makes them wrong now and then, so rejections and rollback happen.
"""

from __future__ import annotations

import copy

import torch

from specserve.config import ModelConfig
from specserve.model.decoder import Decoder
from specserve.model.quant import load_quantized_state, quantized_state
from specserve.spec.heads.eagle import EagleConfig, EagleHead
from specserve.spec.heads.medusa import MedusaConfig, MedusaHeads
from tests.conftest import tiny_config

METHODS = ("eagle", "eagle3", "medusa")
QUANTIZATIONS = ("none", "int4")  # the target's, and so its head's
NUM_MEDUSA_HEADS = 7
CONSTANT = 4.0  # the embeddings' first coordinate
GATE_SCALE = 200.0  # sharpens the EAGLE-3 head's lookup table (see right_head)


def target_config(**overrides) -> ModelConfig:
    return tiny_config("qwen2", **{"num_layers": 6, **overrides})  # EAGLE-3 reads layers 2, 3, 3


def permutation_target(seed: int = 0, noise: float = 0.0) -> tuple[Decoder, torch.Tensor]:
    """(the target, perm [V]): a greedy target that maps token t to perm[t], its blocks
    given `noise` (0: exactly)."""
    config = target_config()
    hidden, vocab = config.hidden_size, config.vocab_size
    torch.manual_seed(seed)
    target = Decoder(config).eval()
    perm = torch.randperm(vocab)
    with torch.no_grad():
        target.embed_tokens.weight.copy_(embeddings(vocab, hidden))
        for layer in target.layers:  # the blocks add nothing (or a little noise)
            for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
                linear.weight.copy_(noise * torch.randn_like(linear.weight))
        target.lm_head.weight.zero_()
        target.lm_head.weight[perm] = 0.25 * target.embed_tokens.weight  # row perm[t] scores t's embedding
    return target, perm


def embeddings(vocab: int, hidden: int) -> torch.Tensor:  # [V, H]: norm sqrt(H), first coordinate CONSTANT
    rest = torch.randn(vocab, hidden - 1)
    rest *= (hidden - CONSTANT**2) ** 0.5 / rest.norm(dim=-1, keepdim=True)
    return torch.cat([torch.full((vocab, 1), CONSTANT), rest], dim=-1)


def random_head(method: str, config: ModelConfig, seed: int, draft_vocab: int | None = None) -> EagleHead | MedusaHeads:
    """A head with random weights (EAGLE-3: over `draft_vocab` random ids, all by default)."""
    torch.manual_seed(seed)
    if method == "medusa":
        heads = MedusaHeads(MedusaConfig(NUM_MEDUSA_HEADS, 1, config.hidden_size, config.vocab_size)).eval()
        with torch.no_grad():
            for linear in heads.residual_linears():
                linear.weight.normal_(0, 0.1)
        return heads
    head = EagleHead(EagleConfig.for_target(config, 1 if method == "eagle" else 3, draft_vocab)).eval()
    if method == "eagle3":  # a shuffled draft vocabulary: its row i is target id target_ids[i]
        head.target_ids = torch.randperm(config.vocab_size)[: head.config.draft_vocab_size]
    return head


def right_head(method: str, target: Decoder, perm: torch.Tensor) -> EagleHead | MedusaHeads:
    """A head that always guesses what `permutation_target` (without noise) emits."""
    config, table = target.config, target.embed_tokens.weight.detach()  # [V, H]
    head = random_head(method, config, seed=1)
    with torch.no_grad():
        if method == "medusa":  # head i reads e_t and guesses perm^(i+2)(t)
            for linear in head.residual_linears():
                linear.weight.zero_()
                linear.bias.zero_()
            ahead = perm[perm]
            for lm_head in head.lm_heads:
                lm_head.weight[ahead] = table
                ahead = perm[ahead]
            return head
        layer = head.layer
        layer.self_attn.o_proj.weight.zero_()  # attention adds nothing
        if method == "eagle":  # residual = fc([e_next ; feature]) = e_next; the target's LM head guesses perm
            head.fc.weight.zero_()
            head.fc.weight[:, : config.hidden_size] = torch.eye(config.hidden_size)
            layer.mlp.down_proj.weight.zero_()
            return head
        # EAGLE-3: residual = fc(features) = e_t; its MLP is a lookup table adding
        # e_perm(t) - e_t (row t of gate fires for e_t alone, the first coordinate its
        # bias); the LM head row of target id perm(u) scores e_u.
        head.fc.weight.zero_()
        head.fc.weight[:, : config.hidden_size] = torch.eye(config.hidden_size)
        hidden, vocab = config.hidden_size, config.vocab_size
        bias = torch.zeros(hidden)
        bias[0] = 1 / CONSTANT  # <bias, e> = 1 for every embedding
        gate = GATE_SCALE * (table / hidden - 0.9 * bias)  # [V, H]: GATE_SCALE * (cos - 0.9)
        fired = torch.nn.functional.silu(torch.tensor(0.1 * GATE_SCALE))
        mlp = layer.mlp
        intermediate = mlp.down_proj.weight.shape[1]
        mlp.gate_up_proj.weight.zero_()
        mlp.gate_up_proj.weight[:vocab] = gate
        mlp.gate_up_proj.weight[intermediate : intermediate + vocab] = bias
        mlp.down_proj.weight.zero_()
        mlp.down_proj.weight[:, :vocab] = ((table[perm] - table) / fired).T
        inverse = torch.argsort(perm)
        head.lm_head.weight.copy_(table[inverse[head.target_ids]])
    return head


def quantized(module: Decoder | EagleHead | MedusaHeads, quantization: str) -> Decoder | EagleHead | MedusaHeads:
    """A copy of a float target or head with its linear layers quantized ("none": itself),
    as a quantized target is loaded and its head quantized with it (catalogue.quantize_head)."""
    if quantization == "none":
        return module
    state = quantized_state(module, quantization)
    if isinstance(module, Decoder):  # a new one: the float one's RoPE tables are float32
        with torch.device("meta"):
            copied = Decoder(module.config)
        copied.inv_freq = module.inv_freq
    else:
        copied = copy.deepcopy(module)
    load_quantized_state(copied, state)
    return copied.eval()
