"""Training Medusa heads: head i reads the target's last feature at position t and guesses
the token at t + 2 + i, against the target's distribution for it (the objective's step i).

Each head's residual blocks start at zero (so it starts as the target's own LM head on
the feature) and its LM head covers the draft vocabulary, rows initialised from the
target's; both train. The saved heads use vLLM's layout with the draft vocabulary as its
`token_map` (truncated_vocab_size), so a head costs H x draft_vocab, not H x vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.spec.heads.medusa import MedusaConfig, MedusaHeads
from specserve.train.features import FeatureSpec
from specserve.train.objective import Batch, DraftVocab, Figures, step_objective

MEDUSA_BLOCKS_PER_HEAD = 1  # FasterDecoding's default


class MedusaMethod:
    name = "medusa"

    def __init__(self, num_heads: int):
        self.num_steps = num_heads  # head i is step i

    def feature_spec(self, target: ModelConfig) -> FeatureSpec:
        return FeatureSpec(final=True)

    def new_head(
        self, target: ModelConfig, embed_tokens: nn.Module, vocab: DraftVocab, lm_head_rows: torch.Tensor
    ) -> MedusaHeads:  # lm_head_rows [draft_vocab, H]: the target's
        size = len(vocab.target_ids)
        config = MedusaConfig(
            self.num_steps,
            MEDUSA_BLOCKS_PER_HEAD,
            target.hidden_size,
            target.vocab_size,
            truncated_vocab_size=size if size < target.vocab_size else None,
        )
        heads = MedusaHeads(config)
        with torch.no_grad():
            for lm_head in heads.lm_heads:
                lm_head.weight.copy_(lm_head_rows)
            if heads.target_ids is not None:
                heads.target_ids.copy_(vocab.target_ids)
        return heads

    def objective(self, heads: MedusaHeads, batch: Batch, vocab: DraftVocab) -> Figures:
        return step_objective(heads.scores(batch.features), batch, vocab)  # [num_heads, B, T, draft_vocab]
