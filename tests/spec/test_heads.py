"""EAGLE and Medusa heads in their public checkpoint layouts: loading, forward passes checked
against straightforward reimplementations (full attention over the whole history, so cache
and rollback bugs show), save -> load round trips, and every refusal's message."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specserve.errors import ConfigError, ModelLoadError
from specserve.model.decoder import Segment
from specserve.spec.heads.checkpoint import load_head, save_head
from specserve.spec.heads.eagle import EagleConfig, EagleHead
from specserve.spec.heads.medusa import MedusaConfig, MedusaHeads
from tests.conftest import skip_unless_triton_runs_on, tiny_config

# Eight layers: EAGLE-3 reads the inputs of layers 2, 4 and 5.
TARGET = tiny_config("qwen2", num_layers=8)
H, V = TARGET.hidden_size, TARGET.vocab_size
HEADS, KV_HEADS, HEAD_DIM = TARGET.num_heads, TARGET.num_kv_heads, TARGET.head_dim
HEAD_INTERMEDIATE = 96  # a head's MLP need not be the target's
DRAFT_VOCAB = 40


def random(*shape: int) -> torch.Tensor:
    return torch.randn(*shape) / math.sqrt(shape[-1])


def norm_weight() -> torch.Tensor:
    return 1 + 0.1 * torch.randn(H)


def llama_layer(prefix: str, qkv_input: int) -> dict[str, torch.Tensor]:
    attention, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
    return {
        f"{attention}q_proj.weight": random(HEADS * HEAD_DIM, qkv_input),
        f"{attention}k_proj.weight": random(KV_HEADS * HEAD_DIM, qkv_input),
        f"{attention}v_proj.weight": random(KV_HEADS * HEAD_DIM, qkv_input),
        f"{attention}o_proj.weight": random(H, HEADS * HEAD_DIM),
        f"{mlp}gate_proj.weight": random(HEAD_INTERMEDIATE, H),
        f"{mlp}up_proj.weight": random(HEAD_INTERMEDIATE, H),
        f"{mlp}down_proj.weight": random(H, HEAD_INTERMEDIATE),
        f"{prefix}post_attention_layernorm.weight": norm_weight(),
    }


def llama_config(architecture: str, **extra) -> dict:
    """A head's config.json as the EAGLE repositories write it (no head_dim: H / heads)."""
    return {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": HEAD_INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 2048,
        "vocab_size": V,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "pad_token_id": 0,
        **extra,
    }


def eagle3_checkpoint(norm_before_residual: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """SafeAILab/SpecForge's EAGLE-3 layout, with a draft vocabulary of DRAFT_VOCAB ids."""
    drafted = torch.randperm(V)[:DRAFT_VOCAB].sort().values  # target ids, ascending as SpecForge picks them
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[drafted] = True
    tensors = llama_layer("midlayer.", 2 * H) | {
        "midlayer.input_layernorm.weight": norm_weight(),
        "midlayer.hidden_norm.weight": norm_weight(),
        "fc.weight": random(H, 3 * H),
        "norm.weight": norm_weight(),
        "lm_head.weight": random(DRAFT_VOCAB, H),
        "d2t": drafted - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
        "embed_tokens.weight": random(V, H),
    }
    extra = {"draft_vocab_size": DRAFT_VOCAB} | ({"norm_before_residual": True} if norm_before_residual else {})
    return llama_config("LlamaForCausalLMEagle3", **extra), tensors


def eagle1_checkpoint() -> tuple[dict, dict[str, torch.Tensor]]:
    """SafeAILab's EAGLE-1/2 layout: fc with a bias, a layer without input norm, the embedding."""
    tensors = llama_layer("layers.0.", H) | {
        "fc.weight": random(H, 2 * H),
        "fc.bias": 0.1 * torch.randn(H),
        "embed_tokens.weight": random(V, H),
    }
    return llama_config("LlamaForCausalLM", bias=True), tensors


def medusa_checkpoint(num_heads: int = 3, num_layers: int = 2) -> tuple[dict, dict[str, torch.Tensor]]:
    """FasterDecoding/Medusa's medusa_lm_head: the state of their `medusa_head` ModuleList."""
    tensors = {}
    for i in range(num_heads):
        for j in range(num_layers):
            tensors[f"{i}.{j}.linear.weight"] = random(H, H)
            tensors[f"{i}.{j}.linear.bias"] = 0.1 * torch.randn(H)
        tensors[f"{i}.{num_layers}.weight"] = random(V, H)
    config = {
        "medusa_num_heads": num_heads,
        "medusa_num_layers": num_layers,
        "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
        "transformers_version": "4.31.0",
    }
    return config, tensors


def vllm_medusa_checkpoint(shared: bool = False, truncated: int = 48) -> tuple[dict, dict[str, torch.Tensor]]:
    """vLLM's Medusa layout with a token_map; LM heads over the whole vocabulary (vLLM slices them)."""
    num_heads = 3
    tensors = {}
    for i in range(num_heads):
        tensors[f"blocks.{i}.layers.0.weight"] = random(H, H)
        tensors[f"blocks.{i}.layers.0.bias"] = 0.1 * torch.randn(H)
    for i in range(1 if shared else num_heads):
        tensors[f"lm_heads.{i}.weight"] = random(V, H)
    tensors["token_map"] = torch.randperm(V)[:truncated]
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": H,
        "vocab_size": V,
        "num_heads": num_heads,
        "num_hidden_layers": 1,
        "medusa_fc_bias": True,
        "original_lm_head": shared,
        "truncated_vocab_size": truncated,
    }
    return config, tensors


