"""The static decode step that CUDA graphs capture (model/graphs.py, `--cuda-graphs`).

On a CPU the static step runs eagerly; these tests hold it to Decoder.forward's logits
and the engine's plain tokens, and check the pool's slots come back. Where a CUDA GPU is
present the engine cases run there too, through captured graphs."""

from __future__ import annotations

import copy

import pytest
import torch

from specserve.cli import main
from specserve.engine.build import build_engine
from specserve.engine.engine import Engine
from specserve.errors import ConfigError
from specserve.model import graphs, slot_attention
from specserve.model.decoder import Capture, Decoder, Segment, grouped_attention
from specserve.model.kv_cache import KVCache
from specserve.sampling import SamplingParams
from specserve.spec.adaptive import AdaptiveSpecLength
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.guesses import DraftChains
from specserve.spec.heads.eagle import EagleConfig, EagleHead
from specserve.spec.ngram import NgramProposer
from tests.conftest import DEVICES, tiny_config
from tests.engine.test_engine import EOS, PROMPTS, on, perturbed, random_decoder

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    """Buckets from 8 positions, so the tiny models' sequences cross several."""
    monkeypatch.setattr(graphs, "MIN_BUCKET", 8)


@pytest.mark.parametrize("new_tokens", [(1, 1, 1), (4, 4, 4), (1, 4, 3), (1, 20, 3)])
def test_a_static_step_gives_the_eager_forwards_logits(arch, new_tokens):
    """Three sequences (a batch padded to 4), each feeding 1 token (a decode step), 4
    (verifying 3 drafts), a mix (the rows the others lack pad) or a read of 20 tokens
    among them (32 rows a sequence), after their prompts were read by a static step of
    32 rows, against the eager forward on caches of their own; and nothing but the
    step's rows changes the slots."""
    model = random_decoder(arch, seed=3)
    prompts = [[5, 9, 13, 5, 9, 2, 7], [1, 2, 3], list(range(10, 30))]  # 20 tokens: a read of 32 rows
    new = [[11 + i + j for j in range(n)] for i, n in enumerate(new_tokens)]

    def step(caches: list[KVCache]) -> torch.Tensor:
        segments = [Segment(c, len(p)) for c, p in zip(caches, prompts)]
        model(torch.tensor([t for p in prompts for t in p]), segments, torch.empty(0, dtype=torch.int64))
        return model(
            torch.tensor([t for tokens in new for t in tokens]), [Segment(c, len(t)) for c, t in zip(caches, new)]
        )

    expected = step([model.new_cache() for _ in prompts])
    model.use_cuda_graphs(num_slots=4, capacity=64)
    caches = [model.new_cache() for _ in prompts]
    got = step(caches)  # [sum(new_tokens), V]
    assert [c.slot for c in caches] == [0, 1, 2] and model.static.pool.num_free == 1
    rows = max(new_tokens) if max(new_tokens) <= graphs.MAX_GRAPH_ROWS else 32
    # 3 padded to 4; at most 23 positions: bucket 32; the prompts' read scores no row
    assert set(model.static.steps) == {graphs.StepKey(4, 32, 32, scored=1), graphs.StepKey(4, rows, 32)}
    assert [c.length for c in caches] == [len(p) + n for p, n in zip(prompts, new_tokens)]
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    for cache, prompt, n in zip(caches, prompts, new_tokens):  # nothing written past each sequence's rows
        assert cache.keys[:, :, len(prompt) + n :].abs().sum() == 0


def test_a_read_computes_the_logits_of_the_rows_asked_for_alone(arch):
    """A read (more than MAX_GRAPH_ROWS tokens of a sequence) asked for some rows'
    logits, in any order, computes those alone (StepKey.scored, padded to a power of
    two) and gives the eager forward's; asked for none, it gives none."""
    model = random_decoder(arch, seed=3)
    prompts, new = [[5, 9, 13], [1, 2]], [[7], list(range(10, 30))]  # 1 and 20 tokens: a read of 32 rows
    wanted = [20, 0, 7]  # the read's last row, the decoding row, a row inside the read

    def step(caches: list[KVCache]) -> tuple[torch.Tensor, torch.Tensor]:
        model(torch.tensor([t for p in prompts for t in p]), [Segment(c, len(p)) for c, p in zip(caches, prompts)])
        segments = [Segment(c, len(t)) for c, t in zip(caches, new)]
        flat = torch.tensor([t for tokens in new for t in tokens])
        logits = model(flat, segments, torch.tensor(wanted))  # [3, V]
        for cache in caches:
            cache.truncate(cache.length - 1)
        tail = [Segment(caches[0], 1), Segment(caches[1], 17)]
        none = model(torch.tensor([8] + list(range(40, 57))), tail, torch.empty(0, dtype=torch.int64))
        return logits, none

    expected, _ = step([model.new_cache() for _ in prompts])
    model.use_cuda_graphs(num_slots=2, capacity=64)
    got, none = step([model.new_cache() for _ in prompts])
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert none.shape == (0, model.config.vocab_size)
    assert {key.scored for key in model.static.steps if key.rows == 32} == {4, 1}


def test_reads_of_more_than_max_graph_rows_take_a_power_of_two_while_they_fit(monkeypatch):
    """A sequence reading 17 to MAX_READ_ROWS tokens feeds the next power of two rows,
    within the pool's capacity and MAX_STEP_ROWS for the padded batch; past those the
    forward runs eagerly."""
    model = random_decoder("qwen3", seed=3)
    model.use_cuda_graphs(num_slots=4, capacity=64)
    monkeypatch.setattr(graphs, "MAX_STEP_ROWS", 128)
    caches = [model.new_cache() for _ in range(3)]

    def rows(*tokens: int) -> int | None:
        segments = [Segment(cache, n) for cache, n in zip(caches, tokens)]
        return model.static.step_rows_for(segments) if model.static.handles(segments) else None

    assert [rows(5), rows(16), rows(17), rows(40)] == [5, 16, 32, 64]
    assert rows(65) is None  # 128 rows: past the pool's capacity
    assert [rows(40, 1), rows(40, 1, 1)] == [64, None]  # 3 sequences pad to 4: 256 rows


