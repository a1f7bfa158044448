"""benchmarks/peers.py end to end on smollm2-135m (drafting for itself), its roofline
and GGUF helpers, and the quality checks of `specserve.bench.quality`."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import types
from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F

from specserve import catalogue
from specserve.bench.gguf_file import gguf_file, gguf_format
from specserve.bench.quality import common_prefix_length, fixed_text_ids, perplexity, prefix_agreement
from specserve.bench.roofline import (
    arithmetic_of,
    gguf_weight_bytes_per_token,
    measure_dot_peaks,
    measure_read_bandwidth,
    speculation_ceiling,
)
from specserve.errors import ModelLoadError
from specserve.model import native
from specserve.model.decoder import Decoder, Segment
from specserve.model.footprint import multiply_adds_per_token, weight_bytes_per_token
from specserve.spec.heads.checkpoint import save_head
from tests.conftest import tiny_config
from tests.head_models import random_head

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"
SMALL = ["--target", "smollm2-135m", "--draft", "smollm2-135m", "--max-tokens", "8"]
ROW_KEYS = {
    "system",
    "mode",
    "prompt",
    "num_output_tokens",
    "ttft_s",
    "decode_tokens_per_s",
    "acceptance_rate",
    "mean_acceptance_length",
    "format",
    "suite",
    "same_tokens_as_plain",
}


def run_peers(*args: str, cache: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PEERS), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "SPECSERVE_CACHE": cache, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def rows(prepared_cache):
    """Every row on one structured prompt; llama.cpp's too where llama-cpp-python is installed."""
    result = run_peers(*SMALL, "--prompts", "repeat", "--json", cache=prepared_cache)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def has_llama_cpp() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def test_every_mode_has_a_row_with_the_figures(rows):
    timed = [r for r in rows if r["system"] in ("specserve", "transformers")]
    assert sorted((r["system"], r["mode"]) for r in timed) == sorted(
        [("specserve", m) for m in ["plain", "draft", "ngram", "adaptive"]]
        + [("transformers", "plain"), ("transformers", "assisted")]
    )
    for r in timed:
        assert ROW_KEYS <= set(r) and r["prompt"] == "repeat" and r["suite"] == "structured"
        assert r["num_output_tokens"] == len(r["token_ids"]) == 8  # the line is longer than 8 tokens
        # the timed request's first token and 4 more of the same request, stopped there
        assert len(r["ttft_samples_s"]) == 5 and r["ttft_s"] == statistics.median(r["ttft_samples_s"]) > 0
        # transformers' assisted generation may deliver all 8 tokens with its first step: no decode rate then
        assert r["mode"] == "assisted" or r["decode_tokens_per_s"] > 0
    draft = next(r for r in timed if r["mode"] == "draft")
    assert draft["k"] == 7 and draft["mean_acceptance_length"] >= 1 and 0 <= draft["acceptance_rate"] <= 1


def test_speculation_gives_our_plain_tokens(rows):
    assert all(r["same_tokens_as_plain"] for r in rows if r["system"] == "specserve")
    # transformers runs the same float32 weights: its greedy tokens match over 8 tokens.
    assert all(r["agreement_with_plain"] == 1.0 for r in rows if r["system"] == "transformers")


