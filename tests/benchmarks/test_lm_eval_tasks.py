"""benchmarks/lm_eval_tasks.py: an lm-evaluation-harness task on local text."""

from __future__ import annotations

import json

from benchmarks import lm_eval_tasks


def test_the_task_reads_its_own_data_file_of_standard_library_text(tmp_path):
    task = lm_eval_tasks.write_task(tmp_path / "tasks")
    data = tmp_path / "tasks" / "stdlib_bpb.jsonl"
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    assert len(texts) == len(lm_eval_tasks.MODULES)
    assert all(0 < len(text) <= lm_eval_tasks.CHARS for text in texts)
    yaml = task.read_text()
    assert f"test: {data.resolve()}\n" in yaml and "output_type: loglikelihood_rolling" in yaml
    assert 'doc_to_target: "{{text}}"' in yaml
