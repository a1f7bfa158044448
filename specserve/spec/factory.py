"""The one place that turns a `SpecConfig` into a proposer.

A draft model must speak the target's vocabulary token for token, or its drafts and
probabilities would be about other tokens: that is checked here, at load, with a
message that says what differs. A head (EAGLE, Medusa) is checked against the target's
shapes by `load_head`, and runs in the target's dtype on its device, its linear layers
quantized as the target's are where the target is quantized.
"""

from __future__ import annotations

import torch

from specserve.catalogue import LoadedModel, load_model, quantize_head, resolve_head
from specserve.config import DEFAULT_PREFILL_CHUNK_SIZE, HEAD_METHODS, SpecConfig
from specserve.errors import ConfigError
from specserve.model.decoder import Decoder
from specserve.model.quant import QUANTIZED_ACTIVATION_DTYPE
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.eagle import EagleProposer
from specserve.spec.fused import FusedDraftProposer
from specserve.spec.guesses import Guesser
from specserve.spec.heads.checkpoint import load_head
from specserve.spec.heads.medusa import MedusaHeads
from specserve.spec.medusa import MedusaProposer
from specserve.spec.ngram import NgramProposer
from specserve.spec.proposer import Proposer
from specserve.spec.suffix import SuffixProposer


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    difference = target.tokenizer.vocab_difference(draft.tokenizer)
    if difference is None and target.config.vocab_size != draft.config.vocab_size:
        difference = f"the target scores {target.config.vocab_size} tokens, the draft {draft.config.vocab_size}"
    if difference is not None:
        raise ConfigError(
            f"draft model {draft.name!r} does not share the vocabulary of target {target.name!r}: "
            f"{difference}; pick a draft of the same family and tokenizer"
        )


def draft_format(draft_quantization: str | None, dtype: torch.dtype, quantization: str) -> tuple[torch.dtype, str]:
    """The draft's (dtype, quantization) given its own quantization (None: the target's)
    and the target's. Quantized weights take bfloat16 activations whatever the target's dtype."""
    draft_quantization = draft_quantization or quantization
    if draft_quantization != "none":
        return QUANTIZED_ACTIVATION_DTYPE, draft_quantization
    return dtype, draft_quantization


def make_proposer(
    spec: SpecConfig,
    target: LoadedModel,
    dtype: torch.dtype,
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE,
    quantization: str = "none",
    compile: bool | None = False,
) -> tuple[Proposer, SpecConfig]:
    """The proposer `spec` asks for, and `spec` as loading it settled it (a Medusa
    checkpoint's head count bounds k)."""
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max), spec
    if spec.method == "suffix":
        proposer = SuffixProposer(
            spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob,
        )
        return proposer, spec
    if spec.method in HEAD_METHODS:
        return head_proposer(spec, target.decoder, prefill_chunk_size, quantization)
    draft = load_model(
        spec.model, *draft_format(spec.quantization, dtype, quantization), compile=compile, device=target.decoder.device
    )
    check_same_vocabulary(target, draft)
    return draft_proposer(spec, draft.decoder, target, prefill_chunk_size), spec


def head_proposer(
    spec: SpecConfig, target: Decoder, prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE, quantization: str = "none"
) -> tuple[Proposer, SpecConfig]:
    """The EAGLE or Medusa proposer of the head in spec.model's folder, for `target`;
    with the target's `quantization` (int8, int4) the head's linear layers run
    quantized on the same kernels (`quantize_head`), else in the target's dtype."""
    folder = resolve_head(spec.model)
    if quantization == "none":
        head = load_head(folder, target.config, spec.method, target.dtype).to(target.device)
    else:  # quantized from the checkpoint's own precision
        head = load_head(folder, target.config, spec.method, torch.float32)
        quantize_head(head, folder, quantization)
    guesser = Guesser(target.config.vocab_size, spec.draft_confidence_threshold)
    if isinstance(head, MedusaHeads):
        return MedusaProposer(head, guesser), spec.for_medusa_heads(head.config.num_heads)
    head.share_target(target.embed_tokens, target.lm_head)
    return EagleProposer(head, guesser, prefill_chunk_size), spec


def draft_proposer(
    spec: SpecConfig, draft: Decoder, target: LoadedModel, prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE
) -> DraftModelProposer:
    """The proposer of a loaded draft model as `spec` asks: its common head, and fused
    wherever the draft runs in C (2-3% faster than unfused on the int4 pair)."""
    if spec.draft_vocab_size is not None:
        draft.add_common_head(spec.draft_vocab_size)
    special_ids = target.tokenizer.special_ids
    if spec.fused or (spec.fused is None and draft.model_in_c() is not None):
        return FusedDraftProposer(
            draft, target.decoder, spec.draft_confidence_threshold, prefill_chunk_size, special_ids
        )
    return DraftModelProposer(draft, spec.draft_confidence_threshold, prefill_chunk_size, special_ids)