@pytest.fixture
def triton_device() -> str:
    """Where Triton's kernels run here: the GPU, else the CPU under Triton's interpreter
    (tests/conftest.py turns it on where there is no GPU)."""
    if not slot_attention.available():
        pytest.skip("Triton is not installed")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("positions", [[5, 6, 7, 2], [300, 301, 612, 1]], ids=["one-split", "several-splits"])
def test_slot_attention_reads_each_rows_slot_in_place(triton_device, positions):
    """Each row against its own slot's keys 0 ..= its position, read where they lie in
    one layer of the pool (a strided view), split over 64 positions and combined:
    grouped-query attention's numbers, rows of one sequence included."""
    torch.manual_seed(0)
    slots, layers, kv_heads, capacity, head_dim, heads = 3, 2, 2, 640, 16, 6
    pool_keys, pool_values = (torch.randn(slots + 1, layers, kv_heads, capacity, head_dim) for _ in range(2))
    keys, values = pool_keys[:, 1], pool_values[:, 1]  # [slots + 1, kv_heads, capacity, head_dim]
    row_slots, row_positions = torch.tensor([0, 0, 2, 3]), torch.tensor(positions)
    q = torch.randn(4, heads, head_dim)
    on = [t.to(triton_device) for t in (q, keys, values, row_slots, row_positions)]
    got = slot_attention.slot_attention(*on, bucket=640).cpu()  # [4, heads, hd]
    for row, (slot, position) in enumerate(zip(row_slots, row_positions)):
        seen = slice(0, position + 1)
        expected = grouped_attention(q[row][:, None], keys[slot][:, seen], values[slot][:, seen])[:, 0]
        torch.testing.assert_close(got[row], expected, atol=1e-5, rtol=1e-5)


def test_store_keys_and_values_writes_each_rows_position(triton_device):
    torch.manual_seed(1)
    pool_keys, pool_values = (torch.randn(4, 2, 2, 32, 16, device=triton_device) for _ in range(2))
    keys, values = pool_keys[:, 1], pool_values[:, 1]  # [slots + 1, kv_heads, capacity, head_dim]
    kv = torch.randn(3, 4, 16, device=triton_device)  # keys and values side by side, as the projection gives them
    k, v = kv.split(2, dim=1)  # [3, 2, 16] each: strided views
    row_slots, row_positions = (
        torch.tensor([0, 0, 3], device=triton_device),
        torch.tensor([4, 5, 0], device=triton_device),
    )
    expected_keys, expected_values, other_layer = keys.clone(), values.clone(), pool_keys[:, 0].clone()
    expected_keys[row_slots, :, row_positions], expected_values[row_slots, :, row_positions] = k, v
    slot_attention.store_keys_and_values(k, v, keys, values, row_slots, row_positions)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    assert torch.equal(pool_keys[:, 0], other_layer)  # another layer is not touched


