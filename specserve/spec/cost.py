"""What a draft position costs in target forwards, estimated before any is measured:
the prior that adaptive k (spec/adaptive.py) starts from and `specserve tune` predicts
with. Measured costs replace it as the engine runs."""

from __future__ import annotations

from specserve.model.decoder import Decoder
from specserve.model.footprint import weight_bytes_per_token
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.eagle import EagleProposer
from specserve.spec.medusa import MedusaProposer
from specserve.spec.proposer import Proposer


def draft_bytes_per_position(draft: Decoder) -> int:
    """Bytes of weights a draft position reads on most text: with the common head where
    the draft has one (spec/draft_model.py: a text that keeps to its ids)."""
    whole = weight_bytes_per_token(draft)
    if draft.common is None:
        return whole
    return whole - weight_bytes_per_token(draft.lm_head) + weight_bytes_per_token(draft.common[1])


def prior_cost_ratio(proposer: Proposer, target: Decoder) -> float:
    """A first guess of one draft position's cost in target forwards, before any is
    measured (an n-gram lookup costs next to nothing). On the CPU a decode step is bound
    by the weights it reads: the ratio of weight bytes per token. On a GPU our eager
    steps are bound by kernel launches, a fixed number per layer (an H100 ran the 1.5B
    target at 6% of its memory roofline, and the 0.5B draft's position cost about 0.8 of
    a target step where its bytes say 0.3): the larger of that and the ratio of layers.
    With CUDA graphs (`Decoder.use_cuda_graphs`) a step launches once: the bytes again.
    A head's position reads its own weights (one layer and an LM head): an EAGLE head's
    steps run as graphs where the target's do, Medusa's heads eagerly."""
    if isinstance(proposer, DraftModelProposer):
        draft = proposer.draft
        position_bytes, layers, graphed = (
            draft_bytes_per_position(draft),
            draft.config.num_layers,
            (target.static is not None and draft.static is not None),
        )
    elif isinstance(proposer, EagleProposer):
        position_bytes, layers, graphed = proposer.bytes_per_position(), 1, proposer.head.static is not None
    elif isinstance(proposer, MedusaProposer):
        position_bytes, layers, graphed = proposer.bytes_per_position(), 1, False
    else:
        return 0.0
    by_bytes = position_bytes / weight_bytes_per_token(target)
    if target.device.type == "cpu" or graphed:
        return by_bytes
    return max(by_bytes, layers / target.config.num_layers)
