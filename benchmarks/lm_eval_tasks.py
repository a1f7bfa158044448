"""Write an lm-evaluation-harness task that scores a served model on local text, so
that the harness (installed apart: `pip install "lm_eval[api]" transformers`) measures
`specserve serve` with no dataset from a hub.

The task, `stdlib_bpb`, is a loglikelihood_rolling one over the first CHARS characters
of a few modules of this interpreter's standard library: the harness sends each text as
a completions request with `echo` and `logprobs` and sums its tokens' logprobs, so it
reads the server's prompt logprobs (docs/serving.md, "Prompt logprobs"). It reports
bits per byte, byte perplexity and word perplexity. The text is the Python version's,
so compare figures taken with one version.

    .venv/bin/python benchmarks/lm_eval_tasks.py /tmp/specserve-tasks
    specserve serve qwen2.5-coder-1.5b -q int4 --enable-tokenizer-info-endpoint &
    lm_eval --model local-completions --tasks stdlib_bpb --include_path /tmp/specserve-tasks \\
        --model_args model=qwen2.5-coder-1.5b,base_url=http://127.0.0.1:8000/v1/completions,num_concurrent=1
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

MODULES = ("textwrap", "bisect", "heapq", "fnmatch", "shlex", "glob", "colorsys", "keyword")
CHARS = 1500  # of each module: ~400 tokens, a few seconds of prefill on 2 CPU cores

TASK = """task: stdlib_bpb
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
  - metric: byte_perplexity
  - metric: word_perplexity
"""


def write_task(folder: Path) -> Path:
    """The task's data and YAML in `folder`; returns the YAML's path."""
    folder.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = folder / "stdlib_bpb.jsonl"
    lines = [json.dumps({"text": (stdlib / f"{name}.py").read_text()[:CHARS]}) for name in MODULES]
    data.write_text("\n".join(lines) + "\n")
    task = folder / "stdlib_bpb.yaml"
    task.write_text(TASK.format(data=data.resolve()))
    return task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="where the task goes: give it to lm_eval as --include_path")
    args = parser.parse_args()
    print(f"wrote {write_task(args.folder)}; run lm_eval with --tasks stdlib_bpb --include_path {args.folder}")


if __name__ == "__main__":
    main()
