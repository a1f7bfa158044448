"""benchmarks/head_recipes.py: recipes parse into the settings they name, and an unknown
key is refused with the keys there are."""

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