def test_head_rows_run_a_head_folder_and_keep_our_plain_tokens(prepared_cache, tmp_path):
    """eagle3 and medusa rows, with random heads of the target's shape: the tokens are
    plain decoding's whatever the head guesses."""
    config = catalogue.load_model("smollm2-135m", torch.float32, "none").config
    for method in ("eagle3", "medusa"):
        save_head(random_head(method, config, seed=0), tmp_path / method)
    result = run_peers(
        *SMALL,
        "--prompts",
        "count",
        "--modes",
        "plain,eagle3,adaptive-medusa",
        "--peers",
        "",
        "--no-quality",
        "--eagle-head",
        str(tmp_path / "eagle3"),
        "--medusa-head",
        str(tmp_path / "medusa"),
        "--json",
        cache=prepared_cache,
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    ours = {r["mode"]: r for r in rows if r["system"] == "specserve" and "mode" in r}
    assert {"plain", "eagle3", "adaptive-medusa"} <= set(ours)
    assert ours["eagle3"]["k"] == 7 and ours["eagle3"]["same_tokens_as_plain"]
    assert ours["adaptive-medusa"]["same_tokens_as_plain"]


def test_roofline_rows_put_each_plain_decode_under_its_limit(rows):
    roofline = {(r["role"], r["of_system"]): r for r in rows if r["system"] == "roofline"}
    assert set(roofline) == {
        ("target", "specserve"),
        ("draft", "specserve"),
        ("target", "transformers"),
        *([("target", "llama.cpp")] if has_llama_cpp() else []),
    }
    for r in roofline.values():
        assert r["bytes_per_token"] > 50e6 and r["bandwidth_bytes_per_s"] > 1e9
        assert r["limit_tokens_per_s"] == pytest.approx(r["bandwidth_bytes_per_s"] / r["bytes_per_token"])
    ours = roofline[("target", "specserve")]
    assert ours["fraction_of_limit"] == pytest.approx(ours["measured_decode_tokens_per_s"] / ours["limit_tokens_per_s"])
    assert roofline[("draft", "specserve")]["measured_decode_tokens_per_s"] is None


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="no arithmetic peak without our kernels")
def test_ceiling_rows_price_a_row_by_its_arithmetic(rows):
    ceiling = {r["draft"]: r for r in rows if r["system"] == "ceiling"}
    assert set(ceiling) == {"smollm2-135m float32", "free (n-gram, lookup first)"}
    target = next(
        r for r in rows if r["system"] == "roofline" and r["role"] == "target" and r["of_system"] == "specserve"
    )
    draft = next(r for r in rows if r["system"] == "roofline" and r["role"] == "draft")
    for r in ceiling.values():
        assert r["target_format"] == "float32" and r["arithmetic"] == "float32" and r["peak_macs_per_s"] > 1e9
        assert r["plain_step_s"] == pytest.approx(target["bytes_per_token"] / target["bandwidth_bytes_per_s"])
        assert r["verified_row_s"] == pytest.approx(target["macs_per_token"] / r["peak_macs_per_s"])
        assert (r["max_speedup"], r["best_k"]) == pytest.approx(
            speculation_ceiling(r["plain_step_s"], r["verified_row_s"], r["draft_position_s"])
        )
    # the model drafting for itself: a position costs a plain step, so nothing can be gained
    assert ceiling["smollm2-135m float32"]["draft_position_s"] == pytest.approx(
        draft["bytes_per_token"] / draft["bandwidth_bytes_per_s"]
    )
    assert ceiling["smollm2-135m float32"]["max_speedup"] <= 1.0 + 1e-9
    assert ceiling["free (n-gram, lookup first)"]["max_speedup"] > 1.0


@pytest.mark.skipif(not has_llama_cpp(), reason="llama-cpp-python is not installed")
def test_llama_cpp_rows_on_the_gguf_file(rows):
    llama = {r["mode"]: r for r in rows if r["system"] == "llama.cpp"}
    assert set(llama) == {"plain", "prompt-lookup"} and llama["plain"]["format"] == "Q4_1"
    assert llama["prompt-lookup"]["token_ids"] == llama["plain"]["token_ids"]  # lossless in llama.cpp too
    assert llama["prompt-lookup"]["k"] == 7 and llama["prompt-lookup"]["mean_acceptance_length"] >= 1
    assert 0 <= llama["plain"]["agreement_with_plain"] <= 1  # Q4_1 against our float32: may differ
    assert all(len(r["ttft_samples_s"]) == 5 for r in llama.values())


