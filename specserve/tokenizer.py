"""Text <-> token ids: the vocabulary, the chat template, and streaming detokenization.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library) built either from an HF
checkpoint folder or from the tokenizer a GGUF file embeds under llama.cpp's
`tokenizer.*` keys; `IncrementalDetokenizer` turns ids into text as they stream out.

Invariants:
- Ids are the model's ids: a GGUF token keeps the index the file gives it, and
  `vocab_size` counts every entry of the file's token list.
- `encode(text)` prepends BOS only when `add_bos` says the model wants it; special
  tokens written in the text ("<|im_start|>") become their ids, never pieces of them.
- The GGUF pre-tokenizers split text exactly where llama.cpp splits it for that
  `tokenizer.ggml.pre` name, so ids agree with llama.cpp and with the HF original.
- `IncrementalDetokenizer` never emits a partial UTF-8 character, and what it emits
  joins up to `decode(output_ids)`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from specserve.errors import ConfigError, ModelLoadError

# GGUF token types (llama.cpp's llama_token_type) that change how a token is added.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# Special tokens that end a turn. Like llama.cpp (and HF generation configs, which
# list e.g. both <|im_end|> and <|endoftext|> for Qwen), we stop on these as well as
# on the declared eos, so a chat model that closes its turn does not run on.
_END_OF_TURN_TOKENS = frozenset({
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
    "<|end_of_text|>", "<EOT>", "<｜end▁of▁sentence｜>",
})

# How many prompt tokens the detokenizer decodes in front of the output, as vLLM does,
# so that the first output token is decoded in context.
_DETOKENIZE_CONTEXT_TOKENS = 5


# --- GGUF header -----------------------------------------------------------------------

_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                        10: "Q", 11: "q", 12: "d"}


def read_gguf_tokenizer_fields(path: str | Path) -> dict[str, Any]:
    """The `tokenizer.*` key/values of a GGUF file as python values.

    Walks only the key/value header (no tensor info, no weights): about 0.1 s for a
    152k-token vocabulary, where `gguf.GGUFReader` takes several seconds because it
    indexes every tensor and wraps every array element in numpy.
    """
    path = Path(path)
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _GGUFHeader(data, path).tokenizer_fields()
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as error:
        raise ModelLoadError(f"cannot read the GGUF header of {path}: {error}") from error


class _GGUFHeader:
    """A cursor over a GGUF (v2/v3, little-endian) key/value section."""

    def __init__(self, data: mmap.mmap, path: Path):
        magic, version = struct.unpack_from("<4sI", data, 0)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (it starts with {magic!r})")
        if version not in (2, 3):
            raise ModelLoadError(f"{path} is GGUF version {version}; only versions 2 and 3 are supported")
        self.data, self.offset = data, 8

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return values

    def _string(self, keep: bool = True) -> str | None:
        (length,) = self._unpack("Q")
        start, self.offset = self.offset, self.offset + length
        return self.data[start:self.offset].decode("utf-8") if keep else None

    def _value(self, value_type: int, keep: bool) -> Any:
        if value_type == _GGUF_STRING:
            return self._string(keep)
        if value_type == _GGUF_ARRAY:
            item_type, count = self._unpack("IQ")
            if item_type in _GGUF_SCALAR_FORMATS:  # one unpack for the whole array
                fmt = f"{count}{_GGUF_SCALAR_FORMATS[item_type]}"
                if not keep:
                    self.offset += struct.calcsize("<" + fmt)
                    return None
                return list(self._unpack(fmt))
            items = [self._value(item_type, keep) for _ in range(count)]
            return items if keep else None
        if value_type not in _GGUF_SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF value type {value_type} at byte {self.offset}")
        (value,) = self._unpack(_GGUF_SCALAR_FORMATS[value_type])
        return value

    def tokenizer_fields(self) -> dict[str, Any]:
        _tensor_count, kv_count = self._unpack("QQ")
        fields = {}
        for _ in range(kv_count):
            key = self._string()
            (value_type,) = self._unpack("I")
            keep = key.startswith("tokenizer.")
            value = self._value(value_type, keep)
            if keep:
                fields[key] = value
        return fields


# --- GGUF vocabulary -> tokenizers backend ---------------------------------------------

# llama.cpp's split regexes. Where llama.cpp spells the contractions out ('[sS]) because
# std::regex lacks (?i:), we keep the original (?i:) of the HF tokenizer.json.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _PreTokenizer:
    """How llama.cpp pre-tokenizes for one family of `tokenizer.ggml.pre` names."""

    splits: tuple[str, ...]  # applied in order; matches and the text between them become words
    ignore_merges: bool = False  # a word that is itself a token is not merged up from bytes
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token


_PRE_TOKENIZER_FAMILIES = [
    (("default",), _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"))),
    (("gpt2", "gpt-2", "phi-2", "mpt", "olmo"), _PreTokenizer((_GPT2_SPLIT,))),
    # StarCoder-style vocabularies (SmolLM included) cut every digit off on its own.
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     _PreTokenizer((r"\p{N}", _GPT2_SPLIT))),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _PreTokenizer((_QWEN2_SPLIT,))),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"),
     _PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), _PreTokenizer((_LLAMA3_SPLIT,))),
]
_PRE_TOKENIZERS = {name: spec for names, spec in _PRE_TOKENIZER_FAMILIES for name in names}


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, the alphabet of byte-level vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    unprintable = (byte for byte in range(256) if byte not in spelling)
    spelling.update({byte: chr(256 + n) for n, byte in enumerate(unprintable)})
    return spelling


def _byte_level_backend(fields: dict[str, Any], token_types: list[int]) -> tuple[tokenizers.Tokenizer, bool]:
    """A GPT-2 style byte-level BPE ("gpt2" model) and whether it adds BOS by default."""
    pre_name = fields.get("tokenizer.ggml.pre", "default")
    spec = _PRE_TOKENIZERS.get(pre_name)
    if spec is None:
        raise ConfigError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre_name!r}; "
                          f"supported: {', '.join(sorted(_PRE_TOKENIZERS))}")
    if "tokenizer.ggml.merges" not in fields:
        raise ConfigError("the GGUF byte-level vocabulary has no tokenizer.ggml.merges")
    spell = _byte_to_unicode()
    alphabet = set(spell.values())
    vocab = {}
    for token_id, (token, token_type) in enumerate(zip(fields["tokenizer.ggml.tokens"], token_types)):
        # A normal token spelled outside the byte alphabet would never be produced by
        # the byte-level pre-tokenizer; respell its UTF-8 bytes so it can be. Special
        # tokens stay as written: they are matched in raw text, not through BPE.
        if token_type == _NORMAL and not alphabet.issuperset(token):
            token = "".join(spell[byte] for byte in token.encode("utf-8"))
        vocab[token] = token_id
    backend = _bpe(vocab=vocab, merges=_merge_pairs(fields["tokenizer.ggml.merges"]), ignore_merges=spec.ignore_merges)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in spec.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, spec.add_bos


def _sentencepiece_backend(fields: dict[str, Any], token_types: list[int]) -> tuple[tokenizers.Tokenizer, bool]:
    """A SentencePiece-style BPE with byte fallback ("llama" model); adds BOS by default."""
    tokens = fields["tokenizer.ggml.tokens"]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in fields:
        merges = _merge_pairs(fields["tokenizer.ggml.merges"])
    elif "tokenizer.ggml.scores" in fields:
        merges = _merges_from_scores(tokens, fields["tokenizer.ggml.scores"], token_types)
    else:
        raise ConfigError("the GGUF SentencePiece vocabulary has neither tokenizer.ggml.merges nor .scores")
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    backend = _bpe(vocab=vocab, merges=merges, unk_token=tokens[unk_id] if unk_id is not None else None,
                   fuse_unk=True, byte_fallback=True)
    # SentencePiece writes spaces as U+2581 and, by default, starts the text with one.
    space_prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if space_prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return backend, True


def _bpe(**options: Any) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer(models.BPE(**options))
    except Exception as error:  # tokenizers reports a merge of unknown tokens as a bare Exception
        raise ConfigError(f"the GGUF vocabulary is inconsistent: {error}") from error


def _merge_pairs(merges: Iterable[str]) -> list[tuple[str, str]]:
    # The separator is the first space after position 0, so a merge may start with a
    # token that is itself a space (llama.cpp splits the same way).
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ConfigError(f"malformed GGUF merge {merge!r} (expected 'left right')")
        pairs.append((merge[:cut], merge[cut + 1:]))
    return pairs


def _merges_from_scores(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's "join the best-scoring pair" rule.

    Every way to cut a normal token into two vocabulary tokens becomes a merge ranked
    by the joined token's score (ties: longer left piece first, as transformers does).
    """
    ids = {token: token_id for token_id, token in enumerate(tokens)}
    ranked = []
    for token, score, token_type in zip(tokens, scores, token_types):
        if token_type != _NORMAL:
            continue
        cuts = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ids and token[i:] in ids]
        cuts.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        ranked.extend((score, left, right) for left, right in cuts)
    ranked.sort(key=lambda merge: (merge[0], len(merge[1]), len(merge[2])), reverse=True)
    return [(left, right) for _score, left, right in ranked]