@pytest.mark.parametrize("new_tokens", [(1, 1, 1), (1, 4, 3)])
def test_a_static_step_attending_in_place_gives_the_gathered_steps_logits(triton_device, new_tokens):
    prompts = [[5, 9, 13, 5, 9, 2, 7], [1, 2, 3], list(range(10, 30))]
    new = [[11 + i + j for j in range(n)] for i, n in enumerate(new_tokens)]
    logits = {}
    for in_place in (False, True):
        model = on(random_decoder("qwen2", seed=3), triton_device)
        model.use_cuda_graphs(num_slots=4, capacity=64)
        model.static.in_place = in_place
        caches = [model.new_cache() for _ in prompts]
        prompt_ids = torch.tensor([t for p in prompts for t in p], device=triton_device)
        model(prompt_ids, [Segment(c, len(p)) for c, p in zip(caches, prompts)])
        ids = torch.tensor([t for tokens in new for t in tokens], device=triton_device)
        logits[in_place] = model(ids, [Segment(c, len(t)) for c, t in zip(caches, new)]).cpu()
    torch.testing.assert_close(logits[True], logits[False], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layers, final", [((), True), ((1, 0, 1), False), ((0,), True)])
def test_a_static_step_captures_the_eager_forwards_features(layers, final):
    """The features a head proposer asks the target for (Capture), from a static step:
    the eager forward's, every row in the stream's order, layers in the asked order."""
    model = random_decoder("qwen3", seed=3)
    prompts, new = [[5, 9, 13, 5, 9, 2, 7], [1, 2, 3]], [[11, 12, 13], [14]]

    def step(caches: list[KVCache]) -> Capture:
        model(torch.tensor([t for p in prompts for t in p]), [Segment(c, len(p)) for c, p in zip(caches, prompts)])
        capture = Capture(layers=layers, final=final)
        ids = torch.tensor([t for tokens in new for t in tokens])
        model(ids, [Segment(c, len(t)) for c, t in zip(caches, new)], capture=capture)
        return capture

    expected = step([model.new_cache() for _ in prompts])
    model.use_cuda_graphs(num_slots=2, capacity=64)
    got = step([model.new_cache() for _ in prompts])
    assert graphs.StepKey(2, 3, 16, layers, final) in model.static.steps  # 7 + 3 positions: bucket 16
    for name in ("layer_inputs", "final_hidden"):
        if getattr(expected, name) is None:
            assert getattr(got, name) is None
        else:
            torch.testing.assert_close(getattr(got, name), getattr(expected, name), atol=2e-5, rtol=1e-5)


def test_padding_rows_never_touch_a_sequences_cache():
    model = random_decoder("qwen2", seed=4)
    model.use_cuda_graphs(num_slots=4, capacity=64)
    caches = [model.new_cache() for _ in range(3)]
    model(torch.arange(3), [Segment(c, 1) for c in caches])  # batch 3 padded to 4
    pool = model.static.pool
    assert pool.keys[3].abs().sum() == 0  # the free slot
    assert pool.keys[pool.scratch].abs().sum() > 0  # the padding row wrote here


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_static_step_reads_no_tensor_value_on_the_host(arch):
    """A CUDA graph cannot capture a step that reads a tensor's value on the host
    (`.item()`, a shape that depends on values). On the meta device tensors have no
    values, and the whole static step runs there. (Syncs inside an op's CUDA code, such
    as repeat_interleave's, only a capture on a GPU finds.)"""
    model = Decoder(tiny_config(arch)).eval().to("meta")
    model.use_cuda_graphs(num_slots=2, capacity=64)
    caches = [model.new_cache() for _ in range(2)]
    for cache, length in zip(caches, (5, 9)):
        cache.reserve(length)
        cache.length = length
    logits = model(torch.zeros(6, dtype=torch.int64, device="meta"), [Segment(c, 3) for c in caches])
    assert logits.shape == (6, 96) and list(model.static.steps) == [graphs.StepKey(2, 3, 16)]


def run(
    target, make_proposer, requests, adaptive=False, max_num_seqs=4, **engine_options
) -> tuple[list[list[int]], Engine]:
    engine = Engine(
        target,
        eos_token_ids=[EOS],
        proposer=make_proposer(),
        num_speculative_tokens=3,
        adaptive=AdaptiveSpecLength(5, prior_draft_cost_ratio=0.1) if adaptive else None,
        max_num_seqs=max_num_seqs,
        prefill_chunk_size=8,
        **engine_options,
    )
    seqs = [engine.add_request(prompt, params) for prompt, params in requests]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs], engine


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "proposer_kind,adaptive", [("none", False), ("draft", False), ("draft", True), ("ngram", False)]
)
def test_the_engine_on_static_steps_gives_plain_tokens(device, proposer_kind, adaptive):
    """A batch of greedy requests (ragged prompts read in chunks, drafts verified and rolled
    back, sequences leaving) on static steps gives each request's plain tokens, and every
    slot comes back to the pool."""
    target = on(random_decoder("qwen3", seed=1), device)
    requests = [
        (p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for p, n in zip(PROMPTS, [40, 25, 33, 18])
    ]
    expected = [run(target, lambda: None, [r])[0][0] for r in requests]
    graphed_target, graphed_draft = copy.deepcopy(target), perturbed(target, 0.3, seed=2)
    for model in (graphed_target, graphed_draft):
        model.use_cuda_graphs(num_slots=2, capacity=128)
    make_proposer = {
        "none": lambda: None,
        "draft": lambda: DraftModelProposer(graphed_draft, catch_up_chunk_size=8),
        "ngram": lambda: NgramProposer(1, 3),
    }[proposer_kind]
    outputs, engine = run(graphed_target, make_proposer, requests, adaptive, max_num_seqs=2)
    assert outputs == expected
    assert graphed_target.static.pool.num_free == 2 and graphed_draft.static.pool.num_free == 2
    target_rows = {key.rows for key in graphed_target.static.steps}
    assert 8 in target_rows  # prompt chunks of 8 beside the decoding rows
    if proposer_kind == "none":
        assert 1 in target_rows
    else:
        assert engine.spec_stats.num_draft_tokens > 0
        assert max(target_rows) > 1  # verifications were static steps too
    if proposer_kind == "draft":
        assert {key[:2] for key in graphed_draft.static.steps} & {(1, 1), (1, 2)}  # the first guess's forward
        assert graphed_draft.static.chains  # the positions after it: one static step a chain (TokenChain)


@pytest.mark.parametrize("device", DEVICES)
def test_captured_steps_past_their_budget_are_dropped_and_captured_again(device, caplog, monkeypatch):
    """With room for no captured step but the one running (a budget of 0 bytes), a draft
    model's batch on static steps and chains still gives each request's plain tokens:
    each step and chain is dropped as the next is made, and made again when met again.
    One warning names the fix; every slot comes back."""
    target = on(random_decoder("qwen3", seed=1), device)
    requests = [(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for p, n in zip(PROMPTS, [30, 21])]
    expected = [run(target, lambda: None, [r])[0][0] for r in requests]
    graphed_target, graphed_draft = copy.deepcopy(target), perturbed(target, 0.3, seed=2)
    for model in (graphed_target, graphed_draft):
        model.use_cuda_graphs(num_slots=2, capacity=128, captured_bytes=0)
    made, original_step = [], graphs._Step.__init__
    monkeypatch.setattr(
        graphs._Step, "__init__", lambda self, static, key: (made.append(key), original_step(self, static, key))[1]
    )
    outputs, _ = run(
        graphed_target, lambda: DraftModelProposer(graphed_draft, catch_up_chunk_size=8), requests, max_num_seqs=2
    )
    assert outputs == expected
    for model in (graphed_target, graphed_draft):
        assert len(model.static.captured.entries) == 1 and model.static.captured.dropped > 0
        assert model.static.pool.num_free == 2
    assert len(made) > len(set(made))  # keys met again were captured again
    assert caplog.text.count("the least recently used are dropped") == 2  # once a model
    assert "lower --max-num-seqs or --max-model-len" in caplog.text


def test_captured_steps_are_kept_least_recently_used_first_within_their_bytes():
    """CapturedSteps counts the bytes of each entry's tensors (a step's static inputs:
    here [2, 3] token ids and its [3, 2] index, int64) and drops the least recently
    used past its budget, never the entry just made."""
    model = random_decoder("llama", seed=4)
    model.use_cuda_graphs(num_slots=2, capacity=64)
    step = graphs._Step(model.static, graphs.StepKey(2, 3, 16))
    assert graphs.held_bytes(step) == (2 * 3 + 3 * 2) * 8
    captured = graphs.CapturedSteps(budget=3 * 48)
    entries = {}

    def make(name: str):
        entries[name] = type("Entry", (), {})()
        entries[name].tensor = torch.zeros(12)  # 48 bytes of float32; a view of it counts once
        entries[name].view = [entries[name].tensor[:4], entries[name].tensor]
        return entries[name]

    for name in ("a", "b"):
        captured.get("step", (name,), lambda: make(name))
    assert captured.get("step", ("a",), lambda: make("again")) is entries["a"]  # a is used: b is the oldest
    captured.get("chain", ("c",), lambda: make("c"))
    captured.get("chain", ("d",), lambda: make("d"))  # 4 x 48 bytes: b goes, then none
    assert captured.keys_of("step") == [("a",)] and captured.keys_of("chain") == [("c",), ("d",)]
    assert captured.held == 3 * 48 and captured.dropped == 1 and vars(entries["b"]) == {}
    captured.budget = 0
    captured.get("step", ("e",), lambda: make("e"))
    assert list(captured.entries) == [("step", ("e",))] and captured.held == 48


def test_a_capture_out_of_memory_drops_the_others_and_is_tried_once_more(caplog):
    """Memory taken elsewhere can leave too little for a new capture: every other entry
    is dropped (their memory back) and the capture tried again; a second failure, or a
    first with nothing to drop, is the caller's."""
    captured = graphs.CapturedSteps(budget=None)
    made = {}

    def make(name: str, failures: list[int]):
        if failures[0] > 0:
            failures[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory")
        made[name] = type("Entry", (), {})()
        made[name].tensor = torch.zeros(4)
        return made[name]

    for name in ("a", "b"):
        captured.get("step", (name,), lambda: make(name, [0]))
    once = [1]
    assert captured.get("chain", ("c",), lambda: make("c", once)) is made["c"]
    assert list(captured.entries) == [("chain", ("c",))] and captured.held == 16 and captured.dropped == 2
    assert vars(made["a"]) == {} and vars(made["b"]) == {}
    assert "ran out of GPU memory: the 2 captured before it are dropped" in caplog.text
    twice = [2]
    with pytest.raises(torch.OutOfMemoryError):
        captured.get("step", ("d",), lambda: make("d", twice))  # once more, then the caller's
    assert twice == [0] and not captured.entries
    with pytest.raises(torch.OutOfMemoryError):
        graphs.CapturedSteps(budget=None).get("step", ("e",), lambda: make("e", [1]))  # nothing to drop


@pytest.mark.parametrize("device", DEVICES)
def test_multi_step_decoding_gives_plain_tokens_and_stops_where_they_do(device):
    """num_scheduler_steps = 4 on static steps: greedy requests decode 4 tokens a step
    (TokenChain), and each still gives its plain tokens, ending at its stop token or
    max_tokens mid-chain; a seeded sampling request beside them decodes in the chains
    too, its tokens as alone (its keyed draws); every slot comes back."""
    target = on(random_decoder("qwen3", seed=1), device)
    plain = [run(target, lambda: None, [(p, GREEDY)])[0][0] for p in PROMPTS[:3]]
    stop = plain[0][9]  # a token the first request meets mid-chain
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    requests = [
        (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,))),
        (PROMPTS[1], SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)),
        (PROMPTS[3], sampled),
    ]
    alone = run(target, lambda: None, [requests[3]])[0][0]
    graphed = copy.deepcopy(target)
    graphed.use_cuda_graphs(num_slots=4, capacity=128)
    outputs, engine = run(graphed, lambda: None, requests, num_scheduler_steps=4)
    assert outputs[0] == plain[0][: plain[0].index(stop) + 1]
    assert outputs[1:3] == [plain[1][:13], plain[2][:21]]
    assert outputs[3] == alone
    assert {(key.positions, key.keyed) for key in graphed.static.chains} == {(4, True), (4, False)}
    assert graphed.static.pool.num_free == 4
    _, engine = run(graphed, lambda: None, requests[:1], num_scheduler_steps=1)
    assert {key.positions for key in graphed.static.chains} == {4}  # 1: no chain was asked for


