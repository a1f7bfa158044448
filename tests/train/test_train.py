"""`specserve train-head`: heads learn the target (overfitting one text), training resumes step for
step, answers' features recorded as they are generated equal a teacher-forced read (written
instructions' answers too), the command writes a head `load_head` reads and resumes after an
interruption, refusals name their fix, the bundled instructions are not the benchmark's prompts,
and instructions the target writes are new, never held-out ones' kin."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest
import torch
from safetensors.torch import load_file

from specserve import catalogue
from specserve.bench.suites import SUITES
from specserve.cli import main
from specserve.errors import ConfigError, ModelLoadError
from specserve.model import checkpoint, native
from specserve.model.decoder import Decoder
from specserve.spec.heads.checkpoint import load_head, save_head
from specserve.tokenizer import Tokenizer
from specserve.train.data import (
    WRITE_TOKENS,
    AnswerSettings,
    InstructionWriter,
    Sample,
    answer_instructions,
    longest_sequence,
    read_answers,
)
from specserve.train.eagle import EagleMethod, start_from_target_layer
from specserve.train.features import (
    PROMPT_CONTEXT,
    AnswerRecorder,
    FeatureSet,
    FeatureSpec,
    compute_features,
    sample_features,
)
from specserve.train.instructions import Instruction, from_messages, load_instructions, parse_line
from specserve.train.loop import LoopSettings, Trainer, with_noise
from specserve.train.medusa import MedusaMethod
from specserve.train.objective import DraftVocab, estimated_acceptance_length
from specserve.train.run import TrainHeadSettings, check_same_run, float_tensor, train_head
from tests.conftest import DEVICES, tiny_config
from tests.test_tokenizer import SENT_TOOL_CONVERSATION, TOOL_CONVERSATION, TOOLS, _qwen05_gguf, _smollm2_gguf

# Eight layers: EAGLE-3 reads the inputs of layers 2, 4 and 5.
TARGET = tiny_config("qwen2", num_layers=8)
METHODS = {"eagle3": lambda: EagleMethod(3, 3), "eagle": lambda: EagleMethod(1, 3), "medusa": lambda: MedusaMethod(3)}


def sharp_target() -> Decoder:
    """Random weights with a peaked next-token distribution, so the target's top-1 is well defined."""
    torch.manual_seed(0)
    target = Decoder(TARGET).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)
    return target


