"""`specserve tune`: which draft and which k pay, per test case, measured in-process.

A draft is a draft model, `ngram` or `suffix`, or an EAGLE or Medusa head: a catalogue head's name
or METHOD:FOLDER (`eagle3:heads/mine`); a Medusa checkpoint is swept at the ks its
heads reach. The target and every draft are loaded once; each configuration (plain,
every draft with every k, every draft adaptive) decodes the same prompts of the chosen
suites at temperature 0, one request at a time, so the figures are the decode speed a
lone user sees; the configurations take turns prompt by prompt, so the machine's swings
in speed fall on all of them (`Tuner.measure`). For each
configuration and test case (and each draft with adaptive k, as served by default:
spec/adaptive.py) the table gives acceptance, inter-token latency, output
throughput, the speedup of the decode rate over the plain target, and beside it the
speedup Leviathan et al. (2023) predict from the measured acceptance rate `alpha` and
the measured draft/target cost ratio `c` of one decode step:

    predicted = (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))

with k the mean number of tokens actually drafted per step (the draft stops early
after a guess it is unsure of, so on open-ended text it drafts far fewer than the
configured k). The formula assumes verifying k + 1 tokens costs what one token costs and that drafts
are accepted independently; where the measured speedup falls short of it, that is the
price of verification and of correlated rejections.

On a CPU it also gives each draft's ceiling on this machine (`ceilings`): the most any
k could gain with every guess accepted, from the memory bandwidth and the arithmetic
peak (see `specserve.bench.roofline`), so a measured speedup can be read against what
the hardware allows; and for each draft model, on any device, the same bound measured
from the engine's own steps (`full_acceptance`), which the code that serves reaches.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.bench import measured_ceiling
from specserve.bench.roofline import arithmetic_of, ceiling, measure_dot_peaks, measure_read_bandwidth
from specserve.bench.suites import SUITES
from specserve.catalogue import HEADS, LoadedModel, load_model
from specserve.config import DEFAULT_DRAFT_VOCAB_SIZE, HEAD_METHODS, SpecConfig
from specserve.engine.build import encode_prompt, run_one
from specserve.engine.engine import Engine
from specserve.model.device import CPU
from specserve.model.footprint import multiply_adds_per_token, weight_bytes_per_token
from specserve.sampling import SamplingParams
from specserve.spec.adaptive import AdaptiveSpecLength
from specserve.spec.cost import draft_bytes_per_position, prior_cost_ratio
from specserve.spec.factory import check_same_vocabulary, draft_format, draft_proposer, head_proposer
from specserve.spec.ngram import NgramProposer
from specserve.spec.proposer import Proposer
from specserve.spec.stats import SpecStats
from specserve.spec.suffix import SuffixProposer

NGRAM, SUFFIX = "ngram", "suffix"
LOOKUPS = (NGRAM, SUFFIX)  # proposers that read tokens alone: no model to load
PLAIN = "plain"
ADAPTIVE = "adaptive"  # the k column of adaptive rows
FULL_ACCEPTANCE_ROUNDS = 3  # of every k and plain taking turns (`full_acceptance`)


@dataclass
class Measurement:
    """One configuration on one test case, summed over its prompts."""

    output_tokens: int = 0
    decode_tokens: int = 0  # output tokens after the first of each request
    decode_s: float = 0.0
    e2e_s: float = 0.0
    spec: SpecStats = field(default_factory=SpecStats)

    @property
    def mean_draft_length(self) -> float:
        """Tokens actually drafted per step: k, less where the draft stopped early."""
        return self.spec.num_draft_tokens / self.spec.num_drafts if self.spec.num_drafts else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def predicted_speedup(alpha: float | None, k: float, cost_ratio: float) -> float | None:
    """Leviathan et al.'s expected speedup in wall time for acceptance rate alpha and
    k tokens drafted per step (a mean: the draft stops early when unsure)."""
    if alpha is None or k == 0:
        return None
    tokens_per_step = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens_per_step / (k * cost_ratio + 1)


def head_of(name: str) -> tuple[str, str] | None:
    """(method, head) where `name` is an EAGLE or Medusa head: a catalogue head's name, or
    METHOD:FOLDER; None for a draft model or a lookup (`ngram`, `suffix`)."""
    if name in HEADS:
        return HEADS[name].method, name
    method, colon, folder = name.partition(":")
    return (method, folder) if colon and method in HEAD_METHODS else None


def proposer_config(draft: str, k: int | None = None) -> dict:
    """`--speculative-config`'s proposer keys for `draft`, a draft model, a lookup or a head
    (see `head_of`), drafting k tokens (None: 3 for a head, 7 otherwise)."""
    head = head_of(draft)
    if head is not None:
        return {"method": head[0], "model": head[1], "num_speculative_tokens": k or 3}
    proposer = {"method": draft} if draft in LOOKUPS else {"model": draft}
    return {**proposer, "num_speculative_tokens": k or 7}


def decode_step_seconds(model: LoadedModel, prompt_ids: list[int], num_tokens: int) -> float:
    """Seconds per decode step of `model` alone, plain, after its first token."""
    engine = Engine(model.decoder, eos_token_ids=())
    run_one(engine, model.tokenizer, prompt_ids, SamplingParams(max_tokens=2, temperature=0))  # warm-up
    result = run_one(
        engine, model.tokenizer, prompt_ids, SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    )
    return 1 / result["decode_tokens_per_s"]


class Tuner:
    def __init__(
        self,
        target: str,
        drafts: list[str],
        ks: list[int],
        suites: list[str],
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        quantization: str = "none",
        draft_quantization: str | None = None,
        batch_invariant: bool = False,
        device: torch.device = CPU,
    ):
        """Sweeps plain, then each draft with each k, then each draft with adaptive k up
        to max(ks), as served by default."""
        self.target = load_model(target, dtype, quantization, batch_invariant, device=device)
        self.quantization = quantization
        self.drafts: dict[str, LoadedModel | None] = {}  # None: a lookup, or a head (`heads`)
        self.heads: dict[str, tuple[str, str]] = {}  # name -> (method, head)
        self.head_counts: dict[str, int] = {}  # a Medusa checkpoint's heads: the most it drafts
        self.loaded_heads: dict[str, Proposer] = {}  # one proposer per head, for its costs
        for name in drafts:
            head = head_of(name)
            if name in LOOKUPS or head is not None:
                self.drafts[name] = None
                if head is not None:  # loaded now, so that a head that does not fit fails first
                    self.heads[name] = head
                    proposer, settled = self._head_proposer(name, None if head[0] == "medusa" else 1)
                    self.loaded_heads[name] = proposer
                    if head[0] == "medusa":
                        self.head_counts[name] = settled.num_speculative_tokens
                continue
            draft = load_model(name, *draft_format(draft_quantization, dtype, quantization), device=device)
            check_same_vocabulary(self.target, draft)
            draft.decoder.add_common_head(DEFAULT_DRAFT_VOCAB_SIZE)  # as served by default (the ceilings count it)
            self.drafts[name] = draft
        self.ks = ks
        self.max_tokens = max_tokens
        # what a verified row multiplies with: our int8 dot products, float32 FMAs or bfloat16 pairs
        self.arithmetic = arithmetic_of(quantization if quantization != "none" else str(dtype).removeprefix("torch."))
        tokenizer = self.target.tokenizer
        self.prompts = {
            suite: [encode_prompt(tokenizer, chat=text) for text in SUITES[suite].values()] for suite in suites
        }

    def _head_proposer(self, name: str, k: int | None, always: bool = False) -> tuple[Proposer, SpecConfig]:
        """A head's proposer drafting up to k (None: a Medusa checkpoint's head count), as
        served by default, or `always` drafting k (`measured_ceiling.always_drafting`)."""
        method, head = self.heads[name]
        if always:
            spec = measured_ceiling.always_drafting(head, k, method)
        else:
            spec = SpecConfig.parse({"method": method, "model": head, "num_speculative_tokens": k})
        return head_proposer(spec, self.target.decoder, quantization=self.quantization)

    def ks_of(self, name: str) -> list[int]:
        """The ks swept for a draft: a Medusa checkpoint's stop at its head count (or are
        its head count, where every k asked for passes it)."""
        heads = self.head_counts.get(name)
        return [k for k in self.ks if heads is None or k <= heads] or [heads]

    def most_k(self, name: str) -> int:
        """The largest k a draft's adaptive rows and full-acceptance bound reach."""
        return min(max(self.ks), self.head_counts.get(name, max(self.ks)))

    def engine(self, proposer_name: str, k: int | str) -> Engine:
        """The engine of one configuration, on the shared target; k: a fixed number of
        drafted tokens, or ADAPTIVE (up to `most_k`)."""
        proposer = None
        if proposer_name == NGRAM:
            proposer = NgramProposer(SpecConfig.prompt_lookup_min, SpecConfig.prompt_lookup_max)
        elif proposer_name == SUFFIX:  # vLLM's defaults; the answers before teach the ones after
            proposer = SuffixProposer()
        elif proposer_name in self.heads:
            proposer, _ = self._head_proposer(proposer_name, self.most_k(proposer_name) if k == ADAPTIVE else k)
        elif proposer_name != PLAIN:
            served = SpecConfig.parse({"model": proposer_name, "num_speculative_tokens": 1})  # the defaults
            proposer = draft_proposer(served, self.drafts[proposer_name].decoder, self.target)
        adaptive = None
        if k == ADAPTIVE:
            k = self.most_k(proposer_name)
            adaptive = AdaptiveSpecLength(k, prior_cost_ratio(proposer, self.target.decoder))
        return Engine(self.target.decoder, self.target.tokenizer.eos_token_ids, proposer, k, adaptive=adaptive)

    def measure(self, configs: list[tuple[str, int | str]]) -> dict[tuple[str, int | str], dict[str, Measurement]]:
        """Every configuration on every test case. The configurations take turns prompt
        by prompt (the order reversed at each prompt), so that a slow phase of the
        machine falls on all of them and the ratios to plain hold."""
        engines = {config: self.engine(*config) for config in configs}
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0)
        first = next(iter(self.prompts.values()))[0]
        for engine in engines.values():
            run_one(engine, self.target.tokenizer, first, SamplingParams(max_tokens=2, temperature=0))  # warm-up
        found: dict[tuple[str, int | str], dict[str, Measurement]] = {config: {} for config in configs}
        turn = 0
        for suite, prompts in self.prompts.items():
            for ids in prompts:
                print(
                    f"tune: {suite} prompt {turn + 1}, {len(configs)} configurations ...", file=sys.stderr, flush=True
                )
                for config in configs if turn % 2 == 0 else configs[::-1]:
                    engine, total = engines[config], found[config].setdefault(suite, Measurement())
                    spec_before = engine.spec_stats.copy()
                    result = run_one(engine, self.target.tokenizer, ids, params)
                    total.output_tokens += result["num_output_tokens"]
                    total.decode_tokens += result["num_output_tokens"] - 1
                    total.decode_s += result["e2e_s"] - result["ttft_s"]
                    total.e2e_s += result["e2e_s"]
                    total.spec = total.spec + (engine.spec_stats - spec_before)
                turn += 1
        return found

    def cost_ratios(self) -> dict[str, float]:
        """Draft decode step / target decode step, per draft model (measured), per head
        (its weight bytes per position against the target's: `prior_cost_ratio`); an
        lookup costs ~0."""
        ids = next(iter(self.prompts.values()))[0]
        target_s = decode_step_seconds(self.target, ids, 32)
        ratios = {}
        for name, draft in self.drafts.items():
            if name in self.heads:
                ratios[name] = prior_cost_ratio(self.loaded_heads[name], self.target.decoder)
            else:
                ratios[name] = 0.0 if draft is None else decode_step_seconds(draft, ids, 32) / target_s
        return ratios

    def _bytes_per_position(self, name: str) -> int:
        """Weight bytes one draft position reads."""
        if name in self.heads:
            return self.loaded_heads[name].bytes_per_position()
        draft = self.drafts[name]
        return 0 if draft is None else draft_bytes_per_position(draft.decoder)

    def ceilings(self) -> dict[str, dict[str, float]] | None:
        """Per draft: the most any k could gain with every guess accepted, on this
        machine (`roofline.ceiling`); None off the CPU, without our kernels or
        for a target format whose arithmetic is not measured (bfloat16)."""
        peaks = measure_dot_peaks(self.target.decoder.device)
        if peaks is None or self.arithmetic is None:
            return None
        bandwidth, _ = measure_read_bandwidth()
        target = self.target.decoder
        target_bytes = weight_bytes_per_token(target)
        target_macs = multiply_adds_per_token(target.config, target.head_size)
        return {
            name: ceiling(
                target_bytes,
                target_macs,
                self._bytes_per_position(name),
                bandwidth,
                peaks[0][self.arithmetic],
            )
            for name in self.drafts
        }

    def full_acceptance(self) -> dict[str, dict[str, Any]]:
        """Per draft model and head: each k's speed were every draft accepted, from the
        engine's own steps with the draft always drafting k
        (`specserve.bench.measured_ceiling`): the bound the serving code reaches on this
        machine at any acceptance. The lookups are left out: they draft nothing where
        they find no match."""
        ids = next(iter(self.prompts.values()))[0]
        found = {}
        for name, draft in self.drafts.items():
            most = self.most_k(name)
            tokens = max(self.max_tokens, 4 * (most + 1) + 2)  # a few whole steps of the longest draft
            if name in self.heads:
                proposer, _ = self._head_proposer(name, most, always=True)
            elif draft is not None:
                proposer = draft_proposer(measured_ceiling.always_drafting(name, most), draft.decoder, self.target)
            else:
                continue
            engine = Engine(self.target.decoder, self.target.tokenizer.eos_token_ids, proposer, most)
            rows = measured_ceiling.measure(engine, ids, self.ks_of(name), FULL_ACCEPTANCE_ROUNDS, tokens)
            top = measured_ceiling.best(rows)
            found[name] = {
                "max_speedup": top["full_acceptance_speedup"],
                "best_k": top["k"],
                "plain_step_s": rows[0]["step_s"],
                "step_s": top["step_s"],
                "rows": rows,
            }
        return found

    def run(self) -> list[dict[str, Any]]:
        ratios = self.cost_ratios()
        configs = [(PLAIN, 0)] + [(name, k) for name in self.drafts for k in self.ks_of(name)]
        configs += [(name, ADAPTIVE) for name in self.drafts]
        rows = []
        found = self.measure(configs)
        plain = found[PLAIN, 0]
        for name, k in configs:
            for suite, m in found[name, k].items():
                speedup = m.decode_tokens_per_s / plain[suite].decode_tokens_per_s
                rows.append(
                    {
                        "test_case": suite,
                        "proposer": name,
                        "k": k,
                        "acceptance_rate": m.spec.acceptance_rate,
                        "mean_acceptance_length": m.spec.mean_acceptance_length,
                        "inter_token_latency_s": 1 / m.decode_tokens_per_s if m.decode_tokens_per_s else None,
                        "output_tokens_per_s": m.output_tokens / m.e2e_s,
                        "decode_tokens_per_s": m.decode_tokens_per_s,
                        "speedup": speedup,
                        # The formula assumes the same k every step; adaptive varies it.
                        "predicted_speedup": None
                        if k == ADAPTIVE
                        else predicted_speedup(m.spec.acceptance_rate, m.mean_draft_length, ratios.get(name, 0.0)),
                        "mean_draft_length": m.mean_draft_length,
                        "cost_ratio": ratios.get(name),
                    }
                )
        return rows


