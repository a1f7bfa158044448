"""A thinking model's reasoning, read apart from its answer (`--reasoning-parser P`).

Qwen3 and DeepSeek-R1 think before they answer, in a `<think> ... </think>` block at
the start of their text. With a parser, a chat answer's reasoning goes to the message's
`reasoning` (and `reasoning_content`, its older name in vLLM and DeepSeek's API), and
its content is the text after the block. The parsers, as vLLM's of those names:

- `qwen3`: an answer that starts with `<think>` thinks; one that does not (Qwen3 with
  `enable_thinking` false, whose template writes an empty block into the prompt) is all
  content. A prompt that ends with `<think>` (a template that opens the block itself)
  starts the answer in it.
- `deepseek_r1`: every answer starts in the block (R1's template opens it), a leading
  `<think>` dropped where the model writes it again.

Invariants:
- The reasoning is the block's text, stripped; the content is the text after
  `</think>`, its leading blanks stripped unless a structure holds there
  (structured/thinking.py). An answer cut off inside the block is all reasoning (its
  content None).
- A stream's pieces, joined, are the whole answer's reasoning and content: nothing is
  sent that a later token could move from one to the other (a tail that may begin a
  tag, and the reasoning's trailing blanks, wait for the next text).
- An answer's reasoning tokens (usage's `reasoning_tokens`, `ReasoningTokens`) are its
  tokens up to the one that completes `</think>`: all of them while the block is open,
  none where the answer does not think.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specserve.server.tool_calls import may_begin
from specserve.structured.thinking import THINK_END, THINK_START

REASONING_PARSERS = ("qwen3", "deepseek_r1")


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt whose text ends with `prompt_tail` leaves the answer inside a think block."""
    return prompt_tail.rstrip().endswith(THINK_START)


def reasoning_fields(reasoning: str | None) -> dict[str, str | None]:
    """A message's or a delta's reasoning, under vLLM's name and its older one."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


@dataclass(frozen=True)
class ReasoningParser:
    """How one request's answers are read: `parser` (REASONING_PARSERS), and whether
    the prompt left the answer inside a think block."""

    parser: str
    prompt_opened: bool = False
    guided: bool = False  # a structure holds after the block: the content is its text to the letter

    @property
    def starts_thinking(self) -> bool:
        """Whether every answer starts inside the block, tag or not."""
        return self.prompt_opened or self.parser == "deepseek_r1"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """An answer's (reasoning, content): (None, text) where it does not think."""
        streamed = self.stream()
        reasoning, content = streamed.step(text, finished=True)
        return (reasoning if streamed.thinks else None) or None, (content if streamed.answers else None)

    def stream(self) -> StreamedReasoning:
        return StreamedReasoning(self)

    def reasoning_tokens(self, text: str, ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> int:
        """How many of a whole answer's tokens (`ids`, whose text is `text`) its reasoning took."""
        reader = self.stream()
        reader.step(text, finished=True)
        counter = ReasoningTokens(reader, decode)
        counter.add(ids)
        return counter.count()


@dataclass
class StreamedReasoning:
    """One answer's text as it comes, split into the reasoning and the content to send.
    Each step reads only the text not sent yet (and the tag's length before it), so a
    long answer costs time in proportion to its length."""

    parser: ReasoningParser
    text: str = ""
    thinks: bool = False  # decided: the answer has a block
    answers: bool = False  # decided: content follows (the block closed, or there is none)
    body: int = -1  # where the block's text starts; -1: not known yet
    end: int = -1  # where the content starts; -1: not known yet
    scanned: int = 0  # the text searched for THINK_END so far
    reasoning_at: int = 0  # the next character of the block to send
    reasoned: bool = False  # some reasoning was sent (its leading blanks were not)
    content_at: int = 0  # the next character of the content to send
    content_begun: bool = False  # some content was sent (after a block, its leading blanks were not)

    def step(self, new_text: str, finished: bool) -> tuple[str, str]:
        """Take a step's text; return (reasoning, content) to send for it."""
        self.text += new_text
        if self.body < 0 and not self.answers:
            self._open(finished)
        reasoning = self._reasoning(finished) if self.thinks and self.end < 0 else ""
        content = self._content() if self.answers else ""
        return reasoning, content

    def _open(self, finished: bool) -> None:
        """Decide, once the text allows, whether the answer starts in a block."""
        lead = self.text.lstrip()
        if lead.startswith(THINK_START):
            self.thinks, self.body = True, len(self.text) - len(lead) + len(THINK_START)
        elif THINK_START.startswith(lead) and not finished:
            return  # blank, or what may still become the tag
        elif self.parser.starts_thinking:
            self.thinks, self.body = True, 0
        else:
            self.answers, self.end = True, 0
        self.reasoning_at = self.scanned = max(self.body, 0)

    def _reasoning(self, finished: bool) -> str:
        """The block's text not sent yet, less the blanks that may end it; where
        `</think>` has come, the content starts after it."""
        text = self.text
        close = text.find(THINK_END, max(self.body, self.scanned - len(THINK_END) + 1))
        if close >= 0:
            limit = close
            self.answers, self.end = True, close + len(THINK_END)
            self.content_at = self.end
        elif finished:
            limit = len(text)
        else:
            limit = len(text) - may_begin(text[max(self.body, len(text) - len(THINK_END)) :], THINK_END)
        self.scanned = len(text)
        pending = text[self.reasoning_at : limit]
        lead = 0 if self.reasoned else len(pending) - len(pending.lstrip())
        piece = pending[lead:].rstrip()
        if piece:
            self.reasoning_at += lead + len(piece)
            self.reasoned = True
        return piece

    def _content(self) -> str:
        """The content not sent yet; after a block (unguided), its leading blanks are no content."""
        pending = self.text[self.content_at :]
        if self.thinks and not self.parser.guided and not self.content_begun:
            piece = pending.lstrip()
            self.content_at += len(pending) - len(piece)
            pending = piece
        self.content_begun = self.content_begun or bool(pending)
        self.content_at += len(pending)
        return pending


@dataclass
class ReasoningTokens:
    """How many of one answer's tokens its reasoning took, as its `reader` has read the
    answer's text so far (`add` the tokens of each step it reads). `decode` turns ids
    into the text the reader was given. Once the block closes, the closing token is
    found by bisection over the decoded prefixes, once: a stream's count costs O(1) a
    step otherwise."""

    reader: StreamedReasoning
    decode: Callable[[Sequence[int]], str]
    ids: list[int] = field(default_factory=list)
    closed_at: int | None = None  # the tokens up to the one completing `</think>`

    def add(self, token_ids: Sequence[int]) -> None:
        self.ids.extend(token_ids)

    def count(self) -> int:
        if not self.reader.thinks:
            return 0
        if not self.reader.answers:
            return len(self.ids)
        if self.closed_at is None:
            self.closed_at = self._first_closing()
        return self.closed_at

    def _first_closing(self) -> int:
        """The fewest leading ids whose text closes the block (its text is a prefix of
        the whole's, so closing is monotone in the prefix's length)."""
        low, high = 1, len(self.ids)  # the whole closes it: the reader saw it
        while low < high:
            middle = (low + high) // 2
            prefix = self.reader.parser.stream()
            prefix.step(self.decode(self.ids[:middle]), finished=False)
            if prefix.answers and prefix.thinks:
                high = middle
            else:
                low = middle + 1
        return low
