"""The `specserve` command line: `serve`, `generate` and `models`.

Every user-caused failure is a `SpecserveError` and is printed as one line naming the
fix, with exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from specserve import models
from specserve.config import SpecConfig
from specserve.engine.engine import DEFAULT_PREFILL_CHUNK_SIZE
from specserve.errors import ConfigError, SpecserveError

DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}


def add_model_flags(parser: argparse.ArgumentParser, positional: bool = False) -> None:
    help = f"target: a catalogue name, a .gguf file or a checkpoint folder (default {models.DEFAULT_TARGET})"
    if positional:  # `vllm serve MODEL`
        parser.add_argument("model", nargs="?", default=models.DEFAULT_TARGET, help=help)
    else:
        parser.add_argument("--model", default=models.DEFAULT_TARGET, help=help)
    parser.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help='e.g. \'{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 7}\' or '
        '\'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}\'',
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                        help="weights and activations (auto = float32 on CPU)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output in tokens (default: the model's context)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, with or without speculation")
    add_model_flags(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw text to continue")
    source.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON object with figures")
    gen.set_defaults(run=run_generate)

    srv = sub.add_parser("serve", help="serve an OpenAI-compatible API with continuous batching")
    add_model_flags(srv, positional=True)
    srv.add_argument("--host", default="0.0.0.0")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    srv.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1 routes (default: $SPECSERVE_API_KEY)")
    srv.add_argument("--max-num-seqs", type=int, default=8, help="most sequences in the running batch")
    srv.add_argument("--max-queue-len", type=int, default=64,
                     help="most requests waiting to join the batch; more get HTTP 429")
    srv.add_argument("--prefill-chunk-size", type=int, default=DEFAULT_PREFILL_CHUNK_SIZE,
                     help="most prompt tokens prefilled per step; longer prompts go in chunks")
    srv.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                     help="seconds between throughput/acceptance log lines (0: off)")
    srv.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                     help="on SIGTERM, how long requests in flight may still run")
    srv.add_argument("--uvicorn-log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug"])
    srv.set_defaults(run=run_serve)

    mod = sub.add_parser("models", help="list, install or prepare the bundled models")
    mod.add_argument("action", nargs="?", choices=["list", "install", "prepare"], default="list")
    mod.add_argument("names", nargs="*", help="catalogue names (install/prepare)")
    mod.add_argument("--force", action="store_true", help="reinstall / prepare again")
    mod.set_defaults(run=run_models)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from specserve.generate import build_engine, encode_prompt, run_one
    from specserve.sampling import SamplingParams

    spec = SpecConfig.parse(args.speculative_config)  # refuse a bad config before loading
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    engine, tokenizer = build_engine(args.model, spec, DTYPES[args.dtype], args.max_model_len)
    prompt_ids = encode_prompt(tokenizer, prompt=args.prompt, chat=args.chat)
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

    spec = SpecConfig.parse(args.speculative_config)  # refuse a bad config before loading
    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--prefill-chunk-size", args.prefill_chunk_size),
                        ("--port", args.port)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if args.max_queue_len < 0:
        raise ConfigError(f"--max-queue-len must be >= 0, got {args.max_queue_len}")
    serve(ServerConfig(
        model=args.model, spec=spec, dtype=DTYPES[args.dtype], host=args.host, port=args.port,
        served_model_name=args.served_model_name, api_key=args.api_key or None,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_queue_len=args.max_queue_len, prefill_chunk_size=args.prefill_chunk_size,
        log_stats_interval_s=args.log_stats_interval, shutdown_grace_s=args.shutdown_grace,
        log_level=args.uvicorn_log_level,
    ))
    return 0


def stats_line(result: dict[str, Any]) -> str:
    line = (
        f"[{result['num_output_tokens']} tokens, finish={result['finish_reason']}, "
        f"ttft {result['ttft_s'] * 1000:.0f} ms, "
        f"{result['decode_tokens_per_s'] or 0:.1f} tok/s decode, e2e {result['e2e_s']:.2f} s"
    )
    spec = result["spec"]
    if spec is not None and spec["acceptance_rate"] is not None:
        line += (
            f", acceptance {spec['acceptance_rate']:.0%}, "
            f"mean acceptance length {spec['mean_acceptance_length']:.2f}"
        )
    return line + "]"


def run_models(args: argparse.Namespace) -> int:
    if args.action == "list":
        if args.names:
            raise ConfigError("`specserve models` lists everything; give names to install or prepare")
        print(f"{'name':<22}{'params':>7}  {'installed':<10}{'prepared':<9}description")
        for entry in models.CATALOGUE.values():
            installed = "no" if entry.missing_packages() else "yes"
            prepared = "yes" if models.is_prepared(models.prepared_dir(entry.name)) else "no"
            print(f"{entry.name:<22}{entry.params:>7}  {installed:<10}{prepared:<9}{entry.description}")
        print(f"\nartifacts cache: {models.cache_root()}  (set SPECSERVE_CACHE to move it)")
        return 0
    if not args.names:
        raise ConfigError(f"name the models to {args.action}, e.g. `specserve models {args.action} smollm2-135m`")
    for name in args.names:
        models.catalogue_entry(name)  # every name is checked before any work starts
    for name in args.names:
        if args.action == "install":
            models.install(name, force=args.force)
        else:
            print(models.prepare(name, force=args.force))
    return 0


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