def write(
    folder: Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    weights_file: str = "model.safetensors",
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if weights_file.endswith(".safetensors"):
        save_file(tensors, str(folder / weights_file))
    else:
        torch.save(tensors, folder / weights_file)
    return folder


# Each published layout: (method, checkpoint, weights file as published).
LAYOUTS = {
    "eagle3": ("eagle3", eagle3_checkpoint, "model.safetensors"),
    "eagle3-bin": ("eagle3", eagle3_checkpoint, "pytorch_model.bin"),
    "eagle1": ("eagle", eagle1_checkpoint, "pytorch_model.bin"),
    "medusa-pt": ("medusa", medusa_checkpoint, "medusa_lm_head.pt"),
    "medusa-safetensors": ("medusa", medusa_checkpoint, "medusa_lm_head.safetensors"),
    "medusa-vllm": ("medusa", vllm_medusa_checkpoint, "model.safetensors"),
    "medusa-vllm-shared": ("medusa", lambda: vllm_medusa_checkpoint(shared=True), "model.safetensors"),
}


def target_parts(seed: int = 1) -> tuple[nn.Embedding, nn.Linear]:
    """The target's embedding and LM head a head borrows."""
    torch.manual_seed(seed)
    return nn.Embedding(V, H), nn.Linear(H, V, bias=False)


def run(head, seed: int = 2) -> list[torch.Tensor]:
    """A forward pass of each kind the head has, on fixed inputs."""
    generator = torch.Generator().manual_seed(seed)
    if isinstance(head, MedusaHeads):
        hidden = torch.randn(4, H, generator=generator)
        return [head(hidden), head.logits(hidden)]
    head.share_target(*target_parts())
    cache = head.new_cache()
    target_features = torch.randn(5, head.config.target_feature_size, generator=generator)
    tokens = torch.randint(0, V, (5,), generator=generator)
    outputs = [head(tokens, head.project_target_features(target_features), [Segment(cache, 5)])]
    for _ in range(3):  # a chain: each step feeds the head's own feature and guess
        guess = head.to_target_ids(head.draft_logits(outputs[-1][-1:]).argmax(-1))
        outputs.append(head(guess, outputs[-1][-1:], [Segment(cache, 1)]))
    return outputs + [head.logits(torch.cat(outputs))]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_published_layouts_load_and_run_deterministically(tmp_path, layout):
    method, make, weights_file = LAYOUTS[layout]
    torch.manual_seed(0)
    head = load_head(write(tmp_path, *make(), weights_file), TARGET, method)
    if isinstance(head, EagleHead):
        assert head.config.version == (3 if method == "eagle3" else 1)
        assert head.config.feature_layers == ((2, 4, 5) if method == "eagle3" else ())
        assert head.config.layer.head_dim == HEAD_DIM and head.config.layer.intermediate_size == HEAD_INTERMEDIATE
    first, second = run(head), run(head)
    for a, b in zip(first, second):
        assert torch.isfinite(a).any() and torch.equal(a, b)
    logits = first[-1]
    assert logits.shape[-1] == V
    if method == "eagle3" or layout.startswith("medusa-vllm"):  # a draft vocabulary: the rest is -inf
        width = DRAFT_VOCAB if method == "eagle3" else 48
        assert (torch.isfinite(logits).sum(-1) == width).all()


@pytest.mark.parametrize("in_place", [False, True], ids=["gathered", "in-place"])
@pytest.mark.parametrize("layout", ["eagle3", "eagle1"])
def test_static_head_steps_compute_the_eager_ones(tmp_path, layout, in_place):
    """The head's static steps (CUDA graphs on a GPU; eagerly here, in place under
    Triton's interpreter) give the eager forward's features and logits, in its cache slot."""
    if in_place:
        skip_unless_triton_runs_on("cpu")
    method, make, weights_file = LAYOUTS[layout]
    torch.manual_seed(0)
    folder = write(tmp_path, *make(), weights_file)
    eager, static = load_head(folder, TARGET, method), load_head(folder, TARGET, method)
    static.use_cuda_graphs(num_slots=2, capacity=64)
    static.static.in_place = in_place
    for a, b in zip(run(eager), run(static)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert {key.rows for key in static.static.steps} == {5, 1}  # the catch-up, then the chain's positions
    assert static.static.pool.num_free == 1  # run's cache holds a slot until released


@pytest.mark.parametrize("layout", ["eagle3", "eagle1"])
def test_a_token_chain_in_one_static_step_guesses_what_steps_guess(tmp_path, layout):
    """TokenChain: k greedy positions in one static step give the guesses and
    confidences of k head steps fed their own argmax, and leave the cache's length."""
    method, make, weights_file = LAYOUTS[layout]
    torch.manual_seed(0)
    head = load_head(write(tmp_path, *make(), weights_file), TARGET, method)
    head.share_target(*target_parts())
    head.use_cuda_graphs(num_slots=3, capacity=64)
    generator = torch.Generator().manual_seed(4)
    caches, firsts, hiddens = [], [], []
    for pairs in (5, 2):  # two sequences, read to different lengths
        cache = head.new_cache()
        features = head.project_target_features(
            torch.randn(pairs, head.config.target_feature_size, generator=generator)
        )
        hidden, logits = head.step(
            torch.randint(0, V, (pairs,), generator=generator),
            features,
            [Segment(cache, pairs)],
            torch.tensor([pairs - 1]),
        )
        caches.append(cache)
        firsts.append(int(head.to_target_ids(logits.argmax(-1))))
        hiddens.append(hidden[-1])
    guesses, confidences, *_ = head.static.token_chain(firsts, torch.stack(hiddens), caches, 3, head.target_ids)
    assert [c.length for c in caches] == [5, 2]
    for cache, first, hidden, got, got_confidences in zip(caches, firsts, hiddens, guesses, confidences):
        token, expected, expected_confidences = first, [], []
        hidden = hidden[None]
        for _ in range(3):
            hidden, logits = head.step(torch.tensor([token]), hidden, [Segment(cache, 1)], torch.tensor([0]))
            token = int(head.to_target_ids(logits.argmax(-1)))
            expected.append(token)
            expected_confidences.append(float(logits.softmax(-1).amax()))
        assert got == expected
        assert got_confidences == pytest.approx(expected_confidences, abs=1e-5)


def test_compiled_head_computes_what_eager_does(tmp_path):
    """EagleHead.use_torch_compile compiles at load every part a head step runs, eager
    and static alike, and changes no figure."""
    from torch._dynamo.utils import counters

    method, make, weights_file = LAYOUTS["eagle3"]
    torch.manual_seed(0)
    folder = write(tmp_path, *make(), weights_file)
    eager, compiled = load_head(folder, TARGET, method), load_head(folder, TARGET, method)
    compiled.share_target(*target_parts())
    before = counters["stats"]["unique_graphs"]
    assert compiled.use_torch_compile()
    at_load = counters["stats"]["unique_graphs"] - before
    with torch.inference_mode():  # as the engine runs a head
        outputs = run(compiled)
    for a, b in zip(run(eager), outputs):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] - before == at_load  # nothing compiled in a request


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_then_load_gives_identical_outputs(tmp_path, layout):
    method, make, weights_file = LAYOUTS[layout]
    torch.manual_seed(0)
    head = load_head(write(tmp_path / "published", *make(), weights_file), TARGET, method)
    save_head(head, tmp_path / "saved")
    again = load_head(tmp_path / "saved", TARGET, method)
    assert again.config == head.config
    for a, b in zip(run(head), run(again)):
        assert torch.equal(a, b)


def test_saved_eagle3_uses_the_published_names(tmp_path):
    torch.manual_seed(0)
    config, tensors = eagle3_checkpoint()
    save_head(load_head(write(tmp_path / "published", config, tensors), TARGET, "eagle3"), tmp_path / "saved")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert set(saved) == set(tensors) - {"embed_tokens.weight"}  # the target's table is not the head's
    for name in ("d2t", "t2d", "fc.weight", "midlayer.self_attn.k_proj.weight"):
        assert torch.equal(saved[name], tensors[name])
    written = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLMEagle3"] and written["draft_vocab_size"] == DRAFT_VOCAB
    assert written["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


@pytest.mark.parametrize(
    "fresh",
    [
        lambda: EagleHead(EagleConfig.for_target(TARGET, 3, DRAFT_VOCAB)),
        lambda: EagleHead(EagleConfig.for_target(TARGET, 1)),
        lambda: MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=H, vocab_size=V, bias=False)),
    ],
    ids=["eagle3", "eagle1", "medusa"],
)
def test_new_heads_round_trip(tmp_path, fresh):
    torch.manual_seed(0)
    head = fresh().eval()
    save_head(head, tmp_path)
    method = "medusa" if isinstance(head, MedusaHeads) else ("eagle3" if head.config.version == 3 else "eagle")
    again = load_head(tmp_path, TARGET, method)
    assert again.config == head.config
    for a, b in zip(run(head), run(again)):
        assert torch.equal(a, b)