def trainer_on_one_text(method_name: str, folder, steps: int, device: str = "cpu", **loop) -> Trainer:
    target, method = sharp_target().to(device), METHODS[method_name]()
    text = torch.randint(0, TARGET.vocab_size, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    spec = method.feature_spec(TARGET)
    keys = compute_features(target, {"text": Sample(text, 0)}, spec, 8, folder, time.monotonic() + 600)
    data = FeatureSet.load(folder, keys)
    vocab = DraftVocab.most_frequent(data.token_counts(TARGET.vocab_size), TARGET.vocab_size)
    torch.manual_seed(2)
    head = method.new_head(TARGET, target.embed_tokens, vocab, target.lm_head.weight.detach()[vocab.target_ids])
    settings = LoopSettings(steps=steps, lr=1e-2, warmup_steps=5, window=64, batch_tokens=128, **loop)
    return Trainer(method, head, data, vocab, settings, folder / "checkpoint.pt", torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method_name", METHODS)
def test_a_head_trained_on_one_text_agrees_with_the_target(tmp_path, method_name, device):
    trainer = trainer_on_one_text(method_name, tmp_path, steps=60, device=device)
    before = trainer.evaluate(held_out=False)
    losses = []
    trainer.run(time.monotonic() + 600, lambda figures: losses.append(figures.loss.item()))
    after = trainer.evaluate(held_out=False)
    assert losses[-1] < losses[0] / 2
    assert max(before.rates) < 0.1 and min(after.rates) > 0.8, (before.rates, after.rates)
    # The trained head's public layout loads, and scores as it did.
    save_head(trainer.head, tmp_path / "head")
    loaded = load_head(tmp_path / "head", TARGET, method_name)
    trained = trainer.head.state_dict().values()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(trained, loaded.state_dict().values()))


def test_an_eagle3_head_starts_as_the_targets_last_layer(tmp_path):
    """The layer's weights are the target's last layer's (the first of its MLP neurons
    where the head's MLP is narrower), read back from a checkpoint as train-head reads
    them; fc passes the last captured layer through; the embedding's half of qkv keeps
    its random start."""
    target = sharp_target()
    checkpoint.write_checkpoint(tmp_path, TARGET, target.hf_state_dict())
    vocab = DraftVocab.most_frequent(torch.arange(TARGET.vocab_size).float(), 64)
    rows = target.lm_head.weight.detach()[vocab.target_ids]
    torch.manual_seed(0)
    head = EagleMethod(3, 2, TARGET.intermediate_size // 2).new_head(TARGET, target.embed_tokens, vocab, rows)
    random_qkv = head.layer.self_attn.qkv_proj.weight.detach().clone()
    start_from_target_layer(head, lambda name: float_tensor(tmp_path, name), TARGET.num_layers - 1)

    last, hidden, neurons = target.layers[-1], TARGET.hidden_size, TARGET.intermediate_size // 2
    qkv = head.layer.self_attn.qkv_proj.weight
    assert torch.equal(qkv[:, hidden:], last.self_attn.qkv_proj.weight)
    assert torch.equal(qkv[:, :hidden], random_qkv[:, :hidden])
    assert torch.equal(head.layer.self_attn.o_proj.weight, last.self_attn.o_proj.weight)
    gate, up = last.mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(head.layer.mlp.gate_up_proj.weight, torch.cat([gate[:neurons], up[:neurons]]))
    assert torch.equal(head.layer.mlp.down_proj.weight, last.mlp.down_proj.weight[:, :neurons])
    assert torch.equal(head.hidden_norm.weight, last.input_layernorm.weight)
    assert torch.equal(head.layer.post_attention_layernorm.weight, last.post_attention_layernorm.weight)
    assert torch.equal(head.norm.weight, target.norm.weight)
    features = torch.randn(5, 3 * hidden)  # [rows, 3H]: the three captured layers
    assert torch.equal(head.fc(features), features[:, -hidden:])
    with pytest.raises(ConfigError, match="holds none of model.layers.99"):
        float_tensor(tmp_path, "model.layers.99.self_attn.q_proj.weight")


def test_an_eagle3_head_can_start_from_the_targets_strongest_neurons(tmp_path):
    """With `strongest_neurons`, the head's narrower MLP holds the neurons of the largest
    weight norms, in the target's order: here the second half, the first made weak."""
    target = sharp_target()
    last, neurons = target.layers[-1], TARGET.intermediate_size // 2
    with torch.no_grad():
        last.mlp.down_proj.weight[:, :neurons] *= 0.01
    checkpoint.write_checkpoint(tmp_path, TARGET, target.hf_state_dict())
    vocab = DraftVocab.most_frequent(torch.arange(TARGET.vocab_size).float(), 64)
    rows = target.lm_head.weight.detach()[vocab.target_ids]
    head = EagleMethod(3, 2, neurons).new_head(TARGET, target.embed_tokens, vocab, rows)
    start_from_target_layer(head, lambda name: float_tensor(tmp_path, name), TARGET.num_layers - 1, True)

    gate, up = last.mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(head.layer.mlp.gate_up_proj.weight, torch.cat([gate[neurons:], up[neurons:]]))
    assert torch.equal(head.layer.mlp.down_proj.weight, last.mlp.down_proj.weight[:, neurons:])


def test_a_feature_set_holds_its_samples_in_order(tmp_path):
    target = sharp_target()
    texts = {
        f"text-{i}": Sample(list(range(3 + 5 * i, 20 + 9 * i)), first_trained=i, held_out=i == 1) for i in range(3)
    }
    keys = compute_features(target, texts, FeatureSpec(layers=(2, 4)), 4, tmp_path, time.monotonic() + 600)
    data = FeatureSet.load(tmp_path, keys)
    parts = [load_file(str(tmp_path / f"{key}.safetensors")) for key in keys]
    for name in ("token_ids", "features", "top_ids", "top_probs"):
        assert torch.equal(getattr(data, name), torch.cat([part[name] for part in parts])), name
    lengths = [len(sample.token_ids) for sample in texts.values()]
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    assert data.samples == [(s, s + n, i == 1) for i, (s, n) in enumerate(zip(starts, lengths))]
    # Position p is trained where p + 1 is in the sample's trained part: from first_trained on, the last excluded.
    assert data.trained.tolist() == [first <= p + 1 < n for first, n in zip(range(3), lengths) for p in range(n)]


def test_a_long_prompt_keeps_only_the_context_a_window_can_read(tmp_path):
    """A sample keeps PROMPT_CONTEXT prompt positions before the one that predicts its
    first trained token, whose features were read with the whole prompt before them."""
    target = sharp_target()
    long, short = PROMPT_CONTEXT + 40, 5
    texts = {
        "long": Sample([7 + i % 50 for i in range(long + 12)], first_trained=long),
        "short": Sample([7 + i % 50 for i in range(short + 12)], first_trained=short),
    }
    keys = compute_features(target, texts, FeatureSpec(layers=(2, 4)), 4, tmp_path, time.monotonic() + 600)
    whole = sample_features(target, texts["long"], FeatureSpec(layers=(2, 4)), 4)
    kept = load_file(str(tmp_path / "long.safetensors"))
    cut = long - 1 - PROMPT_CONTEXT
    assert whole["token_ids"].tolist() == texts["long"].token_ids[cut:] and int(whole["first_trained"]) == long - cut
    assert torch.equal(kept["features"], whole["features"])
    data = FeatureSet.load(tmp_path, keys)
    assert [end - start for start, end, _ in data.samples] == [PROMPT_CONTEXT + 13, short + 12]
    assert int(data.trained.sum()) == 2 * 12  # each sample's 12 answer tokens


def test_a_head_is_measured_over_more_steps_than_it_trains(tmp_path):
    """evaluate(method=...) measures the same head by another method: an EAGLE-3 head
    trained over 3 unrolled steps, measured over 5, reports those 5, its first 3 as the
    training method's."""
    trainer = trainer_on_one_text("eagle3", tmp_path, steps=20)
    trainer.run(time.monotonic() + 600, lambda figures: None)
    own, longer = trainer.evaluate(held_out=False), trainer.evaluate(held_out=False, method=EagleMethod(3, 5))
    assert len(own.rates) == 3 and len(longer.rates) == 5
    assert longer.rates[:3] == own.rates


@pytest.mark.parametrize("loop", [{}, {"feature_noise": 0.3}])  # the noise's draws resume too
def test_resumed_training_matches_an_uninterrupted_run(tmp_path, loop):
    whole = trainer_on_one_text("eagle3", tmp_path / "whole", steps=12, **loop)
    whole.run(time.monotonic() + 600)

    def interrupt_at_step_7(figures) -> None:
        if interrupted.position.step == 7:
            raise KeyboardInterrupt

    interrupted = trainer_on_one_text("eagle3", tmp_path / "stopped", steps=12, checkpoint_seconds=3600, **loop)
    with pytest.raises(KeyboardInterrupt):
        interrupted.run(time.monotonic() + 600, interrupt_at_step_7)
    resumed = trainer_on_one_text("eagle3", tmp_path / "stopped", steps=12, **loop)  # finds the checkpoint
    assert resumed.position.step == 7
    resumed.run(time.monotonic() + 600)
    assert resumed.position.step == 12
    for name, tensor in whole.head.state_dict().items():
        assert torch.equal(tensor, resumed.head.state_dict()[name]), name


def test_feature_noise_is_bounded_by_each_positions_size():
    features = torch.randn(2, 5, 16, dtype=torch.bfloat16) * torch.tensor([1.0, 10.0]).view(2, 1, 1)
    torch.manual_seed(0)
    noisy = with_noise(features, 0.3)
    assert noisy.shape == features.shape and noisy.dtype == features.dtype
    size = features.float().abs().mean(dim=-1, keepdim=True)
    change = (noisy.float() - features.float()).abs()
    assert (change <= 0.3 * size * 1.01 + 0.1 * features.float().abs()).all()  # bf16 rounding aside
    assert change.mean() > 0.05 * size.mean()


def test_a_run_from_before_a_setting_existed_resumes_at_its_default(tmp_path):
    settings = TrainHeadSettings("qwen2.5-coder-1.5b", device="cpu").resolved()
    stored = json.loads(json.dumps(settings.deciding_result(), default=str))
    del stored["loop"]["feature_noise"], stored["ttt_length"], stored["device"]  # a run from before --device: the CPU
    stored["max_num_seqs"] = 8  # and from when its batch was recorded as deciding
    (tmp_path / "run.json").write_text(json.dumps(stored))
    check_same_run(tmp_path, settings)  # not refused
    check_same_run(tmp_path, dataclasses.replace(settings, max_num_seqs=3))  # how many at once: not deciding
    with pytest.raises(ConfigError, match=r"other settings \(loop\)"):
        check_same_run(tmp_path, dataclasses.replace(settings, loop=LoopSettings(steps=None, feature_noise=0.1)))


def instructions_file(folder, *lines: str):
    path = folder / f"mine-{len(list(folder.glob('mine-*')))}.jsonl"  # a new file each call
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_users_instructions_are_read_and_a_file_that_cannot_serve_is_refused(tmp_path, caplog):
    path = instructions_file(
        tmp_path,
        '{"prompt": "Summarise this ticket.", "kind": "support"}',
        "",
        '{"prompt": "  Draft a reply to an angry customer. "}',
        json.dumps({"prompt": f"Do this: {SUITES['structured']['count']}"}),
    )
    assert [(i.kind, i.prompt) for i in load_instructions(path)][:2] == [
        ("support", "Summarise this ticket."),
        ("general", "Draft a reply to an angry customer."),
    ]
    TrainHeadSettings("smollm2-135m", device="cpu", instructions=str(path)).resolved()
    assert caplog.text.count("1 instructions hold a benchmark suite's prompt") == 1
    bad = {
        "nothing here": (tmp_path / "missing.jsonl", "cannot read it"),
        "not JSON": (instructions_file(tmp_path, '{"prompt": "a"}', "{prompt"), "line 2: not JSON"),
        "a list": (instructions_file(tmp_path, '["a"]'), "line 1: not an object"),
        "no prompt": (instructions_file(tmp_path, '{"prompt": "a"}', '{"prompt": " "}'), 'line 2: no text in "prompt"'),
        "two forms": (instructions_file(tmp_path, '{"prompt": "a", "text": "b"}'), "holds prompt and text"),
        "no form": (instructions_file(tmp_path, '{"kind": "a"}'), "holds none of prompt, messages and text"),
        "a role": (
            instructions_file(tmp_path, '{"messages": [{"role": "function", "content": "a"}]}'),
            "role 'function'",
        ),
        "no user turn": (
            instructions_file(tmp_path, '{"messages": [{"role": "system", "content": "a"}]}'),
            "does not end with a user turn",
        ),
        "no messages": (instructions_file(tmp_path, '{"messages": []}'), '"messages" is not a list of messages'),
        "an image": (
            instructions_file(tmp_path, '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'),
            "messages[0] holds no text content",
        ),
        "a number of a kind": (instructions_file(tmp_path, '{"prompt": "a", "kind": 5}'), '"kind" not text'),
        "one alone": (instructions_file(tmp_path, '{"prompt": "a"}'), "holds 1 instructions; a head needs at least 2"),
    }
    for case, (file, message) in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_instructions(file)
        with pytest.raises(ConfigError, match="--instructions"):
            TrainHeadSettings("smollm2-135m", device="cpu", instructions=str(file)).resolved()


def test_conversations_and_plain_prompts_are_instructions_too(tmp_path):
    """A "messages" line is the conversation up to its last user turn (a fine-tuning
    file's answers dropped, "developer" read as "system"); a "text" line a plain prompt,
    kept as it is; and each instruction written as a line reads back the same."""
    conversation = {
        "messages": [
            {"role": "developer", "content": "Answer in SQL."},
            {"role": "user", "content": [{"type": "text", "text": "Count "}, {"type": "text", "text": "the rows."}]},
            {"role": "assistant", "content": "SELECT COUNT(*) FROM t;"},
        ],
        "kind": "sql",
    }
    path = instructions_file(tmp_path, json.dumps(conversation), json.dumps({"text": "def add(a, b):\n    "}))
    read = load_instructions(path)
    assert read == [
        Instruction("sql", "Count the rows.", (("system", "Answer in SQL."),)),
        Instruction("general", "def add(a, b):\n    ", templated=False),
    ]
    assert read[0].messages() == [
        {"role": "system", "content": "Answer in SQL."},
        {"role": "user", "content": "Count the rows."},
    ]
    for instruction in [*read, Instruction("code", "Write a loop.")]:
        assert parse_line(json.loads(instruction.to_line())) == instruction


def test_an_agents_conversation_is_answered_with_its_tools_and_tool_turns(tmp_path):
    """A conversation that calls tools keeps them whole: the tools, the assistant's calls
    (arguments given as JSON text read as the object they hold) and the tools' results;
    it may end with a result, which the target answers, and reads back as it was written.
    A template renders it as the chat endpoint renders the same request."""
    answered = {"role": "assistant", "content": "It is 21 degrees."}  # dropped: the target writes its own
    messages = [*SENT_TOOL_CONVERSATION, answered]
    path = instructions_file(
        tmp_path,
        json.dumps({"messages": messages, "tools": TOOLS, "kind": "agent"}),
        json.dumps({"messages": messages[:1], "tools": TOOLS}),
    )
    after_result, first = load_instructions(path)
    assert after_result.kind == "agent" and after_result.prompt == "Weather in Paris?"
    assert after_result.messages() == TOOL_CONVERSATION and after_result.tools() == TOOLS
    assert first.messages() == TOOL_CONVERSATION[:1] and first.tools() == TOOLS
    assert '{"city": "Paris"}' in after_result.texts() and '{"temp_c": 21}' in after_result.texts()
    for instruction in (after_result, first):
        assert parse_line(json.loads(instruction.to_line())) == instruction
    tokenizer = Tokenizer.from_gguf(_smollm2_gguf())
    assert after_result.prompt_ids(tokenizer) == tokenizer.encode_chat(TOOL_CONVERSATION, tools=TOOLS)


def test_qwens_template_lists_an_agents_tools_and_results():
    instruction = from_messages(SENT_TOOL_CONVERSATION, "agent", TOOLS)
    tokenizer = Tokenizer.from_gguf(_qwen05_gguf())
    rendered = tokenizer.decode(instruction.prompt_ids(tokenizer))
    assert "get_weather" in rendered and '{"temp_c": 21}' in rendered and rendered.endswith("assistant\n")
    assert instruction.prompt_ids(tokenizer) == tokenizer.encode_chat(TOOL_CONVERSATION, tools=TOOLS)


@pytest.mark.parametrize(
    "line, error",
    [
        ({"messages": [{"role": "user", "content": "Hi"}], "tools": "get_weather"}, "not a list of tool objects"),
        ({"prompt": "Hi", "tools": []}, '"tools" goes with "messages" alone'),
        ({"messages": [{"role": "tool", "content": "21"}]}, "no user turn holds text"),
        (
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [{"id": "c1"}]}]},
            "not a list of calls",
        ),
    ],
)
def test_a_malformed_agent_conversation_is_refused_naming_the_fault(tmp_path, line, error):
    path = instructions_file(tmp_path, json.dumps(line), '{"prompt": "a"}')
    with pytest.raises(ConfigError, match=re.escape(error)):
        load_instructions(path)


