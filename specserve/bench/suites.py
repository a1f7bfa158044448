"""The built-in prompt suites, after the reference deployment's test cases.

`structured` prompts have predictable output (counting, repeating a line, simple code)
where speculation pays most; `open-ended` ones have not. Each prompt is a user
message for the chat template.
"""

from __future__ import annotations

SUITES: dict[str, dict[str, str]] = {
    "structured": {
        "count": "List the numbers from one to twenty, one per line.",
        "repeat": "Repeat the following line exactly 20 times: The quick brown fox jumps over the lazy dog.",
        "code": "Write a Python function that checks whether a number is prime.",
    },
    "open-ended": {
        "meaning": "I believe the meaning of life is",
    },
}


def prompts_of(suites: str) -> dict[str, str]:
    """Prompts by name for comma-separated suite names; unknown names raise ValueError."""
    chosen: dict[str, str] = {}
    for suite in suites.split(","):
        if suite not in SUITES:
            raise ValueError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")
        chosen.update(SUITES[suite])
    return chosen