@pytest.mark.parametrize("device", DEVICES)
def test_a_request_sampling_by_temperature_keeps_its_batch_in_chains(device):
    """An unseeded request sampling at a temperature decodes in the chains beside greedy
    requests (its tokens drawn on the device), so the greedy ones keep multi-step
    decoding and their plain tokens; it gets its max_tokens, and every slot comes back."""
    target = on(random_decoder("qwen3", seed=1), device)
    plain = [run(target, lambda: None, [(p, GREEDY)])[0][0] for p in PROMPTS[:3]]
    requests = [(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for p in PROMPTS[:3]]
    requests.append((PROMPTS[3], SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True)))
    graphed = copy.deepcopy(target)
    graphed.use_cuda_graphs(num_slots=4, capacity=128)
    outputs, _ = run(graphed, lambda: None, requests, num_scheduler_steps=4)
    assert outputs[:3] == plain and len(outputs[3]) == 30
    assert {(key.positions, key.sampled) for key in graphed.static.chains} == {(4, 1), (4, 0)}  # its row alone
    assert graphed.static.pool.num_free == 4


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_requests_in_chains_keep_plain_samplings_tokens(device):
    """Seeded requests sampling with top-k and top-p decode in keyed chains after an
    unseeded one that cuts nothing, each with the tokens plain sampling gives it alone:
    only their rows are cut (three, the first repeated to pad them to four)."""
    target = on(random_decoder("qwen3", seed=1), device)
    seeded = [
        SamplingParams(max_tokens=30, temperature=0.7, top_p=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=1.2, top_k=5, seed=2**63, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, top_k=3, top_p=0.5, seed=5, ignore_eos=True),
    ]
    alone = [run(target, lambda: None, [(PROMPTS[i], params)])[0][0] for i, params in enumerate(seeded)]
    requests = [(PROMPTS[3], SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)), *zip(PROMPTS, seeded)]
    graphed = copy.deepcopy(target)
    graphed.use_cuda_graphs(num_slots=4, capacity=128)
    outputs, _ = run(graphed, lambda: None, requests, num_scheduler_steps=4)
    assert outputs[1:] == alone and len(outputs[0]) == 30
    assert any(key.keyed and key.filtered == 4 for key in graphed.static.chains)