def test_new_medusa_blocks_start_at_zero():
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=2, hidden_size=H, vocab_size=V))
    assert all(not linear.weight.any() for linear in heads.residual_linears())


# ---- parity with a straightforward reimplementation ----


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def reference_head(
    t: dict[str, torch.Tensor],
    version: int,
    embeddings: torch.Tensor,
    features: torch.Tensor,
    norm_before_residual: bool = False,
) -> torch.Tensor:
    """The head's output features [L, H] for a whole history of pairs at positions 0..L-1,
    with full causal attention and nothing cached."""
    length = embeddings.shape[0]
    prefix = "midlayer." if version == 3 else "layers.0."
    if version == 3:
        normed = rms_norm(features, t["midlayer.hidden_norm.weight"])
        x = torch.cat([rms_norm(embeddings, t["midlayer.input_layernorm.weight"]), normed], dim=-1)
        residual = normed if norm_before_residual else features
    else:
        x = residual = torch.cat([embeddings, features], dim=-1) @ t["fc.weight"].T + t["fc.bias"]
    q = (x @ t[f"{prefix}self_attn.q_proj.weight"].T).view(length, HEADS, HEAD_DIM).transpose(0, 1)
    k = (x @ t[f"{prefix}self_attn.k_proj.weight"].T).view(length, KV_HEADS, HEAD_DIM).transpose(0, 1)
    v = (x @ t[f"{prefix}self_attn.v_proj.weight"].T).view(length, KV_HEADS, HEAD_DIM).transpose(0, 1)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = torch.arange(length).float()[:, None] * inv_freq[None]  # [L, head_dim / 2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(HEAD_DIM)  # [heads, L, L]
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(length, HEADS * HEAD_DIM)
    h = residual + attended @ t[f"{prefix}self_attn.o_proj.weight"].T
    m = rms_norm(h, t[f"{prefix}post_attention_layernorm.weight"])
    m = F.silu(m @ t[f"{prefix}mlp.gate_proj.weight"].T) * (m @ t[f"{prefix}mlp.up_proj.weight"].T)
    return h + m @ t[f"{prefix}mlp.down_proj.weight"].T