def recommend(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The fastest configuration per test case, and overall by the geometric mean of speedups."""
    best = {}
    for suite in dict.fromkeys(r["test_case"] for r in rows):
        best[suite] = max((r for r in rows if r["test_case"] == suite), key=lambda r: r["speedup"])
    configs = dict.fromkeys((r["proposer"], r["k"]) for r in rows)
    overall = max(
        configs, key=lambda c: statistics.geometric_mean(r["speedup"] for r in rows if (r["proposer"], r["k"]) == c)
    )
    best["overall"] = {
        "proposer": overall[0],
        "k": overall[1],
        "speedup": statistics.geometric_mean(r["speedup"] for r in rows if (r["proposer"], r["k"]) == overall),
    }
    return best


def to_markdown(
    rows: list[dict[str, Any]],
    best: dict[str, dict[str, Any]],
    header: str,
    ceilings: dict[str, dict[str, float]] | None = None,
    measured: dict[str, dict[str, Any]] | None = None,
) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    lines = [
        header,
        "",
        "| test case | proposer | k | drafted/step | acceptance | mean acc. len | ITL (ms) | output tok/s "
        "| speedup | predicted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['test_case']} | {r['proposer']} | {r['k']} | {fmt(r['mean_draft_length'] or None, '.2f')} "
            f"| {fmt(r['acceptance_rate'], '.1%')} "
            f"| {fmt(r['mean_acceptance_length'], '.2f')} "
            f"| {fmt(r['inter_token_latency_s'] and r['inter_token_latency_s'] * 1000, '.0f')} "
            f"| {fmt(r['output_tokens_per_s'], '.2f')} | {fmt(r['speedup'], '.2f')}x "
            f"| {fmt(r['predicted_speedup'], '.2f')}"
            f"{'' if r['predicted_speedup'] is None else 'x'} |"
        )
    lines += ["", "Recommended:"]
    for suite, r in best.items():
        k = "adaptive k" if r["k"] == ADAPTIVE else f"k={r['k']}"
        config = PLAIN if r["proposer"] == PLAIN else f"{r['proposer']}, {k}"
        lines.append(f"- {suite}: {config} ({r['speedup']:.2f}x the plain target's decode)")
    if ceilings:
        lines += [
            "",
            "Ceiling on this machine (every guess accepted; a plain step and a draft position at the "
            "memory limit, a verified row at the arithmetic peak):",
        ]
        for name, c in ceilings.items():
            lines.append(
                f"- {name}: at most {c['max_speedup']:.2f}x (k={c['best_k']}; plain step "
                f"{c['plain_step_s'] * 1e3:.1f} ms, verified row {c['verified_row_s'] * 1e3:.1f} ms, "
                f"draft position {c['draft_position_s'] * 1e3:.1f} ms)"
            )
    if measured:
        lines += [
            "",
            "Measured with every draft accepted (the draft always drafting k; "
            "benchmarks/full_acceptance.py gives every k):",
        ]
        for name, m in measured.items():
            lines.append(
                f"- {name}: at most {m['max_speedup']:.2f}x (k={m['best_k']}; plain step "
                f"{m['plain_step_s'] * 1e3:.1f} ms, that step {m['step_s'] * 1e3:.1f} ms)"
            )
    return "\n".join(lines) + "\n"
