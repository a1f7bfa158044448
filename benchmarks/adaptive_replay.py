"""Adaptive speculation replayed on recorded text: its policy judged without timing noise.

On a shared 2-core machine one decode run moves by 10-20% from minute to minute, more
than the few percent that separate adaptive k from fixed k or from plain decoding on
open-ended text. So the policy is judged here on a replay: `--record` runs the real
pair once per suite prompt and keeps, for every output position, whether the draft's
greedy guess (given the target's own prefix) equals the target's token and how sure
the draft was of it, together with the step costs fitted on the spot (target forward
per verified row, draft per position, reading per token). The replay then drives
`AdaptiveSpecLength` itself, step by step, through the same decisions the engine makes
(k from the policy, drafts cut where the draft is unsure, acceptance up to the first
miss, the draft's backlog after plain steps), charging each step the recorded costs.
Identical inputs give identical figures, so a change to the policy shows as it is.

A guess drafted after a wrong one is judged as if its prefix were right (the draft's
confidence there is not known); those guesses are rejected either way, only where
the draft stops may differ.

    .venv/bin/python benchmarks/adaptive_replay.py --record   # about a minute, int4 pair
    .venv/bin/python benchmarks/adaptive_replay.py            # the table, in a second
    .venv/bin/python benchmarks/adaptive_replay.py --draft-cost-scale 2   # a dearer draft
    .venv/bin/python benchmarks/adaptive_replay.py --score   # every trace set and scale: one figure
    .venv/bin/python benchmarks/adaptive_replay.py --costs benchmarks/data/costs_h200.json   # priced there

The recorded traces live in benchmarks/data/adaptive_traces*.json (also read by
tests/benchmarks/test_adaptive_replay.py; benchmarks/README.md lists them). A trace set may keep
the target's forward time for each row count (`Costs.target_by_rows`), which the replay
charges instead of the line: on our CPU kernels 9-16 rows cost a second pass. `--record`
measures those times itself (`forward_seconds`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.config import SpecConfig
from specserve.spec.adaptive import MAX_CATCH_UP, AdaptiveSpecLength

TRACES = Path(__file__).parent / "data" / "adaptive_traces.json"
FIXED_KS = (1, 2, 3, 5, 7, 11, 15)


@dataclass(frozen=True)
class Costs:
    """Seconds, as `AdaptiveSpecLength`'s fits model them."""

    target_fixed: float
    target_per_row: float
    draft_fixed: float
    draft_per_position: float
    read_per_token: float
    # Seconds of a target forward by its row count ("1", "2", ...: JSON's keys), as
    # `forward_seconds` measures them (the older zen5_tiles set keeps the policy's own
    # estimates). On our CPU kernels 9-16 rows cost a second pass of arithmetic, which
    # the line above misses. None: the line.
    target_by_rows: dict[str, float] | None = None

    def forward(self, rows: int) -> float:
        """Seconds of a target forward of `rows` rows."""
        if self.target_by_rows is not None and str(rows) in self.target_by_rows:
            return self.target_by_rows[str(rows)]
        return self.target_fixed + self.target_per_row * rows

    def plain_step(self) -> float:
        return self.forward(1)

    def with_dearer_draft(self, scale: float) -> Costs:
        """The draft's costs, drafting and reading, times `scale`."""
        return dataclasses.replace(
            self,
            draft_fixed=scale * self.draft_fixed,
            draft_per_position=scale * self.draft_per_position,
            read_per_token=scale * self.read_per_token,
        )