def reference_logits(
    t: dict[str, torch.Tensor], version: int, hidden: torch.Tensor, target_lm_head: nn.Linear
) -> torch.Tensor:  # [R, V]
    if version == 1:
        return hidden @ target_lm_head.weight.T
    draft = rms_norm(hidden, t["norm.weight"]) @ t["lm_head.weight"].T  # [R, draft vocab]
    logits = torch.full((hidden.shape[0], V), float("-inf"))
    logits[:, torch.arange(DRAFT_VOCAB) + t["d2t"]] = draft
    return logits


@pytest.mark.parametrize("variant", ["eagle3", "eagle3-norm-before-residual", "eagle1"])
def test_chain_drafting_with_rollback_matches_reference(tmp_path, variant):
    torch.manual_seed(0)
    version = 1 if variant == "eagle1" else 3
    config, t = eagle1_checkpoint() if version == 1 else eagle3_checkpoint(variant.endswith("residual"))
    head = load_head(write(tmp_path, config, t), TARGET, "eagle" if version == 1 else "eagle3")
    embed, target_lm_head = target_parts()
    head.share_target(embed, target_lm_head)
    cache = head.new_cache()
    tokens, reference_history = [], []  # what the head's cache holds

    def feed(new_tokens: list[int], ours: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = head(torch.tensor(new_tokens), ours, [Segment(cache, len(new_tokens))])
        tokens.extend(new_tokens)
        reference_history.append(reference)
        with torch.no_grad():
            expected = reference_head(
                t, version, embed(torch.tensor(tokens)), torch.cat(reference_history), variant.endswith("residual")
            )[-len(new_tokens) :]
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        assert cache.length == len(tokens)
        return out, expected

    def catch_up(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs of the target's features and verified tokens."""
        target_features = torch.randn(count, head.config.target_feature_size)
        projected = target_features @ t["fc.weight"].T if version == 3 else target_features
        return feed(torch.randint(0, V, (count,)).tolist(), head.project_target_features(target_features), projected)

    def chain(out: torch.Tensor, expected: torch.Tensor, steps: int) -> None:
        for _ in range(steps):
            with torch.no_grad():
                reference = reference_logits(t, version, expected[-1:], target_lm_head)
            logits = head.logits(out[-1:])
            torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
            guess = head.to_target_ids(head.draft_logits(out[-1:]).argmax(-1))
            assert guess.item() == reference.argmax(-1).item()
            out, expected = feed(guess.tolist(), out[-1:], expected[-1:])

    chain(*catch_up(6), steps=3)
    cache.truncate(6)  # the drafts were rejected: forget them, then read what the target verified
    del tokens[6:], reference_history[1:]
    chain(*catch_up(2), steps=2)
    chain(*catch_up(1), steps=1)


def test_medusa_matches_reference(tmp_path):
    torch.manual_seed(0)
    config, t = medusa_checkpoint(num_heads=2, num_layers=2)
    heads = load_head(write(tmp_path, config, t, "medusa_lm_head.pt"), TARGET, "medusa")
    hidden = torch.randn(3, H)
    for i, logits in enumerate(heads(hidden)):
        x = hidden
        for j in range(2):
            x = x + F.silu(x @ t[f"{i}.{j}.linear.weight"].T + t[f"{i}.{j}.linear.bias"])
        torch.testing.assert_close(logits, x @ t[f"{i}.2.weight"].T, rtol=1e-4, atol=1e-5)


def test_vllm_medusa_token_map_names_target_ids(tmp_path):
    torch.manual_seed(0)
    config, t = vllm_medusa_checkpoint()
    heads = load_head(write(tmp_path, config, t), TARGET, "medusa")
    hidden = torch.randn(2, H)
    draft_ids = heads(hidden).argmax(-1)  # [heads, R]
    torch.testing.assert_close(heads.logits(hidden).argmax(-1), heads.to_target_ids(draft_ids), rtol=0, atol=0)
    x = hidden + F.silu(hidden @ t["blocks.1.layers.0.weight"].T + t["blocks.1.layers.0.bias"])
    expected = (x @ t["lm_heads.1.weight"].T)[:, t["token_map"]]  # vLLM slices a whole-vocabulary head
    torch.testing.assert_close(heads(hidden)[1], expected, rtol=1e-4, atol=1e-5)


# ---- refusals ----


def edited(make, config_edit=lambda config: None, tensors_edit=lambda tensors: None):
    """`make`'s checkpoint, changed in place by the edits."""

    def checkpoint():
        config, tensors = make()
        config_edit(config)
        tensors_edit(tensors)
        return config, tensors

    return checkpoint


def other_target(**overrides):
    return tiny_config("qwen2", **{"num_layers": 8, **overrides})


# case: (method, checkpoint, target, error, what the message says)
REFUSALS = {
    "hidden-size": (
        "eagle3",
        eagle3_checkpoint,
        other_target(hidden_size=32),
        ConfigError,
        "the head was made for hidden size 64, the target has 32",
    ),
    "vocabulary": (
        "eagle",
        eagle1_checkpoint,
        other_target(vocab_size=100),
        ConfigError,
        "the head was made for a vocabulary of 96 ids, the target has 100",
    ),
    "medusa-hidden-size": (
        "medusa",
        medusa_checkpoint,
        other_target(hidden_size=128),
        ConfigError,
        "the head was made for hidden size 64, the target has 128",
    ),
    "medusa-vocabulary": (
        "medusa",
        vllm_medusa_checkpoint,
        other_target(vocab_size=128),
        ConfigError,
        "the head was made for a vocabulary of 96 ids, the target has 128",
    ),
    "head-width": (
        "eagle3",
        edited(eagle3_checkpoint, lambda c: c.update(hidden_size=32, target_hidden_size=64)),
        TARGET,
        ConfigError,
        "the head's layer is 32 wide, the target's embedding 64",
    ),
    "named-layers": (
        "eagle3",
        edited(eagle3_checkpoint, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 9, 13])),
        TARGET,
        ConfigError,
        "the head reads the inputs of target layers [2, 9, 13]; the target has 8 layers",
    ),
    "too-few-layers": (
        "eagle3",
        eagle3_checkpoint,
        other_target(num_layers=2),
        ConfigError,
        "EAGLE-3 reads the inputs of target layers 2, N//2 and N-3; the target has 2 layers",
    ),
    "other-method": (
        "eagle",
        eagle3_checkpoint,
        TARGET,
        ConfigError,
        'the folder holds an EAGLE-3 head, not an EAGLE-1/2 head: use "method": "eagle3"',
    ),
    "unknown-architecture": (
        "eagle",
        edited(eagle1_checkpoint, lambda c: c.update(architectures=["Qwen2ForCausalLM"])),
        TARGET,
        ModelLoadError,
        "config.json names ['Qwen2ForCausalLM'], which is no head",
    ),
    "missing-key": (
        "eagle3",
        edited(eagle3_checkpoint, tensors_edit=lambda t: t.pop("midlayer.hidden_norm.weight")),
        TARGET,
        ModelLoadError,
        "the checkpoint has no tensor 'midlayer.hidden_norm.weight'",
    ),
    "missing-d2t": (
        "eagle3",
        edited(eagle3_checkpoint, tensors_edit=lambda t: t.pop("d2t")),
        TARGET,
        ModelLoadError,
        "the checkpoint has no tensor 'd2t', which a draft vocabulary of 40 ids needs",
    ),
    "bad-shape": (
        "eagle",
        edited(eagle1_checkpoint, tensors_edit=lambda t: t.update({"fc.weight": random(H, 3 * H)})),
        TARGET,
        ModelLoadError,
        "tensor 'fc.weight' has shape (64, 192), the config implies (64, 128)",
    ),
    "extra-tensor": (
        "medusa",
        edited(medusa_checkpoint, tensors_edit=lambda t: t.update({"3.0.linear.weight": random(H, H)})),
        TARGET,
        ModelLoadError,
        "the checkpoint has tensors this head does not use, e.g. ['3.0.linear.weight']",
    ),
    "d2t-out-of-range": (
        "eagle3",
        edited(eagle3_checkpoint, tensors_edit=lambda t: t["d2t"].add_(V)),
        TARGET,
        ModelLoadError,
        "'d2t' maps to target ids outside the vocabulary [0, 96)",
    ),
    "unknown-method": (
        "mlp_speculator",
        eagle3_checkpoint,
        TARGET,
        ConfigError,
        "unknown head method 'mlp_speculator'",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_say_what_differs(tmp_path, case):
    method, make, target, error, message = REFUSALS[case]
    torch.manual_seed(0)
    write(tmp_path, *make())
    with pytest.raises(error) as raised:
        load_head(tmp_path, target, method)
    assert message in str(raised.value)
    if case != "unknown-method":
        assert str(tmp_path) in str(raised.value)


def test_folders_that_hold_no_head(tmp_path):
    with pytest.raises(ModelLoadError, match="no such folder"):
        load_head(tmp_path / "absent", TARGET, "eagle3")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_head(tmp_path, TARGET, "eagle3")
    config, _ = eagle3_checkpoint()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"no weights \(\*.safetensors, \*.bin or \*.pt\)"):
        load_head(tmp_path, TARGET, "eagle3")
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ModelLoadError, match="cannot read .*model.safetensors"):
        load_head(tmp_path, TARGET, "eagle3")
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ModelLoadError, match="cannot read pytorch_model.bin"):
        load_head(tmp_path, TARGET, "eagle3")
