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

import copy
import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import processors

from specserve.errors import ConfigError, ModelLoadError
from specserve.gguf_vocab import backend_from_gguf_fields, byte_to_unicode, read_gguf_tokenizer_fields

# GGUF token types (llama.cpp's llama_token_type) that change how a token is added.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# Special tokens that end a turn. Like llama.cpp (and HF generation configs, which
# list e.g. both <|im_end|> and <|endoftext|> for Qwen), we stop on these as well as
# on the declared eos, so a chat model that closes its turn does not run on.
_END_OF_TURN_TOKENS = frozenset(
    {
        "<|im_end|>",
        "<|endoftext|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<|end_of_text|>",
        "<EOT>",
        "<｜end▁of▁sentence｜>",
    }
)

# `encode(at_most=N)` reads the first N x MAX_CHARS_PER_TOKEN characters of a longer text
# first: plain text runs 3-5 characters a token, so those make far more than N tokens,
# and a read cut mid-word makes at most CUT_WORD_TOKENS more than the whole text there.
MAX_CHARS_PER_TOKEN = 16
CUT_WORD_TOKENS = 8

# How many prompt tokens the detokenizer decodes in front of the output, as vLLM does,
# so that the first output token is decoded in context.
_DETOKENIZE_CONTEXT_TOKENS = 5


# --- Tokenizer ---------------------------------------------------------------------------

# The roles a conversation may give its turns, as OpenAI's API names them.
CHAT_ROLES = ("system", "developer", "user", "assistant")
# Fill-in-the-middle tokens as the code models that have them spell them: the prefix's,
# the suffix's and the middle's, read in that order (PSM).
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
# What a chat template is given by name; a request's own template variables may not be these.
TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token")


def template_role(role: str) -> str:
    """The role a chat template knows a turn by: "developer" is OpenAI's newer name for "system"."""
    return "system" if role == "developer" else role


def template_arguments(arguments: Any) -> Any:
    """A tool call's arguments as chat templates read them: the object where they are
    JSON text of one (as the API sends them; templates write them with `tojson`), else
    as given."""
    if not isinstance(arguments, str):
        return arguments
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