@pytest.mark.parametrize("device", DEVICES)
def test_requests_asking_for_logprobs_decode_in_chains_with_the_step_by_step_figures(device):
    """Requests asking for logprobs (greedy with 5 alternatives, seeded sampling with 0)
    decode in chains after one that asks for none: each gets the tokens and logprobs it
    gets step by step, one per token, computed on the asking rows alone; the target's
    chains compute no confidences."""
    target = on(random_decoder("qwen3", seed=1), device)
    requests = [
        (PROMPTS[2], GREEDY),
        (PROMPTS[0], SamplingParams(max_tokens=14, temperature=0.0, logprobs=5, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(max_tokens=11, temperature=0.9, seed=3, logprobs=0, ignore_eos=True)),
    ]
    step_by_step = Engine(target, eos_token_ids=[EOS])
    expected = [step_by_step.generate(prompt, params) for prompt, params in requests]
    graphed = copy.deepcopy(target)
    graphed.use_cuda_graphs(num_slots=4, capacity=128)
    engine = Engine(graphed, eos_token_ids=[EOS], num_scheduler_steps=4)
    seqs = [engine.add_request(prompt, params) for prompt, params in requests]
    while engine.has_unfinished():
        engine.step()
    assert {key.logprobs for key in graphed.static.chains} == {2, 1, 0}  # as the asking ones finish
    assert not any(key.confidences for key in graphed.static.chains)
    for seq, alone in zip(seqs, expected):
        assert seq.output_ids == alone.output_ids and len(seq.logprobs) == len(alone.logprobs)
        for got, want in zip(seq.logprobs, alone.logprobs):
            assert got.token_id == want.token_id and [i for i, _ in got.top] == [i for i, _ in want.top]
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_penalised_requests_and_min_tokens_decode_in_chains_with_the_step_by_step_tokens(device):
    """Requests with penalties (greedy, and seeded sampling), with a logit bias, and two
    whose stop token min_tokens holds off, decode in chains after a plain one, each with
    the tokens it gets step by step (penalties.processed_logits on its rows alone,
    ChainKey.processed: as they finish, the chains pad them with the plain row)."""
    target = on(random_decoder("qwen3", seed=1), device)
    step_by_step = Engine(target, eos_token_ids=[EOS])
    plain = step_by_step.generate(PROMPTS[2], GREEDY).output_ids
    a, b = [i for i in range(10, len(plain)) if plain[i] not in plain[:i]][:2]  # met in chains
    requests = [
        (PROMPTS[3], GREEDY),
        (PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5)),
        (PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.9, presence_penalty=0.8, seed=4, ignore_eos=True)),
        # Its stop token, first met at a, allowed from there: it ends there.
        (PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.0, min_tokens=a, stop_token_ids=(plain[a],))),
        # Its stop token, first met at b, held off there.
        (PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.0, min_tokens=b + 1, stop_token_ids=(plain[b],))),
        # Its plain text's token at a banned and another lifted; and a seeded draw biased.
        (PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.0, logit_bias=((plain[a], -100.0), (7, 2.0)))),
        (PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.9, seed=5, logit_bias=((3, 4.0),), ignore_eos=True)),
        # Its plain text's token at a not allowed; and a seeded draw among a few ids.
        (PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.0, allowed_token_ids=set(plain) - {plain[a]})),
        (PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.9, seed=6, allowed_token_ids=(3, 5, 7, 11))),
    ]
    expected = [step_by_step.generate(prompt, params).output_ids for prompt, params in requests]
    assert expected[7][:a] == plain[:a] and plain[a] not in expected[7] and set(expected[8]) <= {3, 5, 7, 11}
    assert expected[5][:a] == plain[:a] and plain[a] not in expected[5]
    assert expected[3] == plain[: a + 1] and expected[4][:b] == plain[:b] and expected[4][b] != plain[b]
    graphed = copy.deepcopy(target)
    graphed.use_cuda_graphs(num_slots=9, capacity=128)
    outputs, _ = run(graphed, lambda: None, requests, max_num_seqs=9, num_scheduler_steps=4)
    assert outputs == expected
    assert {key.processed for key in graphed.static.chains if key.distinct} >= {8}
    assert 2 in {key.biases for key in graphed.static.chains}
    assert any(key.allowed for key in graphed.static.chains)  # the allowed ids went into the chains


# Beside a greedy request, every kind a proposer's chains take: penalised and biased
# greedy with min_tokens, seeded sampling cut by top-p and min-p, seeded sampling with a
# penalty and a bias, and seeded sampling among a third of the ids.
MIXED = [
    GREEDY,
    SamplingParams(
        max_tokens=30, temperature=0.0, repetition_penalty=1.4, min_tokens=20, logit_bias={5: 3.0}, ignore_eos=True
    ),
    SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, min_p=0.05, seed=7, ignore_eos=True),
    SamplingParams(
        max_tokens=30, temperature=1.1, presence_penalty=0.7, seed=2**40, logit_bias={9: -100, 4: 2}, ignore_eos=True
    ),
    SamplingParams(max_tokens=30, temperature=0.9, seed=3, allowed_token_ids=range(0, 96, 3), ignore_eos=True),
]


def drafts_of(proposer) -> list[list[list[int]]]:
    """Every `propose` call's drafts from now on, each sequence's tokens."""
    calls, propose = [], proposer.propose
    proposer.propose = lambda seqs, ks, least=None: calls.append(r := propose(seqs, ks, least)) or r
    return calls


