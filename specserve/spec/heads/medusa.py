"""Medusa heads: each guesses one token further ahead from the target's last feature.

The feature is the target's last hidden state after its final norm (what its LM head
reads) at the newest verified position. Head i (0-based) guesses the token i + 2 places
after that position (the target's own LM head guesses the next one): `num_layers`
residual blocks x + SiLU(W x + b), then an LM head (H -> vocabulary, no bias), per head
or one shared by all (vLLM's `original_lm_head`). A fresh block's W is zero
(FasterDecoding/Medusa), so a new head starts near its LM head's reading of the feature.

Heads keep no state: drafting reads one feature and no cache needs rolling back. vLLM's
proposer takes each head's argmax, a chain; Medusa's tree is a GPU optimisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.errors import ConfigError
from specserve.model.quant import input_dtype
from specserve.spec.heads.vocab import to_target_ids, widen_to_target_vocab


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int  # residual blocks per head
    hidden_size: int
    vocab_size: int  # the target's
    bias: bool = True  # the blocks' linear layers carry biases (FasterDecoding: always; vLLM: medusa_fc_bias)
    shared_lm_head: bool = False  # one LM head for every head (vLLM's original_lm_head)
    truncated_vocab_size: int | None = None  # the LM heads score `token_map`'s ids only (vLLM); None: every id

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise ConfigError(f"Medusa needs >= 1 head and >= 0 layers, got {self.num_heads} and {self.num_layers}")

    @property
    def head_width(self) -> int:
        """Rows of each LM head."""
        return self.truncated_vocab_size or self.vocab_size


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden, hidden, bias=config.bias) for _ in range(config.num_layers))
            for _ in range(config.num_heads)
        )
        for linear in self.residual_linears():
            nn.init.zeros_(linear.weight)
        self.lm_heads = nn.ModuleList(
            nn.Linear(hidden, config.head_width, bias=False)
            for _ in range(1 if config.shared_lm_head else config.num_heads)
        )
        truncated = config.truncated_vocab_size is not None
        self.register_buffer("target_ids", torch.arange(config.head_width) if truncated else None)  # [width] int64

    def residual_linears(self) -> list[nn.Linear]:
        return [linear for block in self.blocks for linear in block]

    def lm_head(self, i: int) -> nn.Linear:
        return self.lm_heads[0 if self.config.shared_lm_head else i]

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Scores of the first `num_heads` heads (all by default) over their LM heads'
        rows, [R, H] -> [num_heads, R, head_width] float32; `to_target_ids` names their
        target ids."""
        return self.scores(hidden, num_heads)

    def scores(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """`forward` outside inference mode, for training: [..., H] -> [num_heads, ..., head_width]."""
        return torch.stack([self.head_scores(hidden, i) for i in range(len(self.blocks[:num_heads]))])

    def head_scores(self, hidden: torch.Tensor, i: int) -> torch.Tensor:
        """Head i's scores alone: [..., H] -> [..., head_width] float32."""
        x = hidden.to(input_dtype(self.lm_heads[0]))  # [..., H]
        for linear in self.blocks[i]:
            x = x + F.silu(linear(x))
        return self.lm_head(i)(x).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the LM heads [...] -> target token ids [...]."""
        return to_target_ids(draft_ids, self.target_ids)

    def logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Scores of the first `num_heads` heads over the target's vocabulary, -inf at ids
        they never guess: [R, H] -> [num_heads, R, vocab] float32."""
        return widen_to_target_vocab(self(hidden, num_heads), self.target_ids, self.config.vocab_size)
