"""The built-in prompt suites, and the names `specserve bench --test-case` accepts.

`structured` prompts have predictable output (counting, repeating a line, numeric
continuations, simple code) where speculation pays most; `open-ended` ones have not.
Each prompt is a user message for the chat template, named by its prompt group.
`sonnet` is LLMPerf's workload: random lines of Shakespeare's sonnets (public domain,
`sonnets.txt` beside this file) up to a sampled prompt length, built in
`specserve.bench.workload` because its length is counted with a tokenizer.
"""

from __future__ import annotations

from pathlib import Path

SUITES: dict[str, dict[str, str]] = {
    "structured": {
        "count": "List the numbers from one to twenty, one per line.",
        "repeat": "Repeat the following line exactly 20 times: The quick brown fox jumps over the lazy dog.",
        "numeric": "Continue this sequence with the next thirty numbers, separated by commas: 3, 6, 9, 12, 15, 18, 21,",
        "code": "Write a Python function that checks whether a number is prime.",
    },
    "open-ended": {
        "meaning": "I believe the meaning of life is",
        "travel": "If I could travel anywhere in the world, I would go to",
        "afternoon": "The best way to spend a rainy afternoon is",
    },
}

SONNET = "sonnet"
SONNETS_PATH = Path(__file__).with_name("sonnets.txt")


def prompts_of(suites: str) -> dict[str, str]:
    """Prompts by name for comma-separated suite names; unknown names raise ValueError."""
    chosen: dict[str, str] = {}
    for suite in suites.split(","):
        if suite not in SUITES:
            raise ValueError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")
        chosen.update(SUITES[suite])
    return chosen


def known_test_cases() -> list[str]:
    """Every built-in test case: the suites, `sonnet`, then each prompt group alone."""
    return [*SUITES, SONNET, *(name for prompts in SUITES.values() for name in prompts)]


def prompts_for_test_case(name: str) -> dict[str, str]:
    """Prompts by name for a suite or a single prompt group (not `sonnet`); else ValueError."""
    if name in SUITES:
        return dict(SUITES[name])
    for prompts in SUITES.values():
        if name in prompts:
            return {name: prompts[name]}
    raise ValueError(f"unknown test case {name!r}; known: {', '.join(known_test_cases())}")


def sonnet_lines() -> list[str]:
    """The sonnets' lines, each ending in a newline."""
    return SONNETS_PATH.read_text(encoding="utf-8").splitlines(keepends=True)