@dataclass(frozen=True)
class Trace:
    """One prompt's greedy output as the target decodes it, and the draft's view of it:
    match[i] whether the draft's guess for output position i (after the target's
    tokens 0..i-1) is the target's token, confidence[i] the draft's probability of its guess."""

    name: str
    suite: str
    prompt_tokens: int
    match: list[bool]
    confidence: list[float]
    max_tokens: int = 256  # the request's: every trace so far was recorded with 256
    # A head's trace (`head_chains`): chain[i] how many guesses of the chain drafted at
    # output position i (guessing i, i + 1, ...) the target's tokens match in a row,
    # chain_confidence[i] the head's probability of each of that chain's guesses. A head
    # guesses deeper positions from its own features, not the target's, so a draft
    # model's per-position view (match) would overrate them. None: a draft model's trace.
    chain: list[int] | None = None
    chain_confidence: list[list[float]] | None = None

    def drafted_and_accepted(
        self, position: int, want: int, threshold: float, least_chance: float = 0.0
    ) -> tuple[int, int, int]:
        """A draft of up to `want` tokens at output `position` (a head's, at most its
        recorded depth: a Medusa checkpoint's heads): how many are drafted (a guess less
        sure than `threshold` is the last), accepted, and dropped (1 where the first
        guess is less sure than `least_chance`, as DraftChains drops it)."""
        n, drafted = len(self.match), 0
        if position < n and self.confidence[position] < least_chance:
            return 0, 0, 1
        if self.chain_confidence is not None:
            want = min(want, len(self.chain_confidence[0]))
        while drafted < want:
            drafted += 1
            # Past the answer's end the draft goes on guessing (it has no end to guess)
            if position >= n:
                continue
            if self.chain_confidence is None:
                sure = self.confidence[position + drafted - 1] >= threshold if position + drafted - 1 < n else True
            else:
                sure = self.chain_confidence[position][drafted - 1] >= threshold
            if not sure:
                break
        if self.chain is not None:
            return drafted, min(drafted, self.chain[position]) if position < n else 0, 0
        accepted = 0
        while accepted < drafted and position + accepted < n and self.match[position + accepted]:
            accepted += 1
        return drafted, accepted, 0


@dataclass
class Outcome:
    tokens: int
    seconds: float
    drafts: int
    drafted: int
    accepted: int


def new_policy(costs: Costs, max_k: int = 15) -> AdaptiveSpecLength:
    """Adaptive k with the engine's prior: a draft position costs its share of a plain step
    (`prior_cost_ratio` gives the weight-bytes ratio; the recorded ratio stands in)."""
    return AdaptiveSpecLength(max_k, costs.draft_per_position / costs.plain_step())


def replay(
    trace: Trace,
    costs: Costs,
    k: int | None,
    adaptive: AdaptiveSpecLength | None = None,
    seq_id: int = 0,
    threshold: float = SpecConfig.draft_confidence_threshold,
) -> Outcome:
    """Decode the trace once: fixed `k`, or adaptive (k None) with `adaptive`, a new
    policy when None (what a fresh engine knows) or one that has served other requests."""
    if k is not None:
        adaptive = None
    elif adaptive is None:
        adaptive = new_policy(costs)
    n = len(trace.match)
    emitted, seconds = 1, 0.0  # the prefill's token; prefill is not charged (the same for all)
    drafts = drafted_total = accepted_total = 0
    unread = trace.prompt_tokens + 1  # tokens the draft has not read, ending with the newest
    while emitted < n:
        # As the engine knows it: the tokens max_tokens leaves, not where the answer ends
        # (a short answer's first probe is priced against 255 tokens to come, not 50).
        remaining = trace.max_tokens - emitted
        want = adaptive.choose([seq_id], [unread], [remaining])[0] if adaptive else k
        want = max(0, min(want, remaining - 1))
        drafted = accepted = dropped = 0
        if want:
            least = adaptive.least_chances(1, 1 + want, [seq_id])[0] if adaptive else 0.0  # as the engine asks
            drafted, accepted, dropped = trace.drafted_and_accepted(emitted, want, threshold, least)
            drafting = costs.draft_fixed + costs.draft_per_position * (drafted + dropped)
            # As the engine times it: a call that first reads a backlog is a reading sample.
            reading = costs.read_per_token * unread if unread > MAX_CATCH_UP else 0.0
            if adaptive and reading:
                adaptive.observe_read(unread, drafted, drafting + reading)
            elif adaptive:
                adaptive.observe_draft(drafted + dropped, drafting)
            seconds += drafting + reading
            drafts += 1
            drafted_total += drafted
            accepted_total += accepted
        forward = costs.forward(drafted + 1)
        seconds += forward
        if adaptive:
            adaptive.observe_target(drafted + 1, forward)
            adaptive.record(seq_id, drafted, accepted, dropped)
            if drafted and emitted < n:
                adaptive.observe_first_guess(seq_id, trace.confidence[emitted], accepted > 0)
        step_tokens = min(accepted + 1, n - emitted)
        emitted += step_tokens
        # The draft's cache keeps what it read and the accepted guesses it fed; it has
        # yet to read the target's correction, or the last guess and the bonus token
        # (after a dropped first guess, the step's one token).
        if drafted:
            unread = 2 if accepted == drafted else 1
        else:
            unread = 1 if dropped else unread + step_tokens
    if adaptive:
        adaptive.free(seq_id)
    return Outcome(n - 1, seconds, drafts, drafted_total, accepted_total)


