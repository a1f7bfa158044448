"""Frozen configuration records: the model's shape and the speculative config.

`ModelConfig` is the one description of a Llama-family decoder that every loader
produces (GGUF header, Hugging Face `config.json`) and the decoder consumes; it
round-trips through the Hugging Face `config.json` format so a prepared artifact is an
ordinary checkpoint folder. `SpecConfig` parses vLLM's `--speculative-config` JSON.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from specserve.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Architecture:
    """What distinguishes one member of the Llama family from another."""

    hf_model_type: str
    hf_class_name: str
    attention_bias: bool  # q/k/v projections carry biases (qwen2)
    qk_norm: bool  # RMSNorm on each head of q and k before RoPE (qwen3)


# The one registry of architectures: keyed by GGUF `general.architecture` and
# Hugging Face `model_type`, which agree for this family.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "LlamaForCausalLM", attention_bias=False, qk_norm=False),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", attention_bias=True, qk_norm=False),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", attention_bias=False, qk_norm=True),
}


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ConfigError(f"unsupported model architecture {name!r}; specserve runs: {known}") from None


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # a key of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Hugging Face `rope_scaling` dict ("llama3", "linear", ...) or None.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        architecture(self.arch)  # fail early on an unknown family member
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def architecture(self) -> Architecture:
        return ARCHITECTURES[self.arch]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face `config.json` dict."""
        model_type = cfg.get("model_type")
        if model_type is None:
            raise ConfigError("config.json has no 'model_type'; is this a Hugging Face checkpoint?")
        arch = architecture(model_type)
        num_heads = cfg["num_attention_heads"]
        return cls(
            arch=arch.hf_model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # transformers 5 writes `rope_parameters`, older releases `rope_scaling`.
            rope_scaling=_scaling_or_none(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face `config.json` dict that `from_hf` and transformers both read."""
        arch = self.architecture
        cfg: dict[str, Any] = {
            "architectures": [arch.hf_class_name],
            "model_type": arch.hf_model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": arch.attention_bias,
            "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = self.rope_scaling
        return cfg


def _scaling_or_none(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Hugging Face writes `{"rope_type": "default"}` for no scaling at all."""
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    return None if kind in (None, "default") else dict(scaling)


# Most prompt tokens one step prefills, over all sequences: a longer prompt goes in
# chunks, so running sequences keep decoding (the target's and the draft's prefill alike).
DEFAULT_PREFILL_CHUNK_SIZE = 512
# On a CPU a chunk's step holds every running request's next token for as long as it
# reads the chunk, and reading one in smaller chunks costs no more in all: see
# benchmarks/EXPERIMENTS.md, "Prefill chunks on a CPU".
CPU_PREFILL_CHUNK_SIZE = 64


def prefill_chunk_size_for(device: torch.device) -> int:
    """The default --prefill-chunk-size of models running on `device`."""
    return CPU_PREFILL_CHUNK_SIZE if device.type == "cpu" else DEFAULT_PREFILL_CHUNK_SIZE


# Weight formats of the linear layers (model/quant.py): --quantization, and a draft's own.
QUANTIZATIONS = ("none", "int8", "int4")

SPEC_METHODS = ("draft_model", "ngram", "suffix", "eagle", "eagle3", "medusa")
# Proposers that read tokens alone: no "model".
LOOKUP_METHODS = ("ngram", "suffix")
# Heads that draft from the target's features (spec/heads/): "model" is the head's folder.
HEAD_METHODS = ("eagle", "eagle3", "medusa")
# A match this long was right 68-95% of the time on the suites' prompts (int4 target);
# shorter ones (2-3 tokens) 6-60%, where a wrong lookup of 7 tokens costs ~1.6 plain steps.
DEFAULT_PROMPT_LOOKUP_FIRST = 4
# The draft's common ids (SpecConfig.draft_vocab_size): on the default 0.5B draft a step
# with this head is cheaper than with the whole head (151936 ids), and its guesses match
# the target's about as often on English and code (benchmarks/EXPERIMENTS.md, "The draft
# guesses over its common ids while the text keeps to them").
DEFAULT_DRAFT_VOCAB_SIZE = 65536
FUTURE_SPEC_METHODS = ("mlp_speculator",)


def check_int(value: Any, message: str, at_least: int = 1) -> None:
    """Raise ConfigError(message) unless `value` is an int (not a bool) >= at_least."""
    if not isinstance(value, int) or isinstance(value, bool) or value < at_least:
        raise ConfigError(message)


def check_number(value: Any, name: str, low: float, high: float | None = None, high_open: bool = False) -> float:
    """`value` as a float; ConfigError naming `name` unless it is a number (not a bool)
    in [low, high] ([low, high) with high_open; >= low without high)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or value < low or (high is not None and (value >= high if high_open else value > high)):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(f"{name} must be a number {bounds}, got {value!r}")
    return float(value)


# Adaptive k's bound where max_speculative_tokens is unstated (and num_speculative_tokens below it).
DEFAULT_MAX_SPECULATIVE_TOKENS = 15


@dataclass(frozen=True)
class SpecConfig:
    """vLLM's `--speculative-config`: which proposer drafts, and how many tokens."""

    method: str
    # None for "medusa" until its heads are counted (`for_medusa_heads`): k defaults to them.
    num_speculative_tokens: int | None
    model: str | None = None  # the draft (catalogue name or path), or the head's folder (HEAD_METHODS)
    prompt_lookup_min: int = 1  # n-gram sizes tried, longest first (ngram only)
    prompt_lookup_max: int = 4
    # Our addition to vLLM's keys (draft_model and heads): a draft stops early after a
    # guess it gives less probability than this, so num_speculative_tokens is a maximum.
    # Measured on the default pair it keeps open-ended text near plain speed while
    # leaving structured prompts untouched; 0 drafts exactly k tokens, as vLLM does. A
    # head's confidence predicts acceptance too (EAGLE-2 grows its tree by it).
    draft_confidence_threshold: float = 0.5
    # Our addition: choose each request's k per step from its acceptance and the
    # measured costs (spec/adaptive.py), from 0 (plain decoding) up to
    # max_speculative_tokens. False drafts num_speculative_tokens every step, as vLLM.
    adaptive: bool = True
    # Adaptive only; parse() makes it >= num_speculative_tokens (None for "medusa": its heads).
    max_speculative_tokens: int | None = DEFAULT_MAX_SPECULATIVE_TOKENS
    # Adaptive only: the most tokens a lookup first drafts (engine.py), which costs
    # nothing to draft: max_speculative_tokens, or for "medusa", whose heads bound that
    # unless it is given, DEFAULT_MAX_SPECULATIVE_TOKENS.
    max_lookup_tokens: int | None = DEFAULT_MAX_SPECULATIVE_TOKENS
    # vLLM's key: the draft's weight format ("none", "int8", "int4"); None = the target's
    # --quantization. A draft need not match the target's numbers (its guesses are
    # verified), so an int4 draft in front of a float32 target costs a third as much.
    quantization: str | None = None
    # Our addition (draft_model only): greedy requests draft all k tokens, and the target
    # verifies them, in one call into our C kernels (spec/fused.py), with no Python
    # between the steps. Needs a quantized draft; the verification joins the call when
    # the target is quantized too, else it stays a PyTorch forward. None (the default):
    # wherever the draft runs in our C kernels; true: refused where it cannot.
    fused: bool | None = None
    # Our addition (draft_model only), as EAGLE-3's draft_vocab_size: the draft guesses
    # only token ids below this while a sequence's recent text keeps to them
    # (Decoder.add_common_head, spec/draft_model.py), so its head reads that share of its
    # rows; at or past the vocabulary's size, or null, every id always. parse() gives a
    # draft model DEFAULT_DRAFT_VOCAB_SIZE.
    draft_vocab_size: int | None = None
    # Our addition (draft_model and heads): where a sequence's last this-many tokens
    # occurred earlier in it, the tokens that followed them are its draft (a prompt
    # lookup, free) and the proposer does not run for it that step (engine/engine.py);
    # None = always the proposer. parse() gives DEFAULT_PROMPT_LOOKUP_FIRST to all but
    # "ngram"; null turns it off.
    prompt_lookup_first: int | None = None
    # Our addition (with prompt_lookup_first): the lookup also reads the answers of
    # earlier requests, as "suffix" does, each match of prompt_lookup_first tokens or
    # more drafting what most of its occurrences went on with.
    lookup_answers: bool = False
    # vLLM's keys of "suffix" (spec/suffix.py): the longest match plus draft, in tokens
    # (also num_speculative_tokens where that is unstated); how many finished answers
    # are kept to draft from (0: each request drafts from its own text alone); the
    # longest draft as a multiple of the match; the least estimated probability a
    # drafted token may have.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def for_medusa_heads(self, num_heads: int) -> SpecConfig:
        """This config settled by a Medusa checkpoint of `num_heads` heads (head i guesses
        draft position i): num_speculative_tokens defaults to the head count (as in
        vLLM), max_speculative_tokens too where adaptive, and neither may pass it."""
        k = self.num_speculative_tokens or num_heads
        most = self.max_speculative_tokens or (num_heads if self.adaptive else k)
        for key, value in (("num_speculative_tokens", k), ("max_speculative_tokens", most)):
            if value > num_heads:
                raise ConfigError(
                    f"{key} is {value}, but the Medusa checkpoint has {num_heads} heads, one per "
                    f"draft position: give at most {num_heads}"
                )
        return dataclasses.replace(self, num_speculative_tokens=k, max_speculative_tokens=most)

    def describe_k(self) -> str:
        most = self.max_speculative_tokens or "(the Medusa head count)"  # None until for_medusa_heads
        k = f"adaptive k in 0..{most}" if self.adaptive else f"k={self.num_speculative_tokens or most}"
        if self.prompt_lookup_first:
            k += f", looking up the last {self.prompt_lookup_first} tokens first"
        return k

    @classmethod
    def parse(cls, raw: str | dict[str, Any] | None) -> SpecConfig | None:
        """Parse the JSON of `--speculative-config`; None or empty means no speculation."""
        if raw is None or raw == "":
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"--speculative-config is not valid JSON ({e.msg} at position {e.pos}); "
                    'example: \'{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 7}\''
                ) from None
        if not isinstance(raw, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"--speculative-config has unknown key(s) {unknown}; known keys: {sorted(known)}")
        method = raw.get("method") or ("draft_model" if raw.get("model") else None)
        if method is None:
            raise ConfigError(f'--speculative-config needs "method" (one of {list(SPEC_METHODS)}) or a draft "model"')
        if method in FUTURE_SPEC_METHODS:
            raise ConfigError(f"speculative method {method!r} is not implemented yet; use one of {list(SPEC_METHODS)}")
        if method not in SPEC_METHODS:
            raise ConfigError(f"unknown speculative method {method!r}; use one of {list(SPEC_METHODS)}")
        suffix = _suffix_settings(raw, method)
        k = raw.get("num_speculative_tokens", suffix.get("suffix_decoding_max_tree_depth"))
        if k is not None or method != "medusa":
            check_int(k, f"--speculative-config needs num_speculative_tokens as an integer >= 1, got {k!r}")
        model = raw.get("model")
        if method not in LOOKUP_METHODS and not model:
            what = "a catalogue name or a path" if method == "draft_model" else "the folder of the head's checkpoint"
            raise ConfigError(f'method "{method}" needs "model": {what}')
        if method in LOOKUP_METHODS and model:
            raise ConfigError(f'method "{method}" takes no "model"; drop it or use "draft_model"')
        if method in LOOKUP_METHODS and "draft_confidence_threshold" in raw:
            raise ConfigError('draft_confidence_threshold applies to "draft_model" and the heads only')
        if method == "suffix" and {"prompt_lookup_min", "prompt_lookup_max"} & set(raw):
            raise ConfigError('prompt_lookup_min and prompt_lookup_max apply to "ngram"; "suffix" matches any length')
        # As in vLLM: one bound given alone stands for both.
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo, hi = cls.prompt_lookup_min, cls.prompt_lookup_max
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            check_int(value, f"{name} must be an integer >= 1, got {value!r}")
        if lo > hi:
            raise ConfigError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        threshold = check_number(
            raw.get("draft_confidence_threshold", cls.draft_confidence_threshold),
            "draft_confidence_threshold",
            0,
            1,
            high_open=True,
        )
        adaptive = raw.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ConfigError(f"adaptive must be true or false, got {adaptive!r}")
        # Unstated for "medusa": the heads bound it (`for_medusa_heads`), whatever k is.
        unstated_max = max(DEFAULT_MAX_SPECULATIVE_TOKENS, k or 1) if adaptive else k
        max_k = raw.get("max_speculative_tokens", None if k is None or method == "medusa" else unstated_max)
        if max_k is not None:
            check_int(
                max_k,
                f"max_speculative_tokens must be an integer >= num_speculative_tokens ({k or 1}), got {max_k!r}",
                at_least=k or 1,
            )
        max_lookup = (max_k or unstated_max) if adaptive else None
        quantization = raw.get("quantization")
        if quantization is not None:
            if method != "draft_model":
                raise ConfigError('quantization applies to "draft_model" only')
            if quantization not in QUANTIZATIONS:
                raise ConfigError(
                    f"unknown draft quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}"
                )
        fused = raw.get("fused")
        if fused is not None and not isinstance(fused, bool):
            raise ConfigError(f"fused must be true or false, got {fused!r}")
        if fused and method != "draft_model":
            raise ConfigError(f'fused applies to "draft_model" only: method "{method}" has no steps to fuse in C')
        if method != "draft_model" and raw.get("draft_vocab_size") is not None:
            raise ConfigError('draft_vocab_size applies to "draft_model" only (an EAGLE-3 head brings its own)')
        draft_vocab_size = raw.get("draft_vocab_size", DEFAULT_DRAFT_VOCAB_SIZE if method == "draft_model" else None)
        if draft_vocab_size is not None:
            check_int(draft_vocab_size, f"draft_vocab_size must be an integer >= 1, got {draft_vocab_size!r}")
        lookup_first = raw.get(
            "prompt_lookup_first", DEFAULT_PROMPT_LOOKUP_FIRST if method not in LOOKUP_METHODS else None
        )
        if lookup_first is not None:
            if method in LOOKUP_METHODS:
                raise ConfigError(f'prompt_lookup_first does not apply to "{method}", which always looks up')
            check_int(lookup_first, f"prompt_lookup_first must be an integer >= 1, got {lookup_first!r}")
        lookup_answers = raw.get("lookup_answers", False)
        if not isinstance(lookup_answers, bool):
            raise ConfigError(f"lookup_answers must be true or false, got {lookup_answers!r}")
        if lookup_answers and method in LOOKUP_METHODS:
            raise ConfigError(f'lookup_answers applies to "draft_model" and the heads; "{method}" looks up alone')
        if lookup_answers and not lookup_first:
            raise ConfigError("lookup_answers reads earlier answers in the lookup first: it needs prompt_lookup_first")
        if not adaptive and "max_speculative_tokens" in raw:
            raise ConfigError('max_speculative_tokens applies to "adaptive": true only')
        return cls(
            method=method,
            num_speculative_tokens=k,
            adaptive=adaptive,
            max_speculative_tokens=max_k,
            max_lookup_tokens=max_lookup,
            model=model,
            prompt_lookup_min=lo,
            prompt_lookup_max=hi,
            draft_confidence_threshold=threshold,
            quantization=quantization,
            fused=fused,
            draft_vocab_size=draft_vocab_size,
            prompt_lookup_first=lookup_first,
            lookup_answers=lookup_answers,
            **suffix,
        )


def _suffix_settings(raw: dict[str, Any], method: str) -> dict[str, Any]:
    """The suffix_decoding_* keys of a "suffix" config, checked (none for other methods)."""
    given = {key: raw[key] for key in raw if key.startswith("suffix_decoding_")}
    if method != "suffix":
        if given:
            raise ConfigError(f'{", ".join(sorted(given))} apply to method "suffix" only')
        return {}
    settings = {f.name: f.default for f in fields(SpecConfig) if f.name.startswith("suffix_decoding_")} | given
    check_int(
        settings["suffix_decoding_max_tree_depth"],
        f"suffix_decoding_max_tree_depth must be an integer >= 2, got {settings['suffix_decoding_max_tree_depth']!r}",
        at_least=2,
    )
    check_int(
        settings["suffix_decoding_max_cached_requests"],
        "suffix_decoding_max_cached_requests must be an integer >= 0 (0 keeps no answers), got "
        f"{settings['suffix_decoding_max_cached_requests']!r}",
        at_least=0,
    )
    for key, low, high in (("suffix_decoding_max_spec_factor", 0, None), ("suffix_decoding_min_token_prob", 0, 1)):
        settings[key] = check_number(settings[key], key, low, high)
    return settings