def chained_and_stepped(monkeypatch, target: Decoder, draft: Decoder, requests: list) -> tuple[list, set, Engine]:
    """Graphed copies of target and draft serve `requests` twice, the draft's positions
    after each first guess in chains (TokenChain) and then one static step a position;
    each output is plain decoding's alone both times, and so is every draft. Returns the
    chained run's drafts (each `propose` call's, every sequence's tokens), its draft's
    chain keys and its engine."""
    alone = [Engine(target, eos_token_ids=[EOS]).generate(prompt, params).output_ids for prompt, params in requests]
    runs = {}
    for chained in (True, False):
        graphed, graphed_draft = copy.deepcopy(target), copy.deepcopy(draft)
        for model in (graphed, graphed_draft):
            model.use_cuda_graphs(num_slots=4, capacity=128)
        if not chained:
            monkeypatch.setattr(DraftChains, "draft_on_the_device", lambda *args, **kwargs: None)
        proposer = DraftModelProposer(graphed_draft)
        calls = drafts_of(proposer)
        outputs, engine = run(graphed, lambda: proposer, requests)
        assert outputs == alone
        runs[chained] = [[d.tokens.tolist() for d in call] for call in calls], set(graphed_draft.static.chains), engine
    assert runs[True][0] == runs[False][0] and not runs[False][1]
    return runs[True]


def test_a_draft_models_chains_guess_for_every_kind_of_request_as_its_steps_do(monkeypatch):
    """A graphed draft model drafts the positions after each first guess in one static
    step (TokenChain) for greedy, penalised and seeded sampling requests alike: every
    guess is the one its static steps position by position give (`Guesser.guess`), and
    each output stays the one plain decoding gives it alone."""
    target = random_decoder("qwen3", seed=1)
    _, keys, engine = chained_and_stepped(
        monkeypatch, target, perturbed(target, 0.3, seed=2), list(zip(PROMPTS * 2, MIXED))
    )
    assert 0 < engine.spec_stats.num_accepted_tokens < engine.spec_stats.num_draft_tokens
    assert any(key.sampled and key.keyed and key.vocab and key.distinct and key.biases for key in keys)
    assert any(key.allowed for key in keys)


def test_a_proposers_chain_hands_each_sampled_sequence_the_distributions_it_drew_from():
    """Behind a greedy sequence, seeded and unseeded ones sampling at different
    temperatures (one cut by top-p) draft in one chain: each one's distributions
    (Chained.probs, by its index) are those its guesses were drawn from, so each guess's
    confidence is its probability there, and a seeded guess is the keyed draw from it;
    the one cut by top-p alone leaves ids out."""
    from specserve.sampling import inverse_cdf, keyed_uniform, seed_key

    model = random_decoder("llama", seed=5)
    model.use_cuda_graphs(num_slots=4, capacity=64)
    caches = [model.new_cache() for _ in range(4)]
    model(torch.tensor([t for p in PROMPTS for t in p]), [Segment(c, len(p)) for c, p in zip(caches, PROMPTS)])
    params = [
        GREEDY,
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=1.0, top_p=0.8, seed=2**40),
    ]
    draw_from = [len(p) + 1 for p in PROMPTS]
    vocab = model.config.vocab_size
    chained = model.static.token_chain(
        [1, 2, 3, 4], None, caches, 3, params=params, texts=[None] * 4, vocab=vocab, draw_from=draw_from
    )
    assert sorted(chained.probs) == [1, 2, 3]
    for i, q in enumerate(params[1:], start=1):
        for j, (token, confidence) in enumerate(zip(chained.tokens[i], chained.confidences[i])):
            drawn_from = chained.probs[i][j]  # [V]
            assert drawn_from[token].item() == pytest.approx(confidence)
            assert bool((drawn_from == 0).any()) == (q.top_p < 1)
            if q.seed is not None:
                uniform = torch.tensor([keyed_uniform(seed_key(q.seed), draw_from[i] + j)])
                assert inverse_cdf(drawn_from.cumsum(0)[None], uniform).item() == token


def repeating(model: Decoder) -> Decoder:
    """A draft whose layers add nothing and whose head is its embedding table: each
    position's guess is the token fed there, unless a penalty forbids it."""
    repeater = copy.deepcopy(model)
    with torch.no_grad():
        for block in repeater.layers:
            block.self_attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
        repeater.lm_head.weight.copy_(repeater.embed_tokens.weight)
    return repeater


def test_a_penalised_chain_counts_the_guesses_before_it(monkeypatch):
    """A draft that repeats each token it is fed, for a request whose repetition penalty
    forbids every token of its text: each guess, in the chain as step by step, counts the
    guesses before it, so no guess repeats one."""
    target = random_decoder("qwen3", seed=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=50.0, ignore_eos=True)
    drafts, _, _ = chained_and_stepped(monkeypatch, target, repeating(target), [([7], params)])
    drafts = [call[0] for call in drafts]
    assert all(len(set(tokens)) == len(tokens) for tokens in drafts)
    assert sum(len(tokens) == 3 for tokens in drafts) > 3  # chains of two positions after the first guess


