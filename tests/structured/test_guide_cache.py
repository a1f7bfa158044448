"""GuideCache: schemas compiled once, in a worker process on a server, whose death costs
one retry; mask classes fall back to one mask a state past their budget."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from specserve.errors import ConfigError
from specserve.structured import guide as guide_module
from specserve.structured.guide import GuideCache
from specserve.structured.outputs import StructuredOutput
from specserve.structured.regex import compile_regex, mask_classes
from tests.server.test_server_structured import character_tokenizer


@pytest.mark.parametrize("isolated", [False, True], ids=["in-process", "worker"])
def test_a_guide_is_compiled_once_and_its_errors_name_the_pattern(isolated):
    cache = GuideCache(character_tokenizer(), size=2, isolated=isolated)
    first = cache.guide(StructuredOutput("regex", "[a-c]+x"))
    assert cache.guide(StructuredOutput("regex", "[a-c]+x")) is first
    assert first.accepts(first.dfa.walk(0, "abx")) and not first.accepts(first.dfa.walk(0, "ab"))
    with pytest.raises(ConfigError, match="not closed"):
        cache.guide(StructuredOutput("regex", "(a"))
    cache.guide(StructuredOutput("choice", ("yes", "no")))
    cache.guide(StructuredOutput("json_object"))
    assert cache.guide(StructuredOutput("regex", "[a-c]+x")) is not first  # the oldest of 3 went


def test_a_worker_that_died_is_replaced():
    cache = GuideCache(character_tokenizer(), isolated=True)
    cache.guide(StructuredOutput("regex", "[0-9]+"))
    for process in list(guide_module._worker._processes.values()):
        os.kill(process.pid, signal.SIGKILL)
    guide = cache.guide(StructuredOutput("regex", "[a-f]+"))
    assert guide.accepts(guide.dfa.walk(0, "cafe"))


def test_past_their_budget_mask_classes_give_every_state_its_own():
    dfa = compile_regex("[a-z]{0,60}x")
    shared = mask_classes(dfa, 8)
    assert len(np.unique(shared)) < dfa.dead
    assert np.array_equal(mask_classes(dfa, 8, budget_s=-1.0), np.arange(dfa.dead + 1))