def load_traces(path: Path = TRACES) -> tuple[Costs, list[Trace]]:
    data = json.loads(path.read_text())
    return Costs(**data["costs"]), [Trace(**t) for t in data["traces"]]


def machine_costs(path: Path, traces: Path) -> Costs:
    """Another machine's costs (`--costs`: a JSON object of Costs by proposer kind, "draft",
    "eagle3" or "medusa", and a "source" line) for the proposer `traces` were recorded with."""
    draft = json.loads(traces.read_text())["pair"]["draft"]
    method, colon, _ = draft.partition(":")
    kind = method if colon else "draft"
    table = json.loads(path.read_text())
    if kind not in table:
        sys.exit(f"adaptive_replay: {path} prices no {kind!r} proposer (it has {', '.join(sorted(table))})")
    return Costs(**table[kind])


def speedups(
    traces: list[Trace], costs: Costs, ks: list[int | None], warm: bool = True
) -> dict[str, dict[int | None, float]]:
    """Per prompt, each k's decode speed against plain decoding (tokens after the first).
    Adaptive (k None) serves the prompts one after the other with one policy, as an
    engine does (warm), or each with a new one (what the first request meets)."""
    policy = new_policy(costs)
    table: dict[str, dict[int | None, float]] = {}
    for seq_id, trace in enumerate(traces):
        plain = (len(trace.match) - 1) * costs.plain_step()
        adaptive = policy if warm else None
        table[trace.name] = {k: plain / replay(trace, costs, k, adaptive, seq_id).seconds for k in ks}
    return table


def suite_names(traces: list[Trace]) -> dict[str, list[str]]:
    """Each suite's prompt names, suites in the traces' order."""
    names: dict[str, list[str]] = {}
    for trace in traces:
        names.setdefault(trace.suite, []).append(trace.name)
    return names


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def print_table(traces: list[Trace], costs: Costs) -> None:
    serving = speedups(traces, costs, [*FIXED_KS, None])
    new_engine = speedups(traces, costs, [None], warm=False)
    columns = {f"k={k}": {name: row[k] for name, row in serving.items()} for k in FIXED_KS}
    columns["adaptive"] = {name: row[None] for name, row in serving.items()}
    columns["adaptive, new engine"] = {name: row[None] for name, row in new_engine.items()}
    print(
        f"costs (ms): target {1e3 * costs.target_fixed:.1f} + {1e3 * costs.target_per_row:.1f}/row, "
        f"draft {1e3 * costs.draft_fixed:.1f} + {1e3 * costs.draft_per_position:.1f}/position, "
        f"read {1e3 * costs.read_per_token:.2f}/token"
    )
    if costs.target_by_rows is not None:
        print(
            "target forward by rows (ms): "
            + ", ".join(f"{rows} {1e3 * seconds:.1f}" for rows, seconds in costs.target_by_rows.items())
        )
    print(f"| prompt | suite | tokens | {' | '.join(columns)} |")
    print("|---|---|---:|" + "---:|" * len(columns))
    for trace in traces:
        row = " | ".join(f"{column[trace.name]:.2f}" for column in columns.values())
        print(f"| {trace.name} | {trace.suite} | {len(trace.match)} | {row} |")
    for suite, names in suite_names(traces).items():
        row = " | ".join(f"{geomean([column[n] for n in names]):.2f}" for column in columns.values())
        print(f"| geomean | {suite} | | {row} |")


# Draft costs times these for `score`: from the recorded costs to where drafting loses outright.
SCORE_SCALES = (1.0, 1.5, 2.0, 2.5, 3.0)


@dataclass(frozen=True)
class Cell:
    """Adaptive's speed over the best of plain decoding and every fixed k, for one trace
    set, draft-cost scale, suite, and a serving (warm) or new engine."""

    ratio: float
    traces: str
    scale: float
    suite: str
    warm: bool