@pytest.mark.parametrize("keyed", [True, False], ids=["seeded", "unseeded"])
def test_a_draft_models_chains_of_sampled_guesses_keep_the_targets_distribution(keyed):
    """Sampling requests drafted by a graphed draft model, every position after the
    first guess drawn in its chain (an unseeded one's from the device's generator, its
    distribution handed to rejection sampling): the 4-token outputs are distributed as
    the target's own sampling (chi-square over all 4^4)."""
    from tests.chi_square import chi_square_p_value, seeded_outputs, target_continuation_probs

    vocab, prompt = 4, [0, 1, 2]
    torch.manual_seed(3)
    target = Decoder(tiny_config("llama", vocab_size=vocab)).eval()
    draft = perturbed(target, 1.5, seed=4)
    draft.use_cuda_graphs(num_slots=8, capacity=16)
    params = dict(max_tokens=4, temperature=0.6, top_p=0.95, ignore_eos=True)  # far from 1, so that it counts
    expected = target_continuation_probs(target, prompt, SamplingParams(**params))
    engine = Engine(target, eos_token_ids=[EOS % vocab], proposer=DraftModelProposer(draft), num_speculative_tokens=3)
    torch.manual_seed(0)  # the chains' draws: the device's generator
    samples = seeded_outputs(engine, prompt, params, batches=5, keyed=keyed)
    assert 0.2 < engine.spec_stats.acceptance_rate < 0.95
    assert {(key.keyed, key.draft_probs) for key in draft.static.chains} == {(keyed, not keyed)}
    assert chi_square_p_value(samples, expected) > 1e-4


@pytest.mark.parametrize(
    "fields", [dict(temperature=0.5), dict(temperature=0.9, top_p=0.7), dict(temperature=1.4, top_k=2, top_p=0.95)]
)
def test_chains_sample_the_targets_distribution(fields):
    """Unseeded requests sampling (a temperature far from 1, so that it counts; top-k and
    top-p), decoded in multi-step chains after their first token: their 4-token outputs
    are distributed as the target's own sampling (chi-square over all 4^4 continuations)."""
    from tests.chi_square import chi_square_p_value, target_continuation_probs

    vocab, prompt = 4, [0, 1, 2]
    torch.manual_seed(3)
    target = Decoder(tiny_config("llama", vocab_size=vocab)).eval()
    params = SamplingParams(max_tokens=4, ignore_eos=True, **fields)
    expected = target_continuation_probs(target, prompt, params)
    graphed = copy.deepcopy(target)
    graphed.use_cuda_graphs(num_slots=64, capacity=64)
    engine = Engine(graphed, eos_token_ids=[EOS % vocab], max_num_seqs=64, num_scheduler_steps=4)
    torch.manual_seed(0)  # the chains' draws: the device's generator
    samples = []
    for batch in range(60):
        seqs = [engine.add_request(prompt, params) for _ in range(100)]
        for i, seq in enumerate(seqs):
            seq.generator.manual_seed(batch * 1000 + i)  # the first token's draw: the request's stream
        while engine.has_unfinished():
            engine.step()
        samples += [s.output_ids for s in seqs]
    assert {(bool(key.sampled), bool(key.filtered)) for key in graphed.static.chains} == {(True, len(fields) > 1)}
    assert chi_square_p_value(torch.tensor(samples), expected) > 1e-4