@functools.cache
def _byte_of_character() -> dict[str, int]:
    """Byte-level BPE's alphabet inverted: the character that spells each byte -> the byte."""
    return {character: byte for byte, character in byte_to_unicode().items()}


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

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        declared_eos_ids: Iterable[int | None],
        add_bos: bool,
        chat_template: str | None,
    ):
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
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_token_id)]
            )
        else:
            backend.post_processor = None

    # -- construction --

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        return cls.from_gguf_fields(read_gguf_tokenizer_fields(path))

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """Build from a GGUF header's `tokenizer.*` values (see read_gguf_tokenizer_fields)."""
        backend, add_bos_default = backend_from_gguf_fields(fields)
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
            declared_eos_ids=[
                _token_id(backend, config.get("eos_token")),
                *_as_list(generation.get("eos_token_id")),
                *_as_list(model_config.get("eos_token_id")),
            ],
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
            "bos_token": self.token_text(self.bos_token_id),
            "eos_token": self.token_text(self.eos_token_ids[0]),
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            # Cleaning spaces around punctuation would make decode disagree with ours.
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
        }
        (path / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        generation_file = path / "generation_config.json"
        generation = _read_json(generation_file) | {"eos_token_id": list(self.eos_token_ids)}
        if self.bos_token_id is not None:
            generation["bos_token_id"] = self.bos_token_id
        generation_file.write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")

    # -- text <-> ids --

    def encode(self, text: str, add_special_tokens: bool = True, at_most: int | None = None) -> list[int]:
        """Token ids of `text`; BOS first when `add_special_tokens` and the model wants it.
        The Rust library releases the GIL in its batch call alone: through it, a long
        text tokenized on a worker thread leaves the others running. at_most: a text
        whose first at_most x MAX_CHARS_PER_TOKEN characters already make more tokens
        (and a margin for the cut word) is refused, ConfigError, before the rest is read,
        so a huge text costs a bounded read."""
        head = None if at_most is None else at_most * MAX_CHARS_PER_TOKEN
        if head is not None and len(text) > head:
            read = self._backend.encode_batch([text[:head]], add_special_tokens=False)[0].ids
            if len(read) > at_most + CUT_WORD_TOKENS:
                raise ConfigError(f"the prompt is more than {at_most} tokens, the maximum model length; shorten it")
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int | None) -> str | None:
        """An id's token as the vocabulary spells it (byte-level BPE's "Ġ" for a space); None for None."""
        return None if token_id is None else self._backend.id_to_token(token_id)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return [self.token_text(token_id) or "" for token_id in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token's own text included). A
        byte-level BPE token may hold part of a UTF-8 character, which `decode` of the
        token alone would turn into U+FFFD; its bytes say exactly what it adds."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self._added_ids:  # written as itself (chat markup)
            return token.encode()
        if isinstance(self._backend.decoder, tokenizers.decoders.ByteLevel):
            byte_of = _byte_of_character()
            return bytes(byte_of[c] for c in token) if all(c in byte_of for c in token) else token.encode()
        # SentencePiece: a byte-fallback piece is its byte; "▁" marks a space.
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace("▁", " ").encode()

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._backend.get_added_tokens_decoder())

    # -- chat --

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text for a conversation (and the tools it may call, in OpenAI's
        form), rendered the way transformers renders it. `template_kwargs` are more
        variables for the template (Qwen3's `enable_thinking`, say); none may be one of
        TEMPLATE_VARIABLES. With `continue_final_message`, the text ends where the last
        message's content ends, so that the model goes on writing it."""
        template = self._compiled_chat_template()
        try:
            text = template.render(
                **(template_kwargs or {}),
                messages=[dict(message) for message in messages],
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.token_text(self.bos_token_id) or "",
                eos_token=self.token_text(self.eos_token_ids[0]),
            )
        except Exception as error:  # the template is the model's code: any failure is a bad request
            raise ConfigError(f"the model's chat template rejected these messages: {error}") from error
        if not continue_final_message:
            return text
        if not messages:
            raise ConfigError("there is no message to continue; drop continue_final_message")
        final = str(messages[-1].get("content") or "").strip()
        if not final:
            raise ConfigError(
                "the final message is empty, so there is nothing to continue; drop continue_final_message"
            )
        end = text.rfind(final)
        if end < 0:
            raise ConfigError("the chat template does not write the final message's content, so it cannot be continued")
        return text[: end + len(final)]

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        at_most: int | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Ids of the templated conversation (`apply_chat_template`'s text); BOS is added
        only if the template did not write it. at_most: as `encode`'s."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs, continue_final_message)
        ids = self.encode(text, add_special_tokens=False, at_most=at_most)
        if self.add_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    @functools.cached_property
    def fim_ids(self) -> tuple[int, int, int] | None:
        """The ids of the vocabulary's fill-in-the-middle tokens (FIM_TOKENS: prefix,
        suffix, middle); None where it has none."""
        for names in FIM_TOKENS:
            ids = [self._backend.token_to_id(name) for name in names]
            if None not in ids:
                return ids[0], ids[1], ids[2]
        return None

    def encode_infill(self, prefix: str | list[int], suffix: str, at_most: int | None = None) -> list[int]:
        """A fill-in-the-middle prompt: the text (or ids) before the gap and the text
        after it, which the model answers with the middle. ConfigError where the
        vocabulary has no FIM tokens; at_most: as `encode`'s, for each text."""
        if self.fim_ids is None:
            raise ConfigError(
                "this model has no fill-in-the-middle tokens, so it cannot fill a gap before a suffix; "
                "send the prompt alone, or use a code model that has them (qwen2.5-coder-1.5b)"
            )
        begin, hole, end = self.fim_ids
        before = prefix if isinstance(prefix, list) else self.encode(prefix, add_special_tokens=False, at_most=at_most)
        after = self.encode(suffix, add_special_tokens=False, at_most=at_most)
        bos = [self.bos_token_id] if self.add_bos else []
        return [*bos, begin, *before, hole, *after, end]

    def use_chat_template(self, source: str) -> None:
        """Render conversations with `source` from now on (ConfigError where it does not compile)."""
        self.chat_template = source
        self._compiled_chat_template()

    def _compiled_chat_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ConfigError("this model has no chat template; send a plain prompt (/v1/completions) instead")
        try:
            return _compile_chat_template(self.chat_template)
        except jinja2.TemplateError as error:
            raise ConfigError(f"the model's chat template does not compile: {error}") from error

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (chat markup, end of turn, padding): not text."""
        return frozenset(
            token_id for token_id, token in self._backend.get_added_tokens_decoder().items() if token.special
        )

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
            return (
                f"eos differs: {names[0]} stops on {sorted(self.eos_token_ids)}, "
                f"{names[1]} on {sorted(other.eos_token_ids)}"
            )
        return None


def _end_of_generation_ids(backend: tokenizers.Tokenizer, declared: Iterable[int | None]) -> tuple[int, ...]:
    """The declared eos ids (first one first), then special end-of-turn tokens by id."""
    ids = [token_id for token_id in declared if token_id is not None]
    ids += sorted(
        token_id
        for token_id, token in backend.get_added_tokens_decoder().items()
        if token.special and token.content in _END_OF_TURN_TOKENS
    )
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

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(source)


# --- streaming -------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Streams text as token ids arrive, never splitting a multi-byte character.

    vLLM's prefix/read offsets: decode a window of recent ids, emit what the ids after
    the read offset add to the text, and hold back the ids of a last character whose
    remaining bytes are still to come (its text U+FFFD; a U+FFFD the model wrote whole,
    or bytes no later byte can make a character of, go out at once). Decoding a short
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

    def copy(self) -> IncrementalDetokenizer:
        """A detokenizer in this one's state that goes on independently (same tokenizer)."""
        other = copy.copy(self)
        other._ids = list(self._ids)
        return other

    def _texts(self) -> tuple[str, str]:
        """The window's text before the read offset, and its whole text."""
        decode = functools.partial(self._tokenizer.decode, skip_special_tokens=self._skip_special_tokens)
        return decode(self._ids[: self._read_offset]), decode(self._ids)

    def _new_text(self) -> str:
        prefix_text, text = self._texts()
        return text[len(prefix_text) :]

    def add(self, new_ids: Sequence[int]) -> str:
        """The text the new ids finish (may be "")."""
        self._ids.extend(new_ids)
        prefix_text, text = self._texts()
        if text == prefix_text:  # ids that add no text (special tokens skipped): read past them
            if len(self._ids) > 2 * _DETOKENIZE_CONTEXT_TOKENS:  # keep the window short
                del self._ids[:-_DETOKENIZE_CONTEXT_TOKENS]
            self._read_offset = len(self._ids)
            return ""
        # Only the ids of a last character still to be finished are held back: the text
        # before it is final, and a run of bytes that never make one keeps the window short.
        end = len(self._ids)
        if text.endswith("\ufffd"):
            end = max(self._unfinished_from(), self._read_offset)
            if end < len(self._ids):
                text = self._tokenizer.decode(self._ids[:end], skip_special_tokens=self._skip_special_tokens)
        new_text = text[len(prefix_text) :]
        if not new_text:
            return ""
        # The old read point becomes the window's start: ids before it are done with.
        del self._ids[: self._read_offset]
        self._read_offset = end - self._read_offset
        return new_text

    def _unfinished_from(self) -> int:
        """Where the window's last character begins (an index into the window's ids) if
        more bytes could still finish it, else the window's end: a character takes at most
        4 bytes, so the last 4 bytes tell."""
        back = 0  # bytes from the window's end
        for index in range(len(self._ids) - 1, -1, -1):
            for byte in reversed(self._tokenizer.token_bytes(self._ids[index])):
                back += 1
                if byte & 0xC0 != 0x80:  # not a continuation byte: the last character starts here
                    needed = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
                    return index if back < needed else len(self._ids)
                if back == 4:  # continuation bytes alone: invalid, whatever comes next
                    return len(self._ids)
        return len(self._ids)

    def flush(self) -> str:
        """Whatever is still held back, incomplete characters included."""
        new_text = self._new_text()
        self._ids, self._read_offset = [], 0
        return new_text