def test_missing_llama_cpp_is_skipped_with_a_message(prepared_cache, tmp_path):
    # A `llama_cpp` that fails to import stands in for llama-cpp-python not being installed.
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text("raise ImportError(\"No module named 'llama_cpp'\")\n")
    result = run_peers(
        *SMALL,
        "--prompts",
        "count",
        "--modes",
        "",
        "--peers",
        "llama.cpp",
        "--json",
        cache=prepared_cache,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    assert "llama.cpp: skipped" in result.stderr and "No module named 'llama_cpp'" in result.stderr
    assert [json.loads(line)["system"] for line in result.stdout.splitlines()] == []


def test_a_unit_that_fails_fails_the_run_with_its_own_error(prepared_cache):
    result = run_peers(
        *SMALL, "--prompts", "count", "--modes", "plain,draft-fused", "--peers", "", "--json", cache=prepared_cache
    )
    assert result.returncode == 1 and result.stdout == ""
    assert '"fused": true runs the draft in our C kernels' in result.stderr  # the unit's own message
    assert "specserve:draft-fused failed" in result.stderr


def test_no_quality_skips_the_float32_run(prepared_cache):
    """bfloat16 asks for the quality section, whose float32 run costs a unit;
    --no-quality leaves it out."""
    flags = [*SMALL, "--prompts", "count", "--modes", "plain", "--peers", "", "--dtype", "bfloat16"]
    with_quality = run_peers(*flags, cache=prepared_cache)
    without = run_peers(*flags, "--no-quality", cache=prepared_cache)
    assert with_quality.returncode == 0 and without.returncode == 0, with_quality.stderr + without.stderr
    assert "plain-float32" in with_quality.stdout and "Quality of bfloat16" in with_quality.stdout
    assert "plain-float32" not in without.stdout and "Quality" not in without.stdout


def test_bad_flags_are_one_line_errors(prepared_cache):
    result = run_peers(*SMALL, "--modes", "plain,turbo", cache=prepared_cache)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]  # the one line naming the fix: the modes there are
    assert "unknown mode(s) ['turbo']; choose from plain, draft" in last and last.endswith("adaptive-medusa")
    result = run_peers(*SMALL, "--device", "cpu", "--cuda-graphs", cache=prepared_cache)
    assert result.returncode == 2 and "--cuda-graphs needs --device cuda" in result.stderr


@pytest.fixture(scope="module")
def peers_module():
    spec = importlib.util.spec_from_file_location("peers", PEERS)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["peers"]


def test_llama_cpp_acceptance_is_counted_from_its_proposals(peers_module):
    tokens = [10, 11, 12, 13, 14, 15]  # the output, after a prompt of 3 tokens
    proposals = [
        (4, [11, 12, 99]),  # after 1 output token: 2 accepted, then a miss
        (7, []),  # no n-gram match: not a draft
        (7, [14, 15, 16]),  # the output ends after 2 of them
        (9, [16]),  # after the last kept token: never verified
    ]
    stats = peers_module.lookup_stats(proposals, prompt_len=3, tokens=tokens)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.mean_acceptance_length == 3.0


def test_quality_rows_compare_the_format_with_float32(peers_module):
    report = peers_module.Report(fixed_text_ids=list(range(1024)))
    report.add_perplexity("int8/bfloat16", 11.0)
    report.add_perplexity("float32", 10.0)
    for mode, tokens in (("plain", [1, 2, 3, 9]), ("plain-float32", [1, 2, 3, 4])):
        report.rows.append(peers_module.timed_row("specserve", mode, "f", "count", tokens, 0.1, 0.4))
    rows = peers_module.quality_rows(report, "int8/bfloat16")
    ppl = {r["format"]: r for r in rows if r["mode"] == "perplexity"}
    assert ppl["int8/bfloat16"]["change_vs_float32"] == pytest.approx(0.1) and ppl["float32"]["num_tokens"] == 1024
    (agreement,) = [r for r in rows if r["mode"] == "greedy agreement"]
    assert (agreement["agreement"], agreement["common_prefix"], agreement["same_tokens"]) == (0.75, 3, False)
    assert agreement["suite"] == "structured"


