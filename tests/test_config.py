"""--speculative-config parsing, ModelConfig round trips, sampling-parameter checks."""

from __future__ import annotations

import pytest

from specserve.config import DEFAULT_DRAFT_VOCAB_SIZE, DEFAULT_PROMPT_LOOKUP_FIRST, ModelConfig, SpecConfig
from specserve.errors import ConfigError
from specserve.sampling import SamplingParams
from tests.conftest import tiny_config


def test_model_without_method_means_draft_model():
    spec = SpecConfig.parse('{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 7}')
    assert spec == SpecConfig(
        method="draft_model",
        num_speculative_tokens=7,
        model="qwen2.5-coder-0.5b",
        prompt_lookup_first=DEFAULT_PROMPT_LOOKUP_FIRST,
        draft_vocab_size=DEFAULT_DRAFT_VOCAB_SIZE,
    )
    assert spec.draft_confidence_threshold == 0.5
    fixed = SpecConfig.parse({"model": "m", "num_speculative_tokens": 7, "draft_confidence_threshold": 0})
    assert fixed.draft_confidence_threshold == 0.0
    assert spec.quantization is None  # the draft takes the target's --quantization
    assert SpecConfig.parse({"model": "m", "num_speculative_tokens": 7, "quantization": "int4"}).quantization == "int4"
    assert spec.fused is None  # wherever the draft runs in our C kernels (spec/factory.py)
    assert SpecConfig.parse({"model": "m", "num_speculative_tokens": 7, "fused": True}).fused
    assert SpecConfig.parse({"model": "m", "num_speculative_tokens": 7, "fused": False}).fused is False
    assert (
        SpecConfig.parse({"model": "m", "num_speculative_tokens": 7, "prompt_lookup_first": 6}).prompt_lookup_first == 6
    )
    assert (
        SpecConfig.parse({"model": "m", "num_speculative_tokens": 7, "prompt_lookup_first": None}).prompt_lookup_first
        is None
    )
    assert SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 7}).prompt_lookup_first is None


def test_ngram_lookup_bounds():
    spec = SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 3)  # one bound stands for both
    spec = SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 5})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (1, 4)


def test_suffix_decoding_takes_vllms_keys_and_defaults():
    spec = SpecConfig.parse({"method": "suffix"})
    assert spec.num_speculative_tokens == spec.suffix_decoding_max_tree_depth == 24  # as vLLM: k is the depth
    assert (spec.suffix_decoding_max_cached_requests, spec.suffix_decoding_max_spec_factor) == (10000, 1.0)
    assert spec.suffix_decoding_min_token_prob == 0.1 and spec.prompt_lookup_first is None
    spec = SpecConfig.parse(
        '{"method": "suffix", "suffix_decoding_max_tree_depth": 32, "suffix_decoding_max_cached_requests": 0, '
        '"suffix_decoding_max_spec_factor": 2, "suffix_decoding_min_token_prob": 0, "adaptive": false}'
    )
    assert spec.num_speculative_tokens == 32 and spec.suffix_decoding_max_cached_requests == 0
    assert spec.suffix_decoding_max_spec_factor == 2.0 and spec.suffix_decoding_min_token_prob == 0.0
    assert SpecConfig.parse({"method": "suffix", "num_speculative_tokens": 8}).num_speculative_tokens == 8


def test_lookup_answers_is_off_unless_asked():
    assert not SpecConfig.parse({"model": "m", "num_speculative_tokens": 7}).lookup_answers
    spec = SpecConfig.parse({"method": "eagle3", "model": "h", "num_speculative_tokens": 3, "lookup_answers": True})
    assert spec.lookup_answers and spec.prompt_lookup_first == 4


def test_empty_means_no_speculation():
    assert SpecConfig.parse(None) is None and SpecConfig.parse("") is None