def test_instructions_are_read_once_whatever_they_hold(tmp_path, caplog):
    """A repeated line is read once (a copy of a held-out instruction would otherwise be
    trained on), and text JSON leaves unescaped (U+2028, U+0085) stays in its line."""
    odd = Instruction("chat", "one\u2028two\x85three")
    path = instructions_file(tmp_path, odd.to_line(), '{"prompt": "a"}', odd.to_line(), '{"prompt": "a"}')
    assert load_instructions(path) == [odd, Instruction("general", "a")]
    with caplog.at_level("INFO", logger="specserve"):
        TrainHeadSettings("smollm2-135m", device="cpu", instructions=str(path)).resolved()
    assert "2 lines repeat an instruction before them, read once" in caplog.text


def test_a_run_on_a_users_instructions_resumes_only_on_the_same_ones(tmp_path):
    """Their digest decides, not where the file lies: moved, the run resumes; edited, it
    is refused until run with --force."""
    path = instructions_file(tmp_path, '{"prompt": "a"}', '{"prompt": "b"}')
    settings = TrainHeadSettings("qwen2.5-coder-1.5b", device="cpu", instructions=str(path)).resolved()
    assert settings.instructions == str(path.resolve()) and len(settings.instructions_sha256) == 64
    check_same_run(tmp_path / "work", settings)
    moved = path.rename(tmp_path / "moved.jsonl")
    check_same_run(tmp_path / "work", dataclasses.replace(settings, instructions=str(moved)).resolved())
    moved.write_text('{"prompt": "a"}\n{"prompt": "c"}\n')
    edited = dataclasses.replace(settings, instructions=str(moved)).resolved()
    with pytest.raises(ConfigError, match=r"other settings \(instructions_sha256\)"):
        check_same_run(tmp_path / "work", edited)
    bundled = TrainHeadSettings("qwen2.5-coder-1.5b", device="cpu").resolved()
    assert bundled.instructions is None and bundled.instructions_sha256 is None