def test_rounds_keep_each_rows_median_round(peers_module):
    report = peers_module.Report(fixed_text_ids=[])
    for e2e_s in (1.1, 0.5, 2.1):  # three rounds of one row: decode rates 7/1.0, 7/0.4, 7/2.0
        report.rows.append(peers_module.timed_row("specserve", "plain", "f", "count", list(range(8)), 0.1, e2e_s))
        report.add_model("target", "m", "specserve", "f", 100, "plain")
    report.rows.append(peers_module.timed_row("llama.cpp", "plain", "f", "count", list(range(8)), 0.2, 1.2))
    report.keep_median_rounds()
    ours, theirs = report.rows
    assert (ours["e2e_s"], ours["decode_tokens_per_s"], ours["rounds"]) == (1.1, 7.0, 3)
    assert (theirs["system"], theirs["rounds"]) == ("llama.cpp", 1)
    assert len(report.models) == 1


def test_units_short_of_huge_pages_are_named(peers_module, rows):
    from specserve.model import huge_pages

    ours = [r for r in rows if r["system"] == "specserve"]
    if huge_pages.unavailable_reason() is None and peers_module.anon_huge_pages_mb() is not None:
        assert all(r["weights_mb"] > 0 and r["huge_pages_mb"] is not None for r in ours)  # measured per unit

    def row(mode: str, placed: float) -> dict:
        return {"system": "specserve", "mode": mode, "huge_pages_mb": placed, "weights_mb": 1000.0}

    synthetic = [row("plain", 1500.0), row("draft", 1400.0), row("draft", 300.0), row("adaptive", 950.0)]
    synthetic.append({"system": "llama.cpp", "mode": "plain"})  # theirs: not placed by us
    (warning,) = peers_module.short_of_huge_pages(synthetic)
    assert warning.startswith("draft: in some round only 300 MB of its target's 1000 MB")


# ------------------------------------------------------------------ roofline, GGUF


def test_weight_bytes_count_linears_norms_and_one_embedding_row():
    untied = Decoder(tiny_config("qwen2"))  # qwen2: q/k/v have biases
    every = sum(p.numel() * 4 for p in untied.parameters()) + untied.inv_freq.numel() * 4
    table = untied.embed_tokens.weight
    assert weight_bytes_per_token(untied) == every - table.numel() * 4 + table.shape[1] * 4
    tied = Decoder(tiny_config("qwen2", tie_word_embeddings=True))  # the table is the head: once, in full
    assert weight_bytes_per_token(tied) == sum(p.numel() * 4 for p in tied.parameters()) + tied.inv_freq.numel() * 4


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="our float kernel cannot run here")
def test_weight_bytes_count_our_float_kernels_layers_once():
    before = weight_bytes_per_token(Decoder(tiny_config("qwen2")))
    swapped = Decoder(tiny_config("qwen2"))
    swapped.pack_linear_weights()  # our kernel's layers: the same tensors
    assert weight_bytes_per_token(swapped) == before


def test_weight_bytes_count_onednn_tensors(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)  # oneDNN's packed layers instead of ours
    packed = Decoder(tiny_config("qwen2"))
    before = weight_bytes_per_token(packed)
    packed.pack_linear_weights()  # oneDNN tensors; a bias-free layer gains a zero bias
    zero_biases = sum(
        m.out_features
        for m in Decoder(tiny_config("qwen2")).modules()
        if isinstance(m, torch.nn.Linear) and m.bias is None
    )
    assert weight_bytes_per_token(packed) == before + zero_biases * 4


def test_gguf_bytes_count_the_stored_quantized_sizes():
    path = gguf_file("smollm2-135m")  # one file inside its package: used where it lies
    assert path == catalogue.catalogue_entry("smollm2-135m").gguf_sources()[0]
    reader = gguf.GGUFReader(path)
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied: the table counts in full
    assert gguf_weight_bytes_per_token(reader) == sum(t.n_bytes for t in reader.tensors)
    assert gguf_format(reader) == "Q4_1"