@pytest.mark.parametrize(
    "raw, words",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"method": "mlp_speculator", "model": "x", "num_speculative_tokens": 3}', "not implemented yet"),
        ('{"method": "eagle3", "num_speculative_tokens": 3}', 'needs "model": the folder of the head'),
        ('{"method": "eagle", "model": "h"}', "num_speculative_tokens"),
        ('{"method": "medusa", "model": "h", "max_speculative_tokens": 0}', "max_speculative_tokens"),
        (
            '{"method": "eagle3", "model": "h", "num_speculative_tokens": 3, "draft_vocab_size": 32000}',
            "brings its own",
        ),
        ('{"method": "medusa", "model": "h", "fused": true}', "no steps to fuse"),
        ('{"method": "eagle", "model": "h", "num_speculative_tokens": 3, "quantization": "int4"}', 'draft_model" only'),
        ('{"method": "magic", "num_speculative_tokens": 3}', "unknown speculative method"),
        ('{"num_speculative_tokens": 3}', 'needs "method"'),
        ('{"model": "m"}', "num_speculative_tokens"),
        ('{"model": "m", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"model": "m", "num_speculative_tokens": "7"}', "num_speculative_tokens"),
        ('{"method": "draft_model", "num_speculative_tokens": 3}', 'needs "model"'),
        ('{"method": "ngram", "model": "m", "num_speculative_tokens": 3}', 'takes no "model"'),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
            "must not exceed",
        ),
        ('{"model": "m", "num_speculative_tokens": 3, "draft_tp": 2}', "unknown key"),
        ('{"model": "m", "num_speculative_tokens": 3, "draft_confidence_threshold": 1}', "in \\[0, 1\\)"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "draft_confidence_threshold": 0.2}', "and the heads only"),
        ('{"model": "m", "num_speculative_tokens": 3, "quantization": "int3"}', "unknown draft quantization"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "quantization": "int8"}', 'draft_model" only'),
        ('{"model": "m", "num_speculative_tokens": 3, "fused": "yes"}', "fused must be true or false"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "fused": true}', "no steps to fuse"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_first": 4}', "always looks up"),
        ('{"model": "m", "num_speculative_tokens": 3, "prompt_lookup_first": 0}', "integer >= 1, got 0"),
        ('{"model": "m", "num_speculative_tokens": 3, "prompt_lookup_first": true}', "integer >= 1, got True"),
        ('{"method": "suffix", "model": "m"}', 'takes no "model"'),
        ('{"model": "m", "num_speculative_tokens": 3, "lookup_answers": 1}', "lookup_answers must be true or false"),
        ('{"model": "m", "num_speculative_tokens": 3, "lookup_answers": true, "prompt_lookup_first": null}', "needs"),
        ('{"method": "suffix", "lookup_answers": true}', "looks up alone"),
        ('{"method": "suffix", "prompt_lookup_max": 4}', 'apply to "ngram"'),
        ('{"method": "suffix", "prompt_lookup_first": 4}', "always looks up"),
        ('{"method": "suffix", "suffix_decoding_max_tree_depth": 1}', "max_tree_depth must be an integer >= 2"),
        ('{"method": "suffix", "suffix_decoding_max_cached_requests": -1}', "0 keeps no answers"),
        ('{"method": "suffix", "suffix_decoding_max_spec_factor": "2"}', "max_spec_factor must be a number >= 0"),
        ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "min_token_prob must be a number in"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 8}', 'suffix" only'),
    ],
)
def test_bad_speculative_configs_say_what_is_wrong(raw, words):
    with pytest.raises(ConfigError, match=words):
        SpecConfig.parse(raw)


def test_model_config_round_trips_through_hf_format(arch):
    config = tiny_config(arch, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_unknown_architecture_is_refused():
    with pytest.raises(ConfigError, match="unsupported model architecture 'gemma3'"):
        ModelConfig.from_hf({**tiny_config("llama").to_hf(), "model_type": "gemma3"})


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        SamplingParams(**kwargs)