def test_auto_settings_resolve_for_the_device():
    on_cpu = TrainHeadSettings("smollm2-135m", device="cpu").resolved()
    assert (on_cpu.device, on_cpu.quantization, on_cpu.max_num_seqs) == ("cpu", "int4", 8)
    mine = TrainHeadSettings("smollm2-135m", device="cpu", quantization="none", max_num_seqs=3).resolved()
    assert (mine.quantization, mine.max_num_seqs) == ("none", 3)


def test_estimated_acceptance_length_chains_the_steps():
    assert estimated_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert estimated_acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def test_the_draft_vocabulary_keeps_the_most_frequent_ids():
    vocab = DraftVocab.most_frequent(torch.tensor([0, 5, 1, 5, 0, 2]), 3)
    assert vocab.target_ids.tolist() == [1, 3, 5]  # the 2 (once) beats the unseen ids
    assert vocab.row_of.tolist() == [-1, 0, -1, 1, -1, 2]


def normalised(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def test_instructions_are_varied_and_share_no_prompt_with_the_benchmark_suites():
    instructions = load_instructions()
    assert len(instructions) >= 250
    assert {"code", "structured", "explanation", "chat", "math", "rewriting"} <= {i.kind for i in instructions}
    prompts = [normalised(i.prompt) for i in instructions]
    assert len(set(prompts)) == len(prompts)
    for suite in SUITES.values():
        for benchmark_prompt in map(normalised, suite.values()):
            assert not [p for p in prompts if benchmark_prompt in p or p in benchmark_prompt], benchmark_prompt


# ---- the command, end to end on SmolLM2-135M ----

TINY_RUN = [
    "--quantization",
    "none",
    "--max-answers",
    "3",
    "--answer-rounds",
    "2",
    "--answer-tokens",
    "12",
    "--written-instructions",
    "1",
    "--stdlib-tokens",
    "48",
    "--draft-vocab-size",
    "256",
    "--ttt-length",
    "2",
    "--steps",
    "4",
    "--batch-tokens",
    "128",
    "--max-minutes",
    "10",
]


@pytest.fixture
def smollm2(prepared_cache, tmp_path, monkeypatch):
    """The prepared SmolLM2 folder, with the cache moved to tmp_path (heads are written there)."""
    folder = catalogue.prepare("smollm2-135m")
    native.library()  # compiled once into the shared cache, before the cache moves
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    return folder


@pytest.mark.parametrize("device", DEVICES)
def test_the_command_trains_a_head_and_resumes_after_an_interruption(smollm2, tmp_path, capsys, monkeypatch, device):
    command = ["train-head", str(smollm2), "--name", "tiny", "--device", device, *TINY_RUN]
    steps_run = []
    original_step = Trainer.train_step

    def interrupted_step(trainer):
        if trainer.position.step == 2 and not steps_run:
            steps_run.append(trainer.position.step)
            raise KeyboardInterrupt
        return original_step(trainer)

    monkeypatch.setattr(Trainer, "train_step", interrupted_step)
    assert main(command) == 130
    work = tmp_path / "heads" / "tiny.work"
    assert {"answers.jsonl", "data.json", "features", "checkpoint.pt"} <= {p.name for p in work.iterdir()}
    assert torch.load(work / "checkpoint.pt", weights_only=True)["position"]["step"] == 2

    answers = (work / "answers.jsonl").read_text()
    assert main(command) == 0  # the same command resumes: no answer asked again, training goes on
    folder = catalogue.resolve_head("tiny")
    assert folder == tmp_path / "heads" / "tiny" and not work.exists()
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(folder)
    report = json.loads((folder / "training.json").read_text())
    assert report["device"] == device and report["quantization"] == "none"
    assert report["training"]["steps"] == 4 and report["data"]["answers"] == len(answers.splitlines())
    assert report["training"]["layer_start"] == "target" and report["data"]["instructions"] == "bundled"
    assert report["data"]["answers"] == 6 + report["data"]["written_instructions"]
    assert len(report["held_out"]["top1_agreement_per_step"]) == 2 and report["minutes"]["train"] >= 0
    head = load_head(folder, checkpoint.read_config(smollm2), "eagle3")
    assert head.config.draft_vocab_size == 256 and head.config.feature_layers == (2, 15, 27)

    assert main(command) == 0  # trained already: reported, not trained again
    assert "trained already" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, words",
    [
        (["no-such-model"], "neither a catalogue model"),
        (["smollm2-135m", "--max-minutes", "0"], "--max-minutes must be > 0"),
        (["smollm2-135m", "--max-answers", "1"], "--max-answers must be >= 2"),
        (["smollm2-135m", "--name", "a/b"], "--name must be a plain folder name"),
        (["smollm2-135m", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["smollm2-135m", "--written-instructions", "-1"], "--written-instructions must be >= 0"),
        (["smollm2-135m", "--instructions", "/no/such/file.jsonl"], "--instructions /no/such/file.jsonl: cannot read"),
        (["smollm2-135m", "--device", "tpu"], "use auto, cpu, cuda or cuda:N"),
        *([] if torch.cuda.is_available() else [(["smollm2-135m", "--device", "cuda"], "use --device cpu")]),
        *(
            [(["smollm2-135m", "--device", "cuda", "-q", "int4"], "on cuda use --quantization none")]
            if torch.cuda.is_available()
            else []
        ),
    ],
)
def test_refusals_name_the_fix(prepared_cache, capsys, monkeypatch, args, words):
    monkeypatch.setenv("SPECSERVE_CACHE", prepared_cache)
    assert main(["train-head", *args]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("specserve: error: ") and words in err and "Traceback" not in err


def test_an_unknown_method_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["train-head", "smollm2-135m", "--method", "lookahead"])
    assert "invalid choice: 'lookahead'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown head method 'lookahead'"):
        train_head(TrainHeadSettings("smollm2-135m", method="lookahead"))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("method_name", ["eagle3", "medusa"])
