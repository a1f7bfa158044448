"""Time to first token of a chat's turns with and without prefix caching, side by side.

One engine (the target, and the draft of --speculative-config if given) plays a chat of
several turns; each turn's prompt is the conversation so far in the chat template and a
new message, as a chat client sends it. Every turn runs twice in a row, the order
alternating from turn to turn: with the prefix cache off, and on (holding what the
turns before left; `serve --enable-prefix-caching`). Prints, per turn, the prompt
tokens, how many came from the cache, the TTFT of both and their ratio, the decode rate
of both, and whether both gave the same tokens.

    .venv/bin/python benchmarks/prefix_caching.py                     # default target, float32
    .venv/bin/python benchmarks/prefix_caching.py --quantization int4 \\
        --speculative-config '{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 7, "quantization": "int4"}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from specserve import catalogue
from specserve.cli import add_format_flags, device_of, dtype_of
from specserve.config import SpecConfig
from specserve.engine.build import build_engine, run_one
from specserve.errors import SpecserveError
from specserve.sampling import SamplingParams
from specserve.spec.draft_model import DraftModelProposer

MESSAGES = [
    "Write a Python function that checks whether a number is prime.",
    "Now make it faster for large numbers.",
    "Add type hints and a docstring.",
    "Write three unit tests for it with pytest.",
    "Explain its time complexity in two sentences.",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=catalogue.DEFAULT_TARGET)
    parser.add_argument("--speculative-config", default=None, metavar="JSON")
    add_format_flags(parser)
    parser.add_argument("--turns", type=int, default=len(MESSAGES), help=f"at most {len(MESSAGES)}")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per turn")
    parser.add_argument("--json", action="store_true", help="one JSON object per turn")
    args = parser.parse_args()

    try:
        spec = SpecConfig.parse(args.speculative_config)
        engine, tokenizer = build_engine(
            args.model,
            spec,
            dtype_of(args),
            quantization=args.quantization,
            batch_invariant=args.batch_invariant,
            device=device_of(args),
            prefix_cache_space=4.0,
            max_num_seqs=1,
        )
    except SpecserveError as e:
        sys.exit(f"prefix_caching.py: error: {e}")
    # The stores stay; switching off takes them out of the engine and the draft.
    draft = engine.proposer if isinstance(engine.proposer, DraftModelProposer) else None
    target_store, draft_store = engine.prefix_cache, draft and draft.prefix_cache

    def set_caching(on: bool) -> None:
        engine.prefix_cache = target_store if on else None
        if draft is not None:
            draft.prefix_cache = draft_store if on else None

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    set_caching(False)  # a first request pays for warming up; not the first turn's
    run_one(engine, tokenizer, tokenizer.encode_chat([{"role": "user", "content": "Hello."}]), params)
    conversation, rows = [], []
    for turn, message in enumerate(MESSAGES[: args.turns]):
        conversation.append({"role": "user", "content": message})
        prompt_ids = tokenizer.encode_chat(conversation)
        results = {}
        for on in (False, True) if turn % 2 == 0 else (True, False):
            set_caching(on)
            results[on] = run_one(engine, tokenizer, prompt_ids, params)
        conversation.append({"role": "assistant", "content": results[True]["text"]})
        off, on = results[False], results[True]
        row = {
            "turn": turn + 1,
            "prompt_tokens": len(prompt_ids),
            "cached_tokens": on["num_cached_tokens"],
            "ttft_off_s": off["ttft_s"],
            "ttft_on_s": on["ttft_s"],
            "ttft_ratio": on["ttft_s"] / off["ttft_s"],
            "decode_off_tokens_per_s": off["decode_tokens_per_s"],
            "decode_on_tokens_per_s": on["decode_tokens_per_s"],
            "same_tokens": off["token_ids"] == on["token_ids"],
        }
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(
                f"turn {row['turn']}: {row['prompt_tokens']} prompt tokens, {row['cached_tokens']} cached; TTFT "
                f"{off['ttft_s']:.2f} s -> {on['ttft_s']:.2f} s ({row['ttft_ratio']:.2f}x); decode "
                f"{off['decode_tokens_per_s'] or 0:.1f} / {on['decode_tokens_per_s'] or 0:.1f} tok/s; "
                f"same tokens: {'yes' if row['same_tokens'] else 'no'}",
                flush=True,
            )
    later = [r["ttft_ratio"] for r in rows[1:]]
    if later and not args.json:
        print(
            f"TTFT with the cache over without, turns 2-{len(rows)}: geometric mean "
            f"{statistics.geometric_mean(later):.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
