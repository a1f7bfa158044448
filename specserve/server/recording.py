"""`serve --record-prompts FILE`: the prompts a server is sent, as lines `specserve
train-head --instructions FILE` reads (specserve/train/instructions.py), to train a head on
the traffic it will draft for.

What is recorded: each prompt of a request the engine admitted (once, whatever its n),
a chat request's conversation as "messages" (or "prompt" for one user turn) of kind
"chat", with its "tools" and tool turns where it has them, a completion's prompt as
"text" of kind "completion" (token ids decoded, the leading BOS left out since reading
the text adds it again). Conversations that end in neither a user turn holding text nor
a tool's result, which train-head cannot answer, are not.

Invariants: recording never delays or fails a request. A request hands over a function
that makes its lines, which a thread of the recorder's own calls and writes (decoding
ids and writing a file take time the event loop must not lose); at most `MAX_PENDING`
requests wait, and past that, or after the file fails, records are dropped and logged.
Each line is appended whole and flushed, so a file cut by a crash loses its last line at
most, which train-head refuses naming it.
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Callable, Iterable

from specserve.errors import ConfigError
from specserve.train.instructions import Instruction

log = logging.getLogger("specserve")

MAX_PENDING = 4096  # requests whose lines wait to be written
CLOSE_TIMEOUT_S = 10.0  # how long closing waits for the pending lines


class PromptRecorder:
    def __init__(self, path: str | Path, max_pending: int = MAX_PENDING):
        self.path = Path(path)
        try:
            self._file = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--record-prompts {path}: cannot append to it ({e}); give a writable file") from None
        self._pending: queue.Queue[Callable[[], Iterable[Instruction]] | None] = queue.Queue(max_pending)
        self.written = self.dropped = 0
        self._dropping = threading.Lock()  # requests drop on the event loop, bad lines on the writer
        self._failed = False
        self._thread = threading.Thread(target=self._write, name="specserve-record-prompts", daemon=True)
        self._thread.start()

    def record(self, lines: Callable[[], Iterable[Instruction]]) -> None:
        """Queue one request's prompts (`lines` is called on the recorder's thread); never
        blocks, never raises."""
        if self._failed:
            return
        try:
            self._pending.put_nowait(lines)
        except queue.Full:
            self._drop("more requests wait to be recorded than %d" % self._pending.maxsize)

    def close(self) -> None:
        """Write what is queued (for at most CLOSE_TIMEOUT_S), then close the file."""
        try:
            self._pending.put(None, timeout=CLOSE_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(CLOSE_TIMEOUT_S)
        if self.dropped:
            log.warning("--record-prompts: %d requests were not recorded", self.dropped)

    def _drop(self, why: str) -> None:
        with self._dropping:
            self.dropped += 1
            first = self.dropped == 1
        if first:
            log.warning("--record-prompts: a request was not recorded (%s); later ones are counted at shutdown", why)

    def _write(self) -> None:
        while (lines := self._pending.get()) is not None:
            if self._failed:
                continue
            try:
                text = "".join(instruction.to_line() + "\n" for instruction in lines())
                self._file.write(text)
                self._file.flush()
                self.written += bool(text)
            except OSError as e:
                self._failed = True
                log.error("--record-prompts %s: writing failed (%s); no more prompts are recorded", self.path, e)
            except Exception:  # a bug in making the lines: that request alone goes unrecorded
                log.exception("--record-prompts: a request's prompts could not be recorded")
                self._drop("its lines could not be made")
        try:
            self._file.close()
        except OSError:  # what a failed file still holds in its buffer
            pass
