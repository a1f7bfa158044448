"""benchmarks/head_recipes.py: recipes parse into the settings they name, an unknown
key is refused with the keys there are, as is a random layer started from the target's,
a data folder keeps its settings, and a share of the answers keeps the first ones."""

from __future__ import annotations

import pytest

from benchmarks.head_recipes import parse_recipes


def test_recipes_parse_into_named_settings():
    recipes = parse_recipes("base; decay:weight_decay=0.1 ;wide:draft_vocab_size=16384,lr=1e-3;text:text=0")
    assert recipes == {
        "base": {},
        "decay": {"weight_decay": 0.1},
        "wide": {"draft_vocab_size": 16384.0, "lr": 1e-3},
        "text": {"text": 0.0},
    }


def test_an_unknown_key_is_refused_with_the_known_ones():
    with pytest.raises(SystemExit, match="unknown key 'dropout'.*weight_decay"):
        parse_recipes("x:dropout=0.1")


def test_a_random_layer_with_a_start_from_the_target_is_refused():
    """source_layer and neurons start the layer from the target's: init_layer=0 beside
    them once started it from the target's all the same."""
    for keys in ("init_layer=0,neurons=1", "init_layer=0,source_layer=20"):
        with pytest.raises(SystemExit, match="start the layer from the target's; drop init_layer=0"):
            parse_recipes(f"x:{keys}")
    assert parse_recipes("x:init_layer=1,neurons=1") == {"x": {"init_layer": 1.0, "neurons": 1.0}}


def test_a_data_folder_keeps_the_settings_it_was_made_with(tmp_path):
    """Defaults that moved since the data was made (the text, the loop) do not refuse the
    folder: its data is reused under its own settings."""
    import dataclasses
    import json

    from benchmarks.head_recipes import data_settings
    from specserve.train.run import TrainHeadSettings, check_same_run

    today = TrainHeadSettings("qwen2.5-coder-1.5b", "eagle3")
    assert data_settings(today, tmp_path) == today  # no data yet: today's settings make it
    older = dataclasses.replace(today, stdlib_tokens=400_000, loop=dataclasses.replace(today.loop, weight_decay=0.0))
    (tmp_path / "run.json").write_text(json.dumps(older.deciding_result()))
    stored = data_settings(today, tmp_path)
    assert (stored.stdlib_tokens, stored.loop.weight_decay) == (400_000, 0.0)
    check_same_run(tmp_path, stored)  # not refused


def test_a_share_of_the_answers_keeps_the_first_training_ones_and_every_held_out(tmp_path):
    import json

    from benchmarks.head_recipes import first_training_answers

    keys = ["answer-0003", "answer-0001", "answer-0004", "answer-0002", "answer-0003-1", "stdlib-0000"]
    held_out = {"answer-0001"}
    data = {key: {"held_out": key in held_out} for key in keys}
    (tmp_path / "data.json").write_text(json.dumps(data))
    # Four training answers in the order made: half keeps the first two.
    assert first_training_answers(keys, 0.5, tmp_path) == ["answer-0003", "answer-0001", "answer-0004", "stdlib-0000"]
    assert first_training_answers(keys, 1.0, tmp_path) == keys
