"""TextOutput: incremental text, stop strings with hold-back, and stop token ids.

Runs on a real byte-level BPE tokenizer trained in memory on a few sentences, so words
split over several tokens and characters outside the corpus (é, emoji) are split over
byte tokens, as they are in real models.
"""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from specserve.engine.text_output import TextOutput
from specserve.tokenizer import Tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog.", "Hello world, STOP here and END there."] * 3
EOS = "<eos>"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return Tokenizer(
        backend, bos_token_id=None, declared_eos_ids=[backend.token_to_id(EOS)], add_bos=False, chat_template=None
    )


def stream(output: TextOutput, ids: list[int], step: int = 1, finish: bool = True) -> list[str]:
    """Feed ids `step` at a time (the last chunk with finished=finish) until a stop."""
    deltas = []
    for start in range(0, len(ids), step):
        last = start + step >= len(ids)
        deltas.append(output.add(ids[start : start + step], finished=finish and last))
        if output.stop_reason is not None:
            break
    return deltas


@pytest.mark.parametrize("step", [1, 2, 5])
def test_deltas_join_to_the_decoded_ids_without_stops(tokenizer, step):
    ids = tokenizer.encode("Hello world, the quick café 😀 fox. END")
    prompt_ids = tokenizer.encode("the lazy dog")
    output = TextOutput(tokenizer, prompt_ids)
    assert "".join(stream(output, ids, step)) == tokenizer.decode(ids)
    assert output.stop_reason is None


def test_special_tokens_are_text_only_when_not_skipped(tokenizer):
    eos = tokenizer.eos_token_ids[0]
    ids = [*tokenizer.encode("the quick"), eos, *tokenizer.encode(" fox")]  # ignore_eos: the EOS is output
    assert "".join(stream(TextOutput(tokenizer, []), ids)) == "the quick fox"
    kept = "".join(stream(TextOutput(tokenizer, [], skip_special_tokens=False), ids))
    assert kept == f"the quick{EOS} fox"
    # A stop id still ends the text without its own, as vLLM leaves out EOS.
    stopped = TextOutput(tokenizer, [], stop_token_ids={eos}, skip_special_tokens=False)
    assert "".join(stream(stopped, ids)) == "the quick" and stopped.stop_reason == eos


def test_stop_string_spanning_two_steps_is_never_sent(tokenizer):
    stop = "k bro"  # 'ick' + ' br' + 'own': it starts in one token and ends two tokens later
    ids = tokenizer.encode("the quick brown fox jumps")
    assert not any(stop in tokenizer.decode([i]) for i in ids)
    output = TextOutput(tokenizer, [], stop=[stop])
    sent = [output.add(ids[:3], finished=False)]  # "the quick"
    assert sent == ["the q"]  # len(stop) - 1 = 4 characters held back
    sent += stream(output, ids[3:])
    assert output.stop_reason == stop
    assert "".join(sent) == output.text == "the quic"
    assert all("k" not in delta for delta in sent)  # not even the stop string's first character


def test_held_back_text_is_released_when_the_stop_string_does_not_complete(tokenizer):
    stop = "quick red"  # "the quick brown": begins like the stop string, then differs
    output = TextOutput(tokenizer, [], stop=[stop])
    text = "the quick brown fox jumps over the lazy dog"
    assert "".join(stream(output, tokenizer.encode(text))) == text
    assert output.stop_reason is None


def test_finished_flushes_the_held_back_text(tokenizer):
    stop = "zzzzzz"
    text = "Hello world, the quick"
    output = TextOutput(tokenizer, [], stop=[stop])
    running = "".join(stream(output, tokenizer.encode(text), finish=False))
    assert running == text[: -(len(stop) - 1)]
    assert output.add([], finished=True) == text[-(len(stop) - 1) :]
    assert output.stop_reason is None


def test_earliest_of_several_stop_strings_wins(tokenizer):
    output = TextOutput(tokenizer, [], stop=["fox", "brown", "quick", "lazy"])
    sent = output.add(tokenizer.encode("the quick brown fox jumps over the lazy dog"), finished=False)
    assert (sent, output.stop_reason) == ("the ", "quick")


def test_empty_stop_strings_are_ignored(tokenizer):
    text = "Hello world."
    output = TextOutput(tokenizer, [], stop=[""])
    assert output.add(tokenizer.encode(text), finished=False) == text  # nothing held back
    assert output.stop_reason is None


def test_stop_token_id_ends_without_its_text(tokenizer):
    ids = tokenizer.encode("Hello world.")
    period = ids[-1]
    assert tokenizer.decode([period]) == "."
    # A stop string would hold text back; the stop token must release all of it anyway.
    output = TextOutput(tokenizer, [], stop=["never seen"], stop_token_ids={period})
    sent = "".join(stream(output, ids, step=2, finish=False))
    assert sent == output.text == "Hello world"
    assert output.stop_reason == period