@pytest.mark.parametrize("proposer_kind", ["draft", "ngram"])
def test_adaptive_k_that_drafts_nothing_decodes_in_chains_and_keeps_the_output(proposer_kind):
    """Where adaptive k finds drafting does not pay (a draft that is always wrong, n-gram
    on text that never repeats), its plain steps decode in multi-step chains: the target's
    chains run, their price is what adaptive k weighs drafting against, and the output is
    plain decoding's. A graphed draft reads what it has not seen (a 30-token prompt, a
    backlog after plain steps) in static steps of up to MAX_READ_ROWS rows, and gives its
    slots back."""
    target = random_decoder("qwen3", seed=1)
    requests = [(PROMPTS[i], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for i in (0, 3)]
    expected = [run(target, lambda: None, [r])[0][0] for r in requests]
    graphed, wrong_draft = copy.deepcopy(target), perturbed(target, 5.0, seed=2)
    for model in (graphed, wrong_draft):
        model.use_cuda_graphs(num_slots=2, capacity=128)
    make_proposer = {
        "draft": lambda: DraftModelProposer(wrong_draft),
        "ngram": lambda: NgramProposer(3, 3),
    }[proposer_kind]
    outputs, engine = run(graphed, make_proposer, requests, adaptive=True, max_num_seqs=2, num_scheduler_steps=4)
    assert outputs == expected
    assert {key.positions for key in graphed.static.chains} == {4}
    assert set(engine.adaptive.chains.sums) & {1, 2} and engine.adaptive.chains.share(2) > 0
    assert graphed.static.pool.num_free == 2
    if proposer_kind == "draft":
        assert max(key.rows for key in wrong_draft.static.steps) > graphs.MAX_GRAPH_ROWS
        assert wrong_draft.static.pool.num_free == 2


def test_a_first_guess_dropped_before_a_chain_teaches_adaptive_k():
    """A draft whose first guesses are all dropped (too unlikely to pay for their rows)
    leaves plain steps that decode in chains; each drop is still the proposer's news to
    adaptive k, so it stops drafting every step and only probes now and then."""
    target = random_decoder("qwen3", seed=1)
    graphed, draft = copy.deepcopy(target), perturbed(target, 0.3, seed=2)
    graphed.use_cuda_graphs(num_slots=1, capacity=256)
    proposer = DraftModelProposer(draft)
    adaptive = AdaptiveSpecLength(5, prior_draft_cost_ratio=0.2)
    adaptive.least_chances = lambda batch, rows, seq_ids: [1.01] * len(seq_ids)  # no first guess is worth its row
    observe_draft, observe_target = adaptive.observe_draft, adaptive.observe_target  # steady costs
    adaptive.observe_draft = lambda positions, seconds: observe_draft(positions, 2e-3 * positions)
    adaptive.observe_target = lambda rows, seconds: observe_target(rows, 1e-2 + 1e-3 * rows)
    engine = Engine(
        graphed, [EOS], proposer=proposer, num_speculative_tokens=3, adaptive=adaptive, num_scheduler_steps=4
    )
    calls, propose = [], proposer.propose
    proposer.propose = lambda seqs, ks, least=None: calls.append(ks) or propose(seqs, ks, least)
    seq = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert seq.output_ids == run(target, lambda: None, [(PROMPTS[0], seq.params)])[0][0]
    assert engine.spec_stats.num_draft_tokens == 0 and steps < 60  # chains, nothing drafted
    assert 1 <= len(calls) <= 6  # the first drafts and a few probes, not a call a chain


def test_num_scheduler_steps_must_be_positive():
    with pytest.raises(ConfigError, match="num_scheduler_steps must be >= 1, got 0"):
        Engine(random_decoder("qwen3", seed=1), eos_token_ids=[EOS], num_scheduler_steps=0)


@pytest.mark.parametrize("layers, final", [((), False), ((1, 0), True)])
def test_a_decoders_token_chain_guesses_what_its_steps_guess(layers, final):
    """TokenChain on a decoder (a draft model, or the target decoding several steps at
    once): k positions in one static step give the argmax chain and confidences of k
    single-token steps, and the features those steps capture, and leave each cache's
    length."""
    model = random_decoder("qwen3", seed=3)
    model.use_cuda_graphs(num_slots=2, capacity=128)
    caches, firsts = [], []
    for prompt in PROMPTS[:2]:
        cache = model.new_cache()
        logits = model(torch.tensor(prompt), [Segment(cache, len(prompt))])
        caches.append(cache)
        firsts.append(int(logits[-1].argmax()))
    capture = Capture(layers=layers, final=final) if layers else None
    guesses, confidences, *_ = model.static.token_chain(firsts, None, caches, positions=4, capture=capture)
    assert [c.length for c in caches] == [len(p) for p in PROMPTS[:2]]
    for b, (cache, token, got, got_confidences) in enumerate(zip(caches, firsts, guesses, confidences)):
        expected, expected_confidences = [], []
        for j in range(4):
            step = Capture(layers=layers, final=final)
            logits = model(torch.tensor([token]), [Segment(cache, 1)], capture=step)
            token = int(logits[0].argmax())
            expected.append(token)
            expected_confidences.append(float(logits[0].softmax(-1).max()))
            if capture is not None:  # position j of sequence b: row 4 b + j
                torch.testing.assert_close(capture.layer_inputs[4 * b + j], step.layer_inputs[0])
                torch.testing.assert_close(capture.final_hidden[4 * b + j], step.final_hidden[0])
        assert got == expected
        assert got_confidences == pytest.approx(expected_confidences, abs=1e-5)


def test_a_slot_is_taken_at_the_first_step_and_given_back_at_the_end():
    model = random_decoder("llama", seed=5)
    model.use_cuda_graphs(num_slots=1, capacity=64)
    engine = Engine(model, eos_token_ids=[EOS], max_num_seqs=1)
    first, second = (engine.add_request(PROMPTS[i], GREEDY) for i in (0, 1))
    assert model.static.pool.num_free == 1  # waiting requests hold no slot
    engine.step()
    assert model.static.pool.num_free == 0
    while not first.finished:
        engine.step()
    assert model.static.pool.num_free == 1  # given back as the first finished
    engine.step()
    assert model.static.pool.num_free == 0 and second.cache.slot == 0  # the second took it
    engine.finish(second.seq_id)
    assert model.static.pool.num_free == 1


def test_a_pool_refuses_more_positions_than_its_capacity():
    model = random_decoder("llama", seed=5)
    model.use_cuda_graphs(num_slots=1, capacity=16)
    with pytest.raises(ConfigError, match="17 positions do not fit a KV cache slot of 16.*--max-model-len"):
        model(torch.arange(17), [Segment(model.new_cache(), 17)])
    with pytest.raises(ConfigError, match="CUDA graphs are on already"):
        model.use_cuda_graphs(num_slots=1, capacity=16)


def test_cuda_graphs_are_refused_off_a_gpu_and_with_enforce_eager(capsys):
    with pytest.raises(ConfigError, match="--cuda-graphs needs a CUDA GPU.*--device cuda"):
        build_engine("no-such-model", cuda_graphs=True)
    assert main(["generate", "--model", "no-such-model", "--device", "cpu", "--cuda-graphs", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specserve: error: --cuda-graphs needs a CUDA GPU") and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["generate", "--cuda-graphs", "--enforce-eager", "--prompt", "hi"])
    assert "not allowed with argument --cuda-graphs" in capsys.readouterr().err


def test_graphs_are_the_default_where_the_cache_pools_fit(monkeypatch, caplog):
    """build_engine's graphs on a GPU: the pools of every decoder must fit in 90% of the
    free memory; else an error if --cuda-graphs asked for them, a warning and eager
    steps if they were only the default."""
    from specserve.engine.build import use_cuda_graphs

    target, draft = random_decoder("llama", seed=5), random_decoder("llama", seed=6)
    per_slot = 2 * 64 * (2 * 2 * 2 * 16 * 4)  # the two pools' bytes for one slot of 64 positions
    free = {"bytes": 11 * per_slot}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 2 * free["bytes"]))
    with pytest.raises(ConfigError, match=r"15 sequences of 64 tokens.*lower --max-num-seqs or --max-model-len"):
        use_cuda_graphs([target, draft], slots=15, positions=64, asked=True)  # 15 slots + the scratch one
    use_cuda_graphs([target, draft], slots=15, positions=64, asked=False)
    assert "running eagerly" in caplog.text and target.static is None and draft.static is None
    use_cuda_graphs([target, draft], slots=8, positions=64, asked=False)  # 9 slots fit 90% of 11
    assert target.static.pool.capacity == draft.static.pool.capacity == 64
    # the captured steps of each: half what the pools leave of 90%
    assert target.static.captured.budget == draft.static.captured.budget == int(0.9 * 11 * per_slot - 9 * per_slot) // 2
    head = EagleHead(EagleConfig.for_target(target.config, 1))  # an EAGLE head's own steps: a pool of one layer
    use_cuda_graphs([head], slots=2, positions=64, asked=True)
    assert head.static.pool.capacity == 64 and head.static.pool.keys.shape[:2] == (3, 1)