def score(paths: list[Path], scales: tuple[float, ...] = SCORE_SCALES) -> tuple[float, list[Cell]]:
    """The policy judged over every trace set and draft-cost scale at once: the geometric
    mean of its cells' ratios (1.0: as good as the best choice made in hindsight), and the
    cells, worst first. A change to the policy that helps one trace set often costs
    another; this is the figure to compare (benchmarks/EXPERIMENTS.md, "Adaptive k")."""
    cells = []
    for path in paths:
        recorded, traces = load_traces(path)
        for scale in scales:
            costs = recorded.with_dearer_draft(scale)
            fixed = speedups(traces, costs, list(FIXED_KS))
            for warm in (True, False):
                adaptive = speedups(traces, costs, [None], warm=warm)
                for suite, names in suite_names(traces).items():
                    best = max([1.0] + [geomean([fixed[n][k] for n in names]) for k in FIXED_KS])
                    ratio = geomean([adaptive[n][None] for n in names]) / best
                    cells.append(
                        Cell(ratio, path.stem.removeprefix("adaptive_traces").lstrip("_") or "zen4", scale, suite, warm)
                    )
    cells.sort(key=lambda cell: cell.ratio)
    return geomean([cell.ratio for cell in cells]), cells


def forward_seconds(decoder, max_rows: int, passes: int = 8, context: int = 100) -> dict[int, float]:
    """Seconds of the target's forward at 1..max_rows rows (attending one at a time, as a
    verification does, after `context` cached tokens): the median of `passes`, the row
    counts taking turns (up, then down), so that a phase of the machine's memory weighs
    on all of them alike. Measured, not the policy's belief: the policy's own estimates
    carry its noise (they have priced 7 rows above 8)."""
    import torch

    from specserve.model.decoder import Segment

    cache = decoder.new_cache()
    ids = torch.arange(context, dtype=torch.int64) % 1000 + 100
    decoder(ids, [Segment(cache, context)], torch.tensor([context - 1]))
    times: dict[int, list[float]] = {rows: [] for rows in range(1, max_rows + 1)}
    for turn in range(passes):
        for rows in range(1, max_rows + 1) if turn % 2 == 0 else range(max_rows, 0, -1):
            started = time.perf_counter()
            decoder(ids[:rows], [Segment(cache, rows, one_query_at_a_time=True)], torch.arange(rows)).argmax(
                -1
            ).tolist()
            times[rows].append(time.perf_counter() - started)
            cache.truncate(context)
    return {rows: statistics.median(seconds) for rows, seconds in times.items()}


def draft_guesses(draft_model, prompt_ids: list[int], output: list[int]) -> dict[str, list]:
    """A draft model's greedy guess for each output token after the target's tokens before
    it: whether it is that token (match), and the draft's probability of it."""
    import torch

    from specserve.model.decoder import Segment

    cache = draft_model.new_cache()
    ids = torch.tensor(prompt_ids + output[:-1], dtype=torch.int64)
    rows = torch.arange(len(prompt_ids) - 1, len(ids))  # the guess for each output token
    probs = draft_model(ids, [Segment(cache, len(ids))], rows).softmax(dim=-1)  # [len(output), V]
    confidence, guess = probs.max(dim=-1)
    return {"match": [g == t for g, t in zip(guess.tolist(), output)], "confidence": confidence.tolist()}


