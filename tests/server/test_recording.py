"""serve --record-prompts: the recorder never delays or fails a request, whatever its file
or the lines it is handed do; what it writes, train-head reads."""

from __future__ import annotations

import os
import threading
import time

import pytest

from specserve.errors import ConfigError
from specserve.server.recording import PromptRecorder
from specserve.train.instructions import Instruction, load_instructions

FIRST, SECOND = Instruction("chat", "Name a fruit."), Instruction("completion", "def add(a, b):", templated=False)


def test_lines_are_made_on_the_recorders_thread_and_a_bad_request_is_dropped_alone(tmp_path, caplog):
    path = tmp_path / "prompts.jsonl"
    recorder = PromptRecorder(path)
    threads = []

    def first() -> list[Instruction]:
        threads.append(threading.current_thread())
        return [FIRST]

    recorder.record(first)
    recorder.record(lambda: 1 / 0)
    recorder.record(lambda: [SECOND])
    recorder.close()
    assert load_instructions(path) == [FIRST, SECOND]
    assert threads != [threading.current_thread()] and (recorder.written, recorder.dropped) == (2, 1)
    assert "could not be recorded" in caplog.text


def test_a_full_queue_drops_records_without_waiting(tmp_path):
    recorder = PromptRecorder(tmp_path / "prompts.jsonl", max_pending=1)
    release = threading.Event()
    recorder.record(lambda: [FIRST] if release.wait(10) else [])  # holds the writer
    started = time.monotonic()
    for _ in range(50):
        recorder.record(lambda: [SECOND])
    assert time.monotonic() - started < 1 and recorder.dropped >= 48
    release.set()
    recorder.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_file_that_fails_stops_the_recording_not_the_requests(caplog):
    recorder = PromptRecorder("/dev/full")  # every write fails: no space left
    for _ in range(3):
        recorder.record(lambda: [FIRST])
    recorder.close()
    assert recorder.written == 0 and caplog.text.count("writing failed") == 1
    recorder.record(lambda: [FIRST])  # ignored, not raised


def test_a_path_that_cannot_be_written_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--record-prompts .*cannot append"):
        PromptRecorder(tmp_path / "missing" / "prompts.jsonl")
