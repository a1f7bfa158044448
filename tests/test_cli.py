"""`specserve generate` and `specserve models` as a user runs them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.cli import build_parser, main, refuse_vllm_flags

CHAT = ["--model", "smollm2-135m", "--chat", "Count from 1 to 10, separated by commas.", "--max-tokens", "24"]


def specserve(*args: str, cache: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECSERVE_CACHE": cache}
    return subprocess.run(
        [sys.executable, "-m", "specserve.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def plain(prepared_cache):
    result = specserve("generate", *CHAT, "--json", cache=prepared_cache)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_generate_json_has_the_figures(plain):
    for key in ("text", "token_ids", "num_output_tokens", "ttft_s", "tpot_s", "e2e_s", "output_tokens_per_s"):
        assert key in plain
    assert plain["num_output_tokens"] == len(plain["token_ids"]) > 0
    assert plain["spec"] is None
    assert 0 < plain["ttft_s"] <= plain["e2e_s"] and plain["output_tokens_per_s"] > 0
    assert "1, 2, 3" in plain["text"]


@pytest.mark.parametrize(
    "spec",
    [
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}',
        '{"method": "suffix", "adaptive": false}',
        # Fixed k: a draft as large as its target never pays, so adaptive k would not draft.
        '{"model": "smollm2-135m", "num_speculative_tokens": 3, "adaptive": false}',
    ],
)
def test_speculation_from_the_cli_gives_the_same_tokens(plain, prepared_cache, spec):
    result = specserve("generate", *CHAT, "--json", "--speculative-config", spec, cache=prepared_cache)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["token_ids"] == plain["token_ids"]
    assert set(out["spec"]) == {
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "acceptance_rate",
        "mean_acceptance_length",
        "accepted_per_position",
    }
    assert out["spec"]["num_drafts"] > 0


def test_a_prediction_drafts_for_the_answer_and_leaves_it_as_it_is(plain, prepared_cache, tmp_path):
    (tmp_path / "expected.txt").write_text(plain["text"])
    result = specserve(
        "generate", *CHAT, "--json", "--prediction", f"@{tmp_path / 'expected.txt'}", cache=prepared_cache
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["token_ids"] == plain["token_ids"] and plain["prediction"] is None
    assert out["prediction"]["rejected"] == 0 and out["prediction"]["accepted"] > len(plain["token_ids"]) // 2


def test_readable_output_streams_text_then_a_stats_line(prepared_cache, capsys):
    os.environ["SPECSERVE_CACHE"] = prepared_cache  # the fixture restores it afterwards
    assert main(["generate", *CHAT, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']) == 0
    out, err = capsys.readouterr()
    assert "1, 2, 3" in out
    assert "tok/s decode" in err and "acceptance" in err


def test_seeded_sampling_repeats(prepared_cache, capsys):
    os.environ["SPECSERVE_CACHE"] = prepared_cache
    runs = []
    for _ in range(2):
        assert (
            main(
                [
                    "generate",
                    *CHAT,
                    "--json",
                    "--temperature",
                    "0.9",
                    "--top-p",
                    "0.95",
                    "--seed",
                    "7",
                    "--speculative-config",
                    '{"method": "ngram", "num_speculative_tokens": 3}',
                ]
            )
            == 0
        )
        runs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    "flags, answer",
    [
        (["--guided-regex", "1, 2, 3(, [0-9]+){0,3}"], r"1, 2, 3(, [0-9]+){0,3}"),
        (["--guided-choice", "ten", "eleven"], "ten|eleven"),
        (["--guided-grammar", 'root ::= "1, 2, 3" (", " n){0,3}\nn ::= [0-9]+'], r"1, 2, 3(, [0-9]+){0,3}"),
        (["--guided-json", '{"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}'], None),
    ],
)
def test_a_structured_answer_from_the_cli(prepared_cache, capsys, flags, answer):
    os.environ["SPECSERVE_CACHE"] = prepared_cache
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert main(["generate", *CHAT, "--json", *flags, "--speculative-config", spec]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    if answer is None:
        assert json.loads(text)["n"] in (1, 2)
    else:
        assert re.fullmatch(answer, text), text


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["--speculative-config", '{"method": "eagle", "model": "/no/such/head", "num_speculative_tokens": 3}'],
            "is neither a head folder nor a head trained into",
        ),
        (["--speculative-config", "{oops"], "not valid JSON"),
        (["--model", "no-such-model"], "neither a catalogue model"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
        (["--max-model-len", "10"], "maximum model length 10"),
        (["--num-scheduler-steps", "-2"], "--num-scheduler-steps must be >= 1, got -2"),
        (["--min-tokens", "300"], "min_tokens must be an integer in [0, max_tokens] (24), got 300"),
        (["--guided-json", "{bad"], "--guided-json is not valid JSON"),
        (["--guided-json", "@/no/such/schema.json"], "--guided-json @/no/such/schema.json"),
        (["--guided-json", '{"type": "object", "not": {}}'], "keyword 'not' at # is not supported"),
        (["--guided-regex", "(a"], "is not closed"),
        (["--guided-grammar", "root ::= n\nn ::= n n"], "the grammar's rule 'n' refers to itself (n -> n)"),
        (["--guided-grammar", "@/no/such/grammar.gbnf"], "--guided-grammar @/no/such/grammar.gbnf"),
        (["--suffix", "return x"], "--suffix fills the gap after a --prompt; a --chat message has none"),
    ],
)
def test_bad_input_is_one_line_naming_the_fix(prepared_cache, capsys, args, words):
    assert_refused(prepared_cache, capsys, ["generate", *CHAT, *args], words)


def test_a_suffix_needs_a_model_with_fill_in_the_middle_tokens(prepared_cache, capsys):
    argv = ["generate", "--model", "smollm2-135m", "--prompt", "def f():", "--suffix", "    return x"]
    assert_refused(prepared_cache, capsys, argv, "this model has no fill-in-the-middle tokens")


def assert_refused(cache: str, capsys, argv: list[str], words: str) -> None:
    """The command exits 2 with one `specserve: error:` line holding `words`, last, and no
    traceback (a model prepared on the way says so before it)."""
    os.environ["SPECSERVE_CACHE"] = cache
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("specserve: error: ") and words in lines[-1] and "Traceback" not in err
    assert sum(line.startswith("specserve: error: ") for line in lines) == 1


def test_models_lists_the_catalogue(prepared_cache, capsys):
    os.environ["SPECSERVE_CACHE"] = prepared_cache
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-eagle3"):
        assert name in out
    table = out.split("\n\n")[0].splitlines()
    assert len({line.index("installed" if i == 0 else line.split()[2]) for i, line in enumerate(table)}) == 1  # columns
    assert main(["models", "prepare", "no-such-model"]) == 2


def test_models_prepare_makes_the_quantized_weights_once(prepared_cache, capsys):
    os.environ["SPECSERVE_CACHE"] = prepared_cache
    assert main(["models", "prepare", "smollm2-135m", "--quantization", "int8"]) == 0
    path = Path(capsys.readouterr().out.splitlines()[-1])
    assert path.is_file() and path.name.startswith("smollm2-135m-") and "-int8-" in path.name
    stamp = path.stat().st_mtime_ns
    assert main(["models", "prepare", "smollm2-135m", "--quantization", "int8"]) == 0
    assert path.stat().st_mtime_ns == stamp  # there already: not made again


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 3}'],
            'method "medusa" needs "model"',
        ),
        (["--speculative-config", '{"model": "smollm2-135m"}'], "num_speculative_tokens"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--num-scheduler-steps", "0"], "--num-scheduler-steps must be >= 1"),
        (["--prefill-chunk-size", "0"], "--prefill-chunk-size must be >= 1, got 0"),
        (["--max-queue-len", "-1"], "--max-queue-len must be >= 0"),
        (["--port", "65536"], "--port must be in [1, 65535]"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser (hermes, qwen2_5_coder)"),
        (["--max-model-len", "100000"], "--max-model-len must be in"),
        (["--kv-cache-space", "0"], "--kv-cache-space must be auto or a number of GiB > 0, got '0'"),
        (["--kv-cache-space", "lots"], "--kv-cache-space must be auto or a number of GiB > 0"),
        (["--kv-cache-space", "0.001"], "raise --kv-cache-space or lower --max-model-len"),
        (["--chat-template", "no/such/template.jinja"], "is neither a file nor a Jinja template"),
        (["--chat-template", "{% if %}"], "chat template does not compile"),
        (["--default-chat-template-kwargs", "{enable"], "--default-chat-template-kwargs is not valid JSON"),
        (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs must be a JSON object"),
        (["--default-chat-template-kwargs", '{"tools": []}'], "may not set ['tools']"),
        (["--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization is vLLM's; specserve bounds"),
        (["--max-num-batched-tokens", "8192"], "--prefill-chunk-size"),
        (["--seed", "0"], 'send "seed" in its body'),
        (["--download-dir", "/models"], "specserve downloads nothing"),
        (["-tp", "2"], "--tensor-parallel-size must be 1"),
        (["--kv-cache-dtype", "fp8"], "kept in the model's --dtype"),
        (["--allowed-origins", "https://chat.example.com"], "--allowed-origins must be a JSON list of strings"),
        (["--allowed-headers", "[1]"], "--allowed-headers must be a JSON list of strings"),
        (["--root-path", "llm"], "--root-path must start with '/'"),
    ],
)
def test_serve_refuses_a_bad_start_up_with_one_line(prepared_cache, capsys, args, words):
    assert_refused(prepared_cache, capsys, ["serve", "smollm2-135m", "--port", "1", *args], words)


def test_a_chat_template_is_read_from_its_file_or_taken_as_written(tmp_path):
    from specserve.cli import chat_template_of

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template, encoding="utf-8")
    assert chat_template_of(str(tmp_path / "chat.jinja")) == template == chat_template_of(template)
    assert chat_template_of(None) is None


def test_serve_refuses_a_draft_of_another_vocabulary(prepared_cache, capsys, tmp_path):
    import shutil

    from specserve import catalogue

    os.environ["SPECSERVE_CACHE"] = prepared_cache
    folder = tmp_path / "other-vocab"
    shutil.copytree(catalogue.prepare("smollm2-135m"), folder)
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"]
    first = next(t for t, i in vocab.items() if i == 1000)
    vocab[first] = 49151  # one token moves to another id
    vocab[next(t for t, i in vocab.items() if i == 49151 and t != first)] = 1000
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    spec = json.dumps({"model": str(folder), "num_speculative_tokens": 3})
    assert_refused(
        prepared_cache,
        capsys,
        ["serve", "smollm2-135m", "--port", "1", "--speculative-config", spec],
        "does not share the vocabulary",
    )


def test_vllm_flags_for_what_serve_does_anyway_are_taken():
    flags = ["--trust-remote-code", "--disable-log-requests", "--enable-chunked-prefill", "-tp", "1", "-pp", "1"]
    flags += ["--kv-cache-dtype", "auto"]
    args = build_parser().parse_args(["serve", "smollm2-135m", *flags, "--disable-log-stats"])
    refuse_vllm_flags(args)  # nothing refused
    assert args.log_stats_interval == 0 and build_parser().parse_args(["serve"]).log_stats_interval == 10


def test_cors_and_root_path_flags_as_vllm_takes_them():
    from specserve.cli import cors_of, root_path_of

    args = build_parser().parse_args(
        ["serve", "m", "--allowed-origins", '["https://a.example"]', "--allow-credentials"]
    )
    assert cors_of(args) == {"allowed_origins": ("https://a.example",), "allow_credentials": True}
    assert cors_of(build_parser().parse_args(["serve", "m"])) == {}  # ApiSettings' defaults: everything allowed
    assert root_path_of("/llm/") == "/llm" and root_path_of("") == ""