_GGUF_BACKENDS = {"gpt2": _byte_level_backend, "llama": _sentencepiece_backend}


# --- Tokenizer ---------------------------------------------------------------------------

@dataclass(frozen=True)
class VocabSignature:
    """What a draft must share with its target: the id -> token table and the stop ids.

    Trailing `[PAD<id>]` placeholders (llama.cpp's converter pads a vocabulary up to
    the embedding size with them) are left out, so a GGUF and the HF tokenizer it came
    from compare equal.
    """

    num_tokens: int
    tokens_sha256: str
    eos_token_ids: tuple[int, ...]


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids, and the chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 declared_eos_ids: Iterable[int | None], add_bos: bool, chat_template: str | None):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = _end_of_generation_ids(backend, declared_eos_ids)
        if not self.eos_token_ids:
            raise ConfigError("the tokenizer declares no end-of-sequence token, so generation could never stop")
        # The backend's post-processor is the one place BOS gets added, so encode() and
        # anything loading the saved tokenizer.json (transformers) agree.
        if self.add_bos:
            bos = backend.id_to_token(bos_token_id)
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_token_id)])
        else:
            backend.post_processor = None

    # -- construction --

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        return cls.from_gguf_fields(read_gguf_tokenizer_fields(path))

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """Build from a GGUF header's `tokenizer.*` values (see read_gguf_tokenizer_fields)."""
        model = fields.get("tokenizer.ggml.model")
        if model not in _GGUF_BACKENDS:
            raise ConfigError(f"unsupported GGUF tokenizer model tokenizer.ggml.model={model!r}; "
                              f"supported: {', '.join(sorted(_GGUF_BACKENDS))}")
        tokens = fields.get("tokenizer.ggml.tokens") or []
        if not tokens:
            raise ConfigError("the GGUF file has no tokenizer.ggml.tokens")
        if len(set(tokens)) != len(tokens):
            raise ConfigError("the GGUF vocabulary lists a token twice, so its ids are ambiguous")
        token_types = fields.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        backend, add_bos_default = _GGUF_BACKENDS[model](fields, token_types)
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, kind in enumerate(token_types) if kind in (_CONTROL, _UNKNOWN)])
        # User-defined tokens (Qwen's <tool_call>) are matched whole but, as in the HF
        # tokenizer, are not special: decode keeps them, so tool calls stay parseable.
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i, kind in enumerate(token_types) if kind == _USER_DEFINED])
        if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise ConfigError(f"the GGUF vocabulary has {len(tokens)} tokens but builds a table of "
                              f"{backend.get_vocab_size(with_added_tokens=True)}")
        return cls(
            backend,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            declared_eos_ids=[fields.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")],
            add_bos=fields.get("tokenizer.ggml.add_bos_token", add_bos_default),
            chat_template=fields.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Build from an HF checkpoint folder (tokenizer.json, tokenizer_config.json, ...)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as error:  # tokenizers raises a bare Exception for a malformed file
            raise ModelLoadError(f"cannot read {path / 'tokenizer.json'}: {error}") from error
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")
        bos_token_id = _token_id(backend, config.get("bos_token"))
        if bos_token_id is None:
            bos_token_id = model_config.get("bos_token_id")
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:  # e.g. Llama 3: only the tokenizer.json post-processor says so
            add_bos = bos_token_id is not None and backend.encode("").ids[:1] == [bos_token_id]
        return cls(
            backend,
            bos_token_id=bos_token_id,
            declared_eos_ids=[_token_id(backend, config.get("eos_token")),
                              *_as_list(generation.get("eos_token_id")), *_as_list(model_config.get("eos_token_id"))],
            add_bos=add_bos,
            chat_template=_chat_template_in_dir(path, config),
        )

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json + tokenizer_config.json (+ the stop ids in generation_config.json).

        `from_dir` reloads it identically and `transformers.AutoTokenizer` can load it.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(path / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_ids[0]),
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            # Cleaning spaces around punctuation would make decode disagree with ours.
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
        }
        (path / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        generation_file = path / "generation_config.json"
        generation = _read_json(generation_file) | {"eos_token_id": list(self.eos_token_ids)}
        if self.bos_token_id is not None:
            generation["bos_token_id"] = self.bos_token_id
        generation_file.write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")

    # -- text <-> ids --

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS first when `add_special_tokens` and the model wants it."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    # -- chat --

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered the way transformers renders it."""
        template = self._compiled_chat_template()
        try:
            return template.render(
                messages=[dict(message) for message in messages], tools=None, documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.bos_token_id) or "",
                eos_token=self._token_text(self.eos_token_ids[0]))
        except Exception as error:  # the template is the model's code: any failure is a bad request
            raise ConfigError(f"the model's chat template rejected these messages: {error}") from error

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Ids of the templated conversation; BOS is added only if the template did not write it."""
        ids = self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
        if self.add_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def _compiled_chat_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ConfigError("this model has no chat template; send a plain prompt (/v1/completions) instead")
        try:
            return _compile_chat_template(self.chat_template)
        except jinja2.TemplateError as error:
            raise ConfigError(f"the model's chat template does not compile: {error}") from error

    # -- vocabulary identity --

    @functools.cached_property
    def _tokens_by_id(self) -> tuple[str | None, ...]:
        by_id: list[str | None] = [None] * self.vocab_size
        for token, token_id in self._backend.get_vocab(with_added_tokens=True).items():
            if token_id < self.vocab_size:
                by_id[token_id] = token
        while by_id and by_id[-1] == f"[PAD{len(by_id) - 1}]":
            by_id.pop()
        return tuple(by_id)

    def signature(self) -> VocabSignature:
        """Equal for two tokenizers exactly when a draft may propose ids to the other."""
        digest = hashlib.sha256("\0".join(token or "" for token in self._tokens_by_id).encode())
        return VocabSignature(len(self._tokens_by_id), digest.hexdigest(), tuple(sorted(self.eos_token_ids)))

    def vocab_difference(self, other: Tokenizer, names: tuple[str, str] = ("target", "draft")) -> str | None:
        """The first difference between two vocabularies in words, or None if they match."""
        mine, theirs = self._tokens_by_id, other._tokens_by_id
        if len(mine) != len(theirs):
            return f"{names[0]} has {len(mine)} tokens, {names[1]} {len(theirs)}"
        for token_id, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                return f"token {token_id} is {a!r} in {names[0]} but {b!r} in {names[1]}"
        if sorted(self.eos_token_ids) != sorted(other.eos_token_ids):
            return (f"eos differs: {names[0]} stops on {sorted(self.eos_token_ids)}, "
                    f"{names[1]} on {sorted(other.eos_token_ids)}")
        return None


def _end_of_generation_ids(backend: tokenizers.Tokenizer, declared: Iterable[int | None]) -> tuple[int, ...]:
    """The declared eos ids (first one first), then special end-of-turn tokens by id."""
    ids = [token_id for token_id in declared if token_id is not None]
    ids += sorted(token_id for token_id, token in backend.get_added_tokens_decoder().items()
                  if token.special and token.content in _END_OF_TURN_TOKENS)
    return tuple(dict.fromkeys(ids))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ModelLoadError(f"{path} is not valid JSON: {error}") from error


def _as_list(value: int | list[int] | None) -> list[int]:
    return [] if value is None else value if isinstance(value, list) else [value]


def _token_id(backend: tokenizers.Tokenizer, token: str | dict | None) -> int | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    content = token.get("content") if isinstance(token, dict) else token
    return None if content is None else backend.token_to_id(content)


def _chat_template_in_dir(path: Path, config: dict[str, Any]) -> str | None:
    # Newer transformers save the template beside the config; older ones inside it,
    # sometimes as a list of named templates.
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default", next(iter(named.values()), None))
    return template


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> jinja2.Template:
    """A sandboxed template with the environment transformers gives chat templates."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(source)


# --- streaming -------------------------------------------------------------------------

class IncrementalDetokenizer:
    """Streams text as token ids arrive, never splitting a multi-byte character.

    vLLM's prefix/read offsets: decode a window of recent ids, emit what the ids after
    the read offset add to the text, and hold everything back while the window ends in
    U+FFFD (a character whose remaining bytes are still to come). Decoding a short
    window keeps each step O(new tokens) instead of re-decoding the whole output.

    With no prompt context the emitted text joins up to `decode(output_ids)`; with
    context, SentencePiece vocabularies keep the leading space the context implies.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The window: ids[:read_offset] were emitted already (or are prompt context)
        # and are decoded only to know where the new text starts.
        self._ids = list(prompt_ids[-_DETOKENIZE_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)

    def _new_text(self) -> str:
        decode = functools.partial(self._tokenizer.decode, skip_special_tokens=self._skip_special_tokens)
        prefix_text, text = decode(self._ids[:self._read_offset]), decode(self._ids)
        return text[len(prefix_text):]

    def add(self, new_ids: Sequence[int]) -> str:
        """The text the new ids finish (may be "")."""
        self._ids.extend(new_ids)
        new_text = self._new_text()
        if not new_text or new_text.endswith("\ufffd"):
            return ""
        # The old read point becomes the window's start: ids before it are done with.
        del self._ids[:self._read_offset]
        self._read_offset = len(self._ids)
        return new_text

    def flush(self) -> str:
        """Whatever is still held back, incomplete characters included."""
        new_text = self._new_text()
        self._ids, self._read_offset = [], 0
        return new_text