def test_eos_id_ends_the_text(tokenizer):
    eos = tokenizer.eos_token_ids[0]
    output = TextOutput(tokenizer, [], stop_token_ids=tokenizer.eos_token_ids)
    sent = "".join(stream(output, [*tokenizer.encode("the lazy dog"), eos], finish=False))
    assert (sent, output.stop_reason) == ("the lazy dog", eos)


def test_stop_token_after_a_partial_character_flushes_it_as_decode_does(tokenizer):
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("ok 😀")[:-1]  # the emoji's last byte never comes
    output = TextOutput(tokenizer, [], stop_token_ids={eos})
    sent = "".join(stream(output, [*ids, eos], finish=False))
    assert sent == tokenizer.decode(ids) and sent.endswith("\ufffd")


def test_stop_string_wins_over_a_later_stop_token(tokenizer):
    ids = tokenizer.encode("Hello world.")
    output = TextOutput(tokenizer, [], stop=["wor"], stop_token_ids={ids[-1]})
    assert output.add(ids, finished=False) == "Hello "
    assert output.stop_reason == "wor"


@pytest.mark.parametrize("stop", [(), ("ok 👨",)])
def test_multibyte_characters_are_never_split(tokenizer, stop):
    text = "café 😀 ok 👨‍👩‍👧 done"
    ids = tokenizer.encode(text)
    assert "\ufffd" in tokenizer.decode(ids[3:4])  # é, the emoji: several byte tokens each
    output = TextOutput(tokenizer, [], stop=stop)
    deltas = stream(output, ids)
    assert all("\ufffd" not in delta for delta in deltas)
    expected = text.split(stop[0])[0] if stop else text
    assert "".join(deltas) == expected
    assert output.stop_reason == (stop[0] if stop else None)


@pytest.mark.parametrize("step", [1, 3, 100])
def test_no_stop_string_ends_the_text_before_min_tokens(tokenizer, step):
    """As vLLM: a stop string is looked for from the min_tokens-th token on, in its text
    and the characters held back before it, so one wholly before it is text like any."""
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    at = next(i for i in range(len(ids)) if "quick" in tokenizer.decode(ids[: i + 1])) + 1  # tokens through "quick"
    early = TextOutput(tokenizer, [], stop=["quick"], min_tokens=at + 1)
    assert "".join(stream(early, ids, step)) == tokenizer.decode(ids) and early.stop_reason is None
    on_time = TextOutput(tokenizer, [], stop=["quick"], min_tokens=at)  # its last token is the min_tokens-th
    assert "".join(stream(on_time, ids, step)) == "the " and on_time.stop_reason == "quick"
    later = TextOutput(tokenizer, [], stop=["quick", "lazy"], min_tokens=at + 1)
    assert "".join(stream(later, ids, step)).endswith("over the ") and later.stop_reason == "lazy"


@pytest.mark.parametrize("stop", ["END", "D th", "o w", "STOP here"])
@pytest.mark.parametrize("step", [2, 3, 5, 8])
def test_a_stop_string_mid_step_uses_the_ids_up_to_the_one_that_completed_it(tokenizer, stop, step):
    """Several ids a step (speculation, multi-step decoding): the same text as one id a
    step, and `ids_used` counts the step's ids up to the one whose text completed the
    stop string, so the output's ids are the ones a token a step would give."""
    ids = tokenizer.encode("Hello world, STOP here and END there. the quick brown fox")
    one_a_step = TextOutput(tokenizer, [], stop=[stop])
    expected = stream(one_a_step, ids, 1)
    output = TextOutput(tokenizer, [], stop=[stop])
    deltas = stream(output, ids, step)
    assert "".join(deltas) == "".join(expected) and output.stop_reason == one_a_step.stop_reason == stop
    assert (len(deltas) - 1) * step + output.ids_used == len(expected)


@pytest.mark.parametrize("step", [1, 2, 5])
def test_include_stop_keeps_the_stop_string_and_holds_nothing_back(tokenizer, step):
    """vLLM's include_stop_str_in_output: the text ends just after the stop string, a
    stop string spanning steps is found all the same, and nothing waits to be sent."""
    stop = "k bro"  # 'ick' + ' br' + 'own'
    ids = tokenizer.encode("the quick brown fox jumps")
    output = TextOutput(tokenizer, [], stop=[stop], include_stop=True)
    assert output.add(ids[:3], finished=False) == "the quick"  # held back for nothing
    sent = ["the quick", *stream(output, ids[3:], step=step)]
    assert (output.stop_reason, "".join(sent), output.text) == (stop, "the quick bro", "the quick bro")
    assert output.ids_used <= step


def test_include_stop_keeps_a_stop_tokens_text(tokenizer):
    ids = tokenizer.encode("Hello world.")
    output = TextOutput(tokenizer, [], stop_token_ids={ids[-1]}, include_stop=True)
    assert "".join(stream(output, ids, step=2, finish=False)) == output.text == "Hello world."
    eos = tokenizer.eos_token_ids[0]
    skipped = TextOutput(tokenizer, [], stop_token_ids={eos}, include_stop=True)
    assert "".join(stream(skipped, [*tokenizer.encode("the lazy dog"), eos], finish=False)) == "the lazy dog"
