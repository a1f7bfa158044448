"""The tokenizer a GGUF file embeds, rebuilt as a `tokenizers` backend.

llama.cpp stores the vocabulary under `tokenizer.ggml.*` keys: the token list, their
types, BPE merges (or SentencePiece scores) and a pre-tokenizer name. This module turns
them into the equivalent `tokenizers.Tokenizer`: the same ids, and text split exactly
where llama.cpp splits it for that `tokenizer.ggml.pre` name.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from specserve.errors import ConfigError
from specserve.model.gguf_header import read_gguf_header

# GGUF token types (llama.cpp's llama_token_type) that change how a token is added.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4


def read_gguf_tokenizer_fields(path: str | Path) -> dict[str, Any]:
    """The `tokenizer.*` key/values of a GGUF file (fast: the header only)."""
    return read_gguf_header(path, key_prefix="tokenizer.")


def backend_from_gguf_fields(fields: dict[str, Any]) -> tuple[tokenizers.Tokenizer, bool]:
    """The backend for a GGUF header's `tokenizer.*` values, and whether the model's
    family adds BOS by default (the file's own add_bos_token, if any, overrides it)."""
    model = fields.get("tokenizer.ggml.model")
    if model not in _GGUF_BACKENDS:
        raise ConfigError(
            f"unsupported GGUF tokenizer model tokenizer.ggml.model={model!r}; "
            f"supported: {', '.join(sorted(_GGUF_BACKENDS))}"
        )
    tokens = fields.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ConfigError("the GGUF file has no tokenizer.ggml.tokens")
    if len(set(tokens)) != len(tokens):
        raise ConfigError("the GGUF vocabulary lists a token twice, so its ids are ambiguous")
    token_types = fields.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    backend, add_bos_default = _GGUF_BACKENDS[model](fields, token_types)
    backend.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(token_types)
            if kind in (_CONTROL, _UNKNOWN)
        ]
    )
    # User-defined tokens (Qwen's <tool_call>) are matched whole but, as in the HF
    # tokenizer, are not special: decode keeps them, so tool calls stay parseable.
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == _USER_DEFINED
        ]
    )
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ConfigError(
            f"the GGUF vocabulary has {len(tokens)} tokens but builds a table of "
            f"{backend.get_vocab_size(with_added_tokens=True)}"
        )
    return backend, add_bos_default


# llama.cpp's split regexes. Where llama.cpp spells the contractions out ('[sS]) because
# std::regex lacks (?i:), we keep the original (?i:) of the HF tokenizer.json.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


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
    (
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        _PreTokenizer((r"\p{N}", _GPT2_SPLIT)),
    ),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _PreTokenizer((_QWEN2_SPLIT,))),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"),
        _PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),
    ),
    (("dbrx", "smaug-bpe"), _PreTokenizer((_LLAMA3_SPLIT,))),
]
_PRE_TOKENIZERS = {name: spec for names, spec in _PRE_TOKENIZER_FAMILIES for name in names}


@functools.cache
def byte_to_unicode() -> dict[int, str]:
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
        raise ConfigError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre_name!r}; "
            f"supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    if "tokenizer.ggml.merges" not in fields:
        raise ConfigError("the GGUF byte-level vocabulary has no tokenizer.ggml.merges")
    spell = byte_to_unicode()
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
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
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
    backend = _bpe(
        vocab=vocab,
        merges=merges,
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    # SentencePiece writes spaces as U+2581 and, by default, starts the text with one.
    space_prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if space_prefix else "never", split=False
    )
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
        pairs.append((merge[:cut], merge[cut + 1 :]))
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