def chain_guesses(proposer, target, prompt_ids: list[int], output: list[int], depth: int) -> tuple[list, list]:
    """The chain a head proposer drafts (greedy, `depth` guesses; a Medusa checkpoint's
    heads at most) at each output position i, after the target's tokens before it, the
    target's features read teacher-forced: (guesses [outputs][depth] as token ids, the
    head's probability of each)."""
    import torch

    from specserve.model.decoder import Segment
    from specserve.spec.medusa import MedusaProposer

    ids = prompt_ids + output
    fed = len(ids) - 1
    capture = proposer.features.new_capture()
    target(torch.tensor(ids[:-1]), [Segment(target.new_cache(), fed)], torch.tensor([fed - 1]), capture=capture)
    features = capture.layer_inputs if capture.layers else capture.final_hidden  # [fed, F]: positions 0..fed-1
    first = len(prompt_ids)  # output i is token first + i, guessed from the feature at first + i - 2
    if isinstance(proposer, MedusaProposer):
        heads = proposer.heads
        scores = heads(features[first - 2 : first - 2 + len(output)], min(depth, heads.config.num_heads))
        probs, rows = scores.softmax(dim=-1).max(dim=-1)  # [heads, outputs]
        return heads.to_target_ids(rows).T.tolist(), probs.T.tolist()
    head = proposer.head
    cache = head.new_cache()
    # Every pair (feature of p, token p + 1) up to the last output's, read once; a chain at
    # output i starts after pair first + i - 2 and feeds its own features and guesses.
    pairs = len(ids) - 2
    read = head(torch.tensor(ids[1:-1]), head.project_target_features(features[:pairs]), [Segment(cache, pairs)])
    guesses, confidences = [], []
    for i in range(len(output)):
        cache.truncate(first + i - 1)
        hidden, chain, sure = read[first + i - 2 : first + i - 1], [], []  # [1, H]
        for _ in range(depth):
            probs = head.draft_logits(hidden).softmax(dim=-1)  # [1, draft_vocab]
            confidence, row = probs.max(dim=-1)
            chain.append(int(head.to_target_ids(row)))
            sure.append(float(confidence))
            hidden = head(torch.tensor(chain[-1:]), hidden, [Segment(cache, 1)])
        guesses.append(chain)
        confidences.append(sure)
        at = first + i - 1  # the chain overwrote this pair, which the next chain reads: read it again
        if at < pairs:
            cache.truncate(at)
            head(
                torch.tensor(ids[at + 1 : at + 2]),
                head.project_target_features(features[at : at + 1]),
                [Segment(cache, 1)],
            )
    return guesses, confidences


def head_chains(proposer, target, prompt_ids: list[int], output: list[int], depth: int) -> dict[str, list]:
    """A head's trace fields (see `Trace`) from `chain_guesses`: its first guess's match
    and probability, each chain's run of matches and its guesses' probabilities."""
    guesses, confidences = chain_guesses(proposer, target, prompt_ids, output, depth)
    chains = []
    for i, chain in enumerate(guesses):
        wanted = output[i : i + len(chain)]
        chains.append(next((d for d, (g, t) in enumerate(zip(chain, wanted)) if g != t), len(wanted)))
    return {
        "match": [chain[0] == token for chain, token in zip(guesses, output)],
        "confidence": [sure[0] for sure in confidences],
        "chain": chains,
        "chain_confidence": [[round(c, 4) for c in sure] for sure in confidences],
    }


RANDOM_HEAD = "random"  # `--head eagle3:random`: a head whose guesses are no better than chance


def write_random_head(method: str, target: str, folder: Path) -> Path:
    """A head of `train-head`'s default shape for `target`, its weights random (seed 0),
    written into `folder`: one whose guesses are right by chance alone, which adaptive k
    must decode plainly beside at little cost."""
    import torch

    from specserve.catalogue import resolve
    from specserve.model.checkpoint import read_config
    from specserve.spec.heads.checkpoint import save_head
    from specserve.spec.heads.eagle import EagleConfig, EagleHead
    from specserve.train.run import TrainHeadSettings

    if method != "eagle3":
        raise SystemExit(f"adaptive_replay: a random head is an EAGLE-3 head (eagle3:{RANDOM_HEAD}), not {method}")
    defaults = TrainHeadSettings(target)
    config = read_config(resolve(target))
    head_config = EagleConfig.for_target(config, 3, defaults.draft_vocab_size)
    layer = dataclasses.replace(head_config.layer, intermediate_size=defaults.head_intermediate_size)
    torch.manual_seed(0)
    head = EagleHead(dataclasses.replace(head_config, layer=layer))
    head.target_ids = torch.arange(defaults.draft_vocab_size)  # [draft_vocab]: the target's first ids
    save_head(head, folder)
    return folder


