"""One request's text as its tokens arrive: incremental detokenization and stop strings.

`TextOutput.add` takes a step's new token ids and returns the text that may be sent
now. Invariants:
- The text sent, joined, never contains a stop string: the text ends just before the
  first stop string found, and that ends the request (finish reason "stop"). With
  `include_stop` (vLLM's include_stop_str_in_output) it ends just after it instead.
- While a request runs, the last `len(longest stop string) - 1` characters are held
  back, since the next tokens might complete a stop string that begins in them (none
  with `include_stop`: every character sent stays).
- A stop token id (EOS or the request's own) ends the output without adding its text
  (with `include_stop`, adding it, as the special tokens' setting writes it).
- As vLLM's min_tokens: no stop string ends the output before its min_tokens-th token,
  whose text (with the held-back characters before it) is the first searched.
- Where a stop string ends the text, `ids_used` says how many of the step's ids it
  took: up to the one that completed the stop string, as one token a step would have
  ended there. The ids a speculative or multi-step step made past it are no output.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from specserve.tokenizer import IncrementalDetokenizer, Tokenizer


class TextOutput:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        stop_token_ids: Collection[int] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        include_stop: bool = False,
    ):
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop
        # A stop string may begin this many characters before a step's new text.
        self._search_back = max((len(s) for s in self._stop), default=1) - 1
        self._hold_back = 0 if include_stop else self._search_back
        self._stop_token_ids = stop_token_ids
        self._min_tokens = min_tokens
        self._num_ids = 0  # output ids added so far
        self.text = ""  # all text so far (up to a stop string)
        self._num_sent = 0  # characters of `text` already returned
        self.stop_reason: str | int | None = None  # the stop string or token id that ended it
        self.ids_used = 0  # of the last `add`'s ids, those that are output

    def add(self, new_ids: Sequence[int], finished: bool) -> str:
        """The text to send for a step's new ids; `finished`: no more ids will come.
        After it returns, a set `stop_reason` means the request must end here, and
        `ids_used` of the new ids are its output."""
        several = self._stop and len(new_ids) > 1
        before = (self._detokenizer.copy(), self._num_ids, self.text, self._num_sent) if several else None
        delta = self._add(new_ids, finished)
        self.ids_used = len(new_ids)
        if before is not None and isinstance(self.stop_reason, str):  # which id completed it: again, one at a time
            (self._detokenizer, self._num_ids, self.text, self._num_sent), self.stop_reason = before, None
            delta = ""
            for used, token_id in enumerate(new_ids, 1):
                delta += self._add([token_id], finished and used == len(new_ids))
                if isinstance(self.stop_reason, str):
                    break
            self.ids_used = used
        return delta

    def _add(self, new_ids: Sequence[int], finished: bool) -> str:
        if new_ids and new_ids[-1] in self._stop_token_ids:
            self.stop_reason = new_ids[-1]
            new_ids = new_ids if self._include_stop else new_ids[:-1]
        unsearched = max(0, self._min_tokens - 1 - self._num_ids)  # ids before the min_tokens-th
        self._num_ids += len(new_ids)
        self.text += self._detokenizer.add(new_ids[:unsearched])
        searched_to = max(0, len(self.text) - self._search_back)
        self.text += self._detokenizer.add(new_ids[unsearched:])
        if finished or self.stop_reason is not None:
            self.text += self._detokenizer.flush()
        searching = self._stop and self._num_ids >= self._min_tokens
        if searching and self._truncate_at_stop_string(searched_to):
            finished = True
        end = len(self.text) if finished or self.stop_reason is not None else len(self.text) - self._hold_back
        delta = self.text[self._num_sent : max(end, self._num_sent)]
        self._num_sent += len(delta)
        return delta

    def _truncate_at_stop_string(self, start: int) -> bool:
        """Cut `text` before (with `include_stop`, after) the earliest stop string found
        at or after `start`."""
        found = [(i, s) for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if not found:
            return False
        index, stop = min(found)
        # Text already sent stays: with include_stop it is held back for nothing, and a
        # stop string searched for the first time at min_tokens may lie within it.
        self.text = self.text[: max(index + len(stop), self._num_sent)] if self._include_stop else self.text[:index]
        self.stop_reason = stop
        return True