def test_answers_recorded_as_generated_equal_a_teacher_forced_read(smollm2, tmp_path, method_name, static):
    """static: the target's steps in a cache pool, as CUDA graphs take them on a GPU
    (train-head there); on the CPU the same static steps run eagerly."""
    target = catalogue.load_model(str(smollm2), torch.float32)
    if static:
        target.decoder.use_cuda_graphs(2, 256)
    spec = METHODS[method_name]().feature_spec(target.config)
    settings = AnswerSettings(3, max_tokens=10, temperature=0.8, max_num_seqs=2, seed=0, rounds=2, written=1)
    answers, stats = answer_instructions(
        target.decoder,
        target.tokenizer,
        settings,
        tmp_path / "answers.jsonl",
        time.monotonic() + 600,
        recorder=AnswerRecorder(spec, top_k=8, folder=tmp_path / "recorded"),
    )
    samples = dict(zip(stats.keys, answers))
    assert sorted(p.stem for p in (tmp_path / "recorded").iterdir()) == sorted(samples)
    # The first instruction of the seeded order is held out, in every round; a round's seeds are its own.
    assert [s.held_out for s in answers[:6]] == [True, False, False] * 2
    assert [s.token_ids for s in answers[:3]] != [s.token_ids for s in answers[3:6]]
    # Then the instruction it wrote (kept, from this seed), trained on, never held out.
    assert stats.keys[6:] == ["written-000000"]
    assert not any(s.held_out for s in answers[6:])
    compute_features(target.decoder, samples, spec, 8, tmp_path / "read", time.monotonic() + 600)
    for key in samples:
        recorded, read = (load_file(str(tmp_path / folder / f"{key}.safetensors")) for folder in ("recorded", "read"))
        for name in ("token_ids", "first_trained", "held_out"):
            assert torch.equal(recorded[name], read[name]), name
        trained = FeatureSet.load(tmp_path / "read", [key]).trained
        # The last token is never fed while generating: its row is zeros, and no trained row
        # reads it. Prompt chunks and decode steps take different float32 kernels: a rounding apart.
        assert torch.allclose(recorded["features"][:-1].float(), read["features"][:-1].float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(recorded["top_ids"][trained], read["top_ids"][trained])
        assert torch.allclose(recorded["top_probs"][trained], read["top_probs"][trained], atol=1e-4)
        assert not recorded["top_probs"][~trained].any()


def test_written_instructions_are_new_and_shown_no_held_out_instruction(smollm2):
    tokenizer = Tokenizer.from_dir(smollm2)
    instructions = load_instructions()
    held_out = set(range(0, len(instructions), 10))
    shown = [i for i in range(len(instructions)) if i not in held_out]
    writer = InstructionWriter(tokenizer, instructions, shown, seed=0, limit=40)
    kinds = sorted({i.kind for i in instructions})
    attempts = list(iter(lambda: writer.take_attempt({"written-000001": {}}), None))
    assert attempts == [0, *range(2, 40)]  # the attempt answered already is skipped
    for attempt in attempts:
        request = tokenizer.decode(writer.prompt_ids(attempt))
        assert not [i for i in held_out if instructions[i].prompt in request]
        shown_kinds = {i.kind for i in instructions if i.prompt in request}
        assert shown_kinds == {kinds[attempt % len(kinds)]}  # each kind in turn
        assert tokenizer.decode(writer.prompt_ids(attempt)) == request  # the same examples every time

    def kept(text: str, finish_reason: str = "stop") -> str | None:
        return writer.kept(tokenizer.encode(text, add_special_tokens=False), finish_reason)

    assert kept('2. "Write a haiku about rust and tides."') == "Write a haiku about rust and tides."
    assert kept("Write a haiku about RUST and tides!") is None  # known already
    assert kept("Name three rivers of Peru.", "length") is None  # cut short
    assert kept(instructions[5].prompt) is None  # a bundled one
    benchmark = next(iter(SUITES["structured"].values()))
    assert kept(f"Please: {benchmark}") is None and kept("  \n ") is None
    assert kept("word " * (WRITE_TOKENS + 1)) is None
    assert kept("Name three rivers of Peru.") == "Name three rivers of Peru."


def test_written_answers_resume_and_fit_the_longest_sequence(smollm2, tmp_path):
    target = catalogue.load_model(str(smollm2), torch.float32)
    settings = AnswerSettings(2, max_tokens=6, temperature=0.8, max_num_seqs=2, seed=0, rounds=1, written=1)
    answers_file = tmp_path / "answers.jsonl"
    answers, stats = answer_instructions(
        target.decoder, target.tokenizer, settings, answers_file, time.monotonic() + 600
    )
    lines = answers_file.read_text()
    written = [r for r in read_answers(answers_file).values() if "written" in r]
    assert written and all(
        r["instruction"] and r["instruction"] in target.tokenizer.decode(r["prompt_ids"]) for r in written
    )
    longest = longest_sequence(target.tokenizer, settings.max_tokens)
    assert max(len(s.token_ids) for s in answers) <= longest
    # Again on the same file: the same samples, no answer asked again.
    again, stats_again = answer_instructions(
        target.decoder, target.tokenizer, settings, answers_file, time.monotonic() + 600
    )
    assert answers_file.read_text() == lines and stats_again.keys == stats.keys and again == answers


def test_the_target_answers_a_users_instructions(smollm2, tmp_path):
    """--instructions: those prompts are what the target answers (the first of the
    seeded order held out), within the longest sequence the file allows."""
    prompts = ["Name a colour.", "Count to three.", "Say hello in French.", "Write one word: " + "very " * 40]
    conversation = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a month."}]
    lines = [*(json.dumps({"prompt": p}) for p in prompts), json.dumps({"messages": conversation})]
    path = instructions_file(tmp_path, *lines, json.dumps({"text": "The capital of France is"}))
    target = catalogue.load_model(str(smollm2), torch.float32)
    settings = AnswerSettings(
        None, max_tokens=4, temperature=0.8, max_num_seqs=2, seed=0, written=0, instructions=str(path)
    )
    answers, stats = answer_instructions(
        target.decoder, target.tokenizer, settings, tmp_path / "answers.jsonl", time.monotonic() + 600
    )
    asked = sorted(s.token_ids[: s.first_trained] for s in answers)
    assert asked == sorted(i.prompt_ids(target.tokenizer) for i in load_instructions(path))
    assert target.tokenizer.encode("The capital of France is") in asked  # a plain prompt: no chat template
    assert [s.held_out for s in answers] == [True, False, False, False, False, False]
    assert max(len(s.token_ids) for s in answers) <= longest_sequence(target.tokenizer, 4, str(path))
    assert longest_sequence(target.tokenizer, 4, str(path)) != longest_sequence(target.tokenizer, 4)


def test_a_prompt_that_fills_the_context_is_not_answered_and_one_near_it_answers_less(smollm2, tmp_path, caplog):
    """A recorded prompt may come near the target's context: its answer gets the room
    left, and one with no room is left out, said once, while the others are answered."""
    target = catalogue.load_model(str(smollm2), torch.float32)
    context = 256  # the engine takes the target's context from its config: a short one reads fast
    target.decoder.config = dataclasses.replace(target.decoder.config, max_position_embeddings=context)
    tokenizer = target.tokenizer

    def text_of(length: int) -> str:  # a plain prompt of `length` tokens
        return tokenizer.decode(([tokenizer.encode("the")[-1]] * length))

    lines = [json.dumps({"prompt": "Name a colour."}), json.dumps({"prompt": "Count to three."})]
    lines += [json.dumps({"text": text_of(context + 5)}), json.dumps({"text": text_of(context - 3)})]
    near = len(Instruction("general", text_of(context - 3), templated=False).prompt_ids(tokenizer))
    assert near < context
    path = instructions_file(tmp_path, *lines)
    settings = AnswerSettings(None, 6, temperature=0.8, max_num_seqs=2, seed=0, written=0, instructions=str(path))
    answers, _ = answer_instructions(
        target.decoder, tokenizer, settings, tmp_path / "answers.jsonl", time.monotonic() + 600
    )
    lengths = sorted(s.first_trained for s in answers)
    assert len(answers) == 3 and lengths[-1] == near
    assert max(len(s.token_ids) for s in answers) <= context
    assert caplog.text.count("1 instructions fill the target's context") == 1


def test_a_budget_too_small_says_how_much_is_needed(smollm2, capsys):
    assert main(["train-head", str(smollm2), "--quantization", "none", "--max-minutes", "0.001"]) == 2
    err = capsys.readouterr().err
    assert "--max-minutes 0.001 is too small" in err and re.search(r"give it at least about [0-9.]+ minutes", err)


def test_a_run_resumed_with_other_settings_is_refused(smollm2):
    settings = TrainHeadSettings(str(smollm2), name="tiny", quantization="none", max_minutes=0.001)
    with pytest.raises(ConfigError, match="too small"):
        train_head(settings)
    with pytest.raises(ConfigError, match="other settings \\(seed\\).*--force"):
        train_head(TrainHeadSettings(str(smollm2), name="tiny", quantization="none", seed=1))


def test_heads_resolve_by_folder_or_name(smollm2, tmp_path):
    with pytest.raises(ModelLoadError, match="`specserve models prepare qwen2.5-coder-1.5b-eagle3` trains it"):
        catalogue.resolve_head("qwen2.5-coder-1.5b-eagle3")
    with pytest.raises(ModelLoadError, match="train one with `specserve train-head"):
        catalogue.resolve_head("nothing-here")
    assert catalogue.resolve_head(str(tmp_path)) == tmp_path