def record(target: str, draft: str, quantization: str, max_tokens: int, head: str | None = None) -> dict[str, Any]:
    """Run the pair (the target and a draft model, or `head`: METHOD:NAME) on every
    suite prompt: the traces, and the costs fitted on the way."""
    import torch

    from specserve.bench.suites import SUITES
    from specserve.engine.build import build_engine, encode_prompt, run_one
    from specserve.sampling import SamplingParams

    scratch = tempfile.TemporaryDirectory(prefix="random-head-")  # a random head's folder, while it loads
    if head is None:
        spec = SpecConfig.parse({"model": draft, "num_speculative_tokens": 7})
    else:
        method, _, name = head.partition(":")
        if name == RANDOM_HEAD:
            name = str(write_random_head(method, target, Path(scratch.name)))
        depth = {} if method == "medusa" else {"num_speculative_tokens": 7}  # Medusa: its heads
        spec = SpecConfig.parse({"method": method, "model": name, **depth})
    dtype = torch.bfloat16 if quantization != "none" else torch.float32
    engine, tokenizer = build_engine(target, spec, dtype, quantization=quantization)
    scratch.cleanup()
    fits = engine.adaptive
    # Random k (0 included) so the fits see steps of every shape, past 8 rows too.
    rng = random.Random(0)
    ks = [k for k in (0, 1, 2, 3, 5, 7, 11, 15) if k <= fits.max_k]
    fits.choose = lambda seq_ids, *args, **kwargs: [rng.choice(ks) for _ in seq_ids]
    traces = []
    for suite, prompts in SUITES.items():
        for name, text in prompts.items():
            prompt_ids = encode_prompt(tokenizer, chat=text)
            out = run_one(engine, tokenizer, prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0))
            output = out["token_ids"]
            if head is None:
                guesses = draft_guesses(engine.proposer.draft, prompt_ids, output)
            else:
                guesses = head_chains(engine.proposer, engine.target, prompt_ids, output, fits.max_k)
            guesses["confidence"] = [round(c, 4) for c in guesses["confidence"]]
            traces.append(
                {"name": name, "suite": suite, "prompt_tokens": len(prompt_ids), "max_tokens": max_tokens, **guesses}
            )
            print(f"{name}: {len(output)} tokens, draft agrees on {sum(guesses['match'])}", file=sys.stderr)
    forwards = forward_seconds(engine.target, fits.max_k + 1)
    # The line, for row counts past those measured: least squares through the measured ones
    # (the policy prices each count as measured, so it has no line of its own to record).
    per_row, target_fixed = statistics.linear_regression(list(forwards), list(forwards.values()))
    draft_fixed, per_position = fits.draft_costs()
    by_rows = {str(rows): seconds for rows, seconds in forwards.items()}
    costs = Costs(target_fixed, per_row, draft_fixed, per_position, fits.read_costs()[1], by_rows)
    return {
        "pair": {"target": target, "draft": head or draft, "quantization": quantization},
        "costs": costs.__dict__,
        "traces": traces,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="run the pair and rewrite the traces file")
    parser.add_argument("--traces", type=Path, default=TRACES)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument(
        "--head",
        default=None,
        help=f"record a head instead of the draft: METHOD:NAME (eagle3:HEAD; eagle3:{RANDOM_HEAD}: random weights)",
    )
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--draft-cost-scale", type=float, default=1.0, help="replay with the draft's and the reading's costs times this"
    )
    parser.add_argument(
        "--costs",
        type=Path,
        default=None,
        help="replay with another machine's costs (benchmarks/data/costs_*.json) instead of the recorded ones",
    )
    parser.add_argument(
        "--score", action="store_true", help="judge the policy over every recorded trace set and draft-cost scale"
    )
    args = parser.parse_args()
    if args.score:
        total, cells = score(sorted(TRACES.parent.glob("adaptive_traces*.json")))
        print(f"score {total:.4f} over {len(cells)} cells (adaptive over the best of plain and fixed k); worst:")
        for cell in cells[:8]:
            print(
                f"  {cell.ratio:.3f}  {cell.traces} traces, draft x{cell.scale:g}, {cell.suite}, "
                f"{'serving' if cell.warm else 'new engine'}"
            )
        return
    if args.record:
        data = record(args.target, args.draft, args.quantization, args.max_tokens, args.head)
        args.traces.parent.mkdir(parents=True, exist_ok=True)
        args.traces.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    costs, traces = load_traces(args.traces)
    if args.costs is not None:
        costs = machine_costs(args.costs, args.traces)
    print_table(traces, costs.with_dearer_draft(args.draft_cost_scale))


if __name__ == "__main__":
    main()