def test_an_untied_gguf_table_counts_one_row():
    tensor = lambda name, shape, n_bytes: types.SimpleNamespace(name=name, shape=shape, n_bytes=n_bytes)  # noqa: E731
    table = tensor("token_embd.weight", [64, 1000], 64_000)  # GGUF shapes run innermost first: [hidden, vocab]
    blocks = [tensor("blk.0.ffn_down.weight", [128, 64], 4_608), tensor("output_norm.weight", [64], 256)]
    untied = types.SimpleNamespace(tensors=[table, *blocks, tensor("output.weight", [64, 1000], 36_000)])
    assert gguf_weight_bytes_per_token(untied) == 64 + 4_608 + 256 + 36_000
    assert gguf_weight_bytes_per_token(types.SimpleNamespace(tensors=[table, *blocks])) == 64_000 + 4_608 + 256


@dataclasses.dataclass(frozen=True)
class PartsEntry:  # the fields of a CatalogueEntry that joining reads
    name: str
    parts: tuple[Path, ...]
    size: int
    sha256: str

    def gguf_sources(self) -> list[Path]:
        return list(self.parts)


def test_a_multi_part_gguf_is_joined_once_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    parts = [tmp_path / "part1", tmp_path / "part2"]
    parts[0].write_bytes(b"GGUF" + b"a" * 100)
    parts[1].write_bytes(b"b" * 50)
    whole = parts[0].read_bytes() + parts[1].read_bytes()
    good = PartsEntry("toy", tuple(parts), len(whole), hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(catalogue.CATALOGUE, "toy", good)
    joined = gguf_file("toy")
    assert joined == tmp_path / "cache" / "gguf-files" / "toy.gguf" and joined.read_bytes() == whole
    parts[1].write_bytes(b"changed")  # a second call reuses the file, it does not join again
    assert gguf_file("toy").read_bytes() == whole

    monkeypatch.setitem(catalogue.CATALOGUE, "bad", dataclasses.replace(good, name="bad", sha256="0" * 64))
    with pytest.raises(ModelLoadError, match="corrupt"):
        gguf_file("bad")
    assert list(joined.parent.iterdir()) == [joined]  # no partial file left behind


def test_multiply_adds_count_every_linear_weight_of_a_row():
    config = tiny_config("qwen2")
    decoder = Decoder(config)
    linear = sum(m.in_features * m.out_features for m in decoder.modules() if isinstance(m, torch.nn.Linear))
    assert multiply_adds_per_token(config) == linear
    assert multiply_adds_per_token(config, head_size=10) == linear - config.hidden_size * (config.vocab_size - 10)


def test_speculation_ceiling_takes_the_best_k():
    # a plain step of 30, a verified row of 3, a draft position of 10: k = 9 gives
    # 10 x 30 / (9 x 10 + max(30, 10 x 3)) = 2.5, k = 10 gives 330 / 133
    assert speculation_ceiling(30.0, 3.0, 10.0) == (pytest.approx(2.5), 9)
    # free drafts: the rows' arithmetic caps it, at the shortest k that reaches the cap
    assert speculation_ceiling(30.0, 7.5, 0.0) == (pytest.approx(4.0), 3)
    # a draft as dear as the target gains nothing
    assert speculation_ceiling(30.0, 0.0, 30.0) == (pytest.approx(1.0), 1)


def test_formats_map_to_the_arithmetic_they_run():
    assert [arithmetic_of(f) for f in ("int4/bfloat16", "int8/bfloat16", "float32", "bfloat16", "float16")] == [
        "int8_groups",
        "int8_groups",
        "float32",
        "bfloat16",
        None,
    ]


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="no arithmetic peak without our kernels")
def test_arithmetic_peaks_are_measured_and_described():
    peaks, method = measure_dot_peaks()
    # Every kind measured (no ordering between them: that would be a timed assertion,
    # at the mercy of a neighbour stealing the core for one of the 0.3 s windows).
    assert set(peaks) == {"int8", "float32", "bfloat16", "int8_groups"}
    assert all(peak > 1e9 for peak in peaks.values())  # any AVX-512 core does 100x that
    assert ("vdpbf16ps" in method) == native.has_bf16_dot()
    assert "threads" in method
    assert measure_dot_peaks(torch.device("meta")) is None  # off the CPU: not measured


