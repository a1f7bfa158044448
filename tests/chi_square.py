"""Pearson's chi-square goodness-of-fit test, for the statistical tests of speculation."""

from __future__ import annotations

import torch


def chi_square_p_value(samples: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """samples [N, length] of tokens < V, expected_probs [V] * length -> the p-value of
    Pearson's chi-square test; 0 when a sample has probability 0. Cells expecting fewer
    than 5 samples are pooled so the chi-square approximation holds."""
    num_samples, length = samples.shape
    vocab = expected_probs.shape[0]
    cell = (samples * vocab ** torch.arange(length - 1, -1, -1)).sum(dim=1)  # [N] row-major index
    observed = torch.bincount(cell, minlength=vocab**length).double()  # [V**length]
    expected_probs = expected_probs.flatten()
    if observed[expected_probs == 0].sum() > 0:
        return 0.0
    expected = expected_probs * num_samples
    large = expected >= 5
    observed_cells = torch.cat([observed[large], observed[~large].sum(0, keepdim=True)])
    expected_cells = torch.cat([expected[large], expected[~large].sum(0, keepdim=True)])
    if expected_cells[-1] < 5:  # fold a small pool into the smallest large cell
        smallest = expected_cells[:-1].argmin()
        observed_cells[smallest] += observed_cells[-1]
        expected_cells[smallest] += expected_cells[-1]
        observed_cells, expected_cells = observed_cells[:-1], expected_cells[:-1]
    statistic = ((observed_cells - expected_cells) ** 2 / expected_cells).sum()
    degrees_of_freedom = torch.tensor(len(expected_cells) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(degrees_of_freedom / 2, statistic / 2))


def seeded_outputs(
    engine, prompt: list[int], fields: dict, batches: int = 10, per_batch: int = 600, keyed: bool = True
) -> torch.Tensor:
    """[batches * per_batch, max_tokens]: the engine's outputs for prompt, each request
    seeded apart by seed batch * 1000 + i, per_batch of them at a time: with `keyed`, the
    request's seed (keyed draws, spec/verify.py); else an unseeded request's generator."""
    from specserve.sampling import SamplingParams

    samples = []
    for batch in range(batches):
        seeds = [batch * 1000 + i for i in range(per_batch)]
        seqs = [engine.add_request(prompt, SamplingParams(**fields, seed=seed if keyed else None)) for seed in seeds]
        if not keyed:
            for seq, seed in zip(seqs, seeds):
                seq.generator.manual_seed(seed)
        while engine.has_unfinished():
            engine.step()
        samples += [s.output_ids for s in seqs]
    return torch.tensor(samples)


def target_continuation_probs(target, prompt: list[int], params) -> torch.Tensor:
    """[V] * max_tokens float64: the target's probability of every continuation of prompt
    under params (temperature > 0), one prefix at a time."""
    import itertools

    from specserve.model.decoder import Segment
    from specserve.sampling import logits_to_probs

    vocab, length = target.config.vocab_size, params.max_tokens
    expected = torch.ones([vocab] * length, dtype=torch.float64)
    for cont in itertools.product(range(vocab), repeat=length):
        ids = prompt + list(cont)
        logits = target(torch.tensor(ids), [Segment(target.new_cache(), len(ids))])
        probs = logits_to_probs(logits[len(prompt) - 1 : -1], params)  # [length, V]
        expected[cont] = probs[torch.arange(length), torch.tensor(cont)].prod()
    return expected
