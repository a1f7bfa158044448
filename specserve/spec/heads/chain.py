"""An EAGLE head's greedy chain as one static step: k draft positions of B sequences,
each feeding its output feature and argmax to the next, with one read-back for all of
them (a CUDA graph on a GPU, where `EagleHead.use_cuda_graphs` made the head's pool).

Why: drafting a position at a time reads each guess back before the next step can be
fed, so on a GPU a position costs a replay, a read-back and the host's bookkeeping,
several times the head's ~50 us of weights (benchmarks/EXPERIMENTS.md, "An EAGLE head's
own steps graphed and compiled"). A greedy guess needs no host: the argmax and its draft
vocabulary's id stay on the device.

Contract: the guesses are what EagleHead.step position by position would give (the same
static step; only the bucket of positions attention reads may differ, which changes no
value but rounding). The chain writes its pairs at cache.length + j of each head cache
without counting them in `length`: the proposer truncates them away after drafting, as
it does the step-by-step chain's. Greedy requests only: a sampled or penalised guess
depends on the host's generator and counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from specserve.model.graphs import MIN_BUCKET, StepInputs, StepKey, capture_graph, next_power_of_two
from specserve.model.kv_cache import KVCache

if TYPE_CHECKING:
    from specserve.spec.heads.eagle import EagleHead


class ChainKey(NamedTuple):
    batch: int  # sequences, padded to a power of two
    positions: int  # draft positions after the first guess
    bucket: int  # positions attention may read


class GreedyChain:
    """One ChainKey's static inputs and outputs, and on a GPU its graph."""

    def __init__(self, head: EagleHead, key: ChainKey):
        static = head.static
        device = static.pool.keys.device
        self.scratch = static.pool.scratch
        self.index = torch.zeros(3, key.batch, dtype=torch.int64, device=device)  # [3, B]: starts, slots, lengths
        self.index[1] = self.scratch  # capturing runs the chain: no rows of any sequence
        self.tokens = torch.zeros(key.batch, dtype=torch.int64, device=device)  # [B]: each one's first guess
        self.hidden = torch.zeros(key.batch, head.config.hidden_size, dtype=static.pool.keys.dtype, device=device)

        def forward() -> list[torch.Tensor]:  # guesses [B, positions] (target ids), confidences [B, positions]
            starts, slots, lengths = self.index
            tokens, hidden = self.tokens, self.hidden
            guesses, confidences = [], []
            for j in range(key.positions):
                inputs = StepInputs(tokens[:, None], starts + j, slots, lengths, hidden)
                hidden, logits = head.static_step(static, inputs, StepKey(key.batch, 1, key.bucket))
                draft = logits.argmax(dim=-1)  # [B] rows of the draft vocabulary
                confidences.append(logits.softmax(dim=-1).amax(dim=-1))  # [B], as Guesser.greedy_guesses
                tokens = draft if head.target_ids is None else head.target_ids[draft]  # [B] target ids
                guesses.append(tokens)
            return [torch.stack(guesses, dim=1), torch.stack(confidences, dim=1)]

        self.forward = forward
        self.graph: torch.cuda.CUDAGraph | None = None
        if static.capture:
            self.graph, self.outputs = capture_graph(forward, static.memory)

    def run(
        self, first_tokens: list[int], hidden: torch.Tensor, caches: list[KVCache]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """first_tokens and hidden [n, H]: each sequence's first guess and the feature
        that made it -> each one's further guesses and their confidences."""
        batch = self.tokens.shape[0]
        n, padding = len(caches), batch - len(caches)
        host = torch.tensor(
            [c.length for c in caches]
            + [0] * padding
            + [c.slot for c in caches]
            + [self.scratch] * padding
            + [1] * n
            + [0] * padding
            + first_tokens
            + [0] * padding,
            dtype=torch.int64,
        )
        moved = host.to(self.index.device)  # one copy to the device
        self.index.copy_(moved[: 3 * batch].view(3, batch))
        self.tokens.copy_(moved[3 * batch :])
        self.hidden[:n].copy_(hidden)
        if self.graph is None:
            guesses, confidences = self.forward()
        else:
            self.graph.replay()
            guesses, confidences = self.outputs
        # One read-back for both: token ids are exact in float64.
        rows = torch.cat([guesses[:n].double(), confidences[:n].double()], dim=1).tolist()
        positions = guesses.shape[1]
        return [[int(t) for t in r[:positions]] for r in rows], [r[positions:] for r in rows]


@torch.inference_mode()
def draft_greedy_chain(
    head: EagleHead, first_tokens: list[int], hidden: torch.Tensor, caches: list[KVCache], positions: int
) -> tuple[list[list[int]], list[list[float]]] | None:
    """`positions` further greedy guesses for each sequence (see the module's contract),
    or None where the head has no static steps or a cache lacks the room."""
    static = head.static
    if static is None or any(c.slot is None or c.length + positions > static.pool.capacity for c in caches):
        return None
    end = max(c.length for c in caches) + positions
    bucket = min(max(next_power_of_two(end), MIN_BUCKET), static.pool.capacity)
    key = ChainKey(next_power_of_two(len(caches)), positions, bucket)
    if key not in head.chains:
        head.chains[key] = GreedyChain(head, key)
    return head.chains[key].run(first_tokens, hidden, caches)