def test_a_bfloat16_peak_without_vdpbf16ps_is_the_fma_peak(monkeypatch):
    """Where the CPU lacks vdpbf16ps our kernel widens bfloat16 to FMAs, and the
    instruction it lacks is never run (it would kill the process)."""
    kinds = []
    fake = types.SimpleNamespace(dot_peak=lambda kind, seconds: kinds.append(kind) or 1.0)
    monkeypatch.setattr(native, "library", lambda: fake)
    monkeypatch.setattr(native, "has_bf16_dot", lambda: False)
    native.dot_peak("bfloat16")
    assert kinds == [native.DOT_KINDS["float32"]]


def test_bandwidth_is_measured_and_described():
    bandwidth, method = measure_read_bandwidth(gib=0.125, passes=2)
    assert bandwidth > 1e9 and "torch.sum" in method and "threads" in method


# ------------------------------------------------------------------ quality


@pytest.fixture(scope="module")
def smollm2(prepared_cache):
    os.environ["SPECSERVE_CACHE"] = prepared_cache  # the session fixture restores it
    return catalogue.load_model("smollm2-135m")


def greedy_continuation(decoder: Decoder, prompt: list[int], num_tokens: int) -> list[int]:
    cache, ids, new = decoder.new_cache(), list(prompt), list(prompt)
    for _ in range(num_tokens):
        logits = decoder(torch.tensor(new), [Segment(cache, len(new))], torch.tensor([len(new) - 1]))  # [1, V]
        new = [int(logits[0].argmax())]
        ids += new
    return ids


def test_perplexity_of_a_models_own_greedy_output_is_low(smollm2):
    text = fixed_text_ids(smollm2.tokenizer, 17)
    assert len(text) == 17
    own = greedy_continuation(smollm2.decoder, text[:1], 16)  # each token the likeliest after those before
    own_perplexity, text_perplexity = perplexity(smollm2.decoder, own), perplexity(smollm2.decoder, text)
    assert own_perplexity < 5 and own_perplexity < 0.1 * text_perplexity


def test_chunked_perplexity_equals_one_full_forward():
    torch.manual_seed(0)
    decoder = Decoder(tiny_config("llama")).eval()
    ids = torch.randint(0, 96, (23,))  # [N]
    logits = decoder(ids, [Segment(decoder.new_cache(), len(ids))])  # [N, V]
    expected = math.exp(F.cross_entropy(logits[:-1], ids[1:]).item())
    for chunk in (5, 11, 22, 512):
        assert perplexity(decoder, ids.tolist(), chunk=chunk) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError):
        perplexity(decoder, [1])


def test_prefix_agreement():
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5  # nothing after a difference counts
    assert prefix_agreement([1, 2, 3, 4], [5, 2, 3, 4]) == 0.0
    assert prefix_agreement([1, 2, 3, 4], [1, 2]) == 0.5  # stopped early (an end of sequence)
    assert prefix_agreement([1, 2], [1, 2, 3, 4]) == 1.0  # went on: the reference is all there
    assert prefix_agreement([], [1]) == 1.0
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2


def test_every_other_round_runs_the_units_the_other_way_round(peers_module):
    args, _ = peers_module.parse_args(["--modes", "plain,draft,adaptive", "--no-quality"])
    first = peers_module.units(args, ["transformers"], 0)
    assert first == ["specserve:plain", "specserve:draft", "specserve:adaptive", "transformers"]
    assert peers_module.units(args, ["transformers"], 1) == first[::-1]
    assert peers_module.units(args, ["transformers"], 2) == first
