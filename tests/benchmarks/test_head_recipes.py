"""benchmarks/head_recipes.py: recipes parse into the settings they name, an unknown
key is refused with the keys there are, and an EAGLE-3 layer starts from the target's last."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.head_recipes import from_target_layer, parse_recipes
from specserve.spec.heads.eagle import EagleConfig, EagleHead
from tests.conftest import tiny_config


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


def test_an_eagle3_layer_starts_from_the_targets_last(tmp_path):
    """init_layer=1: the hidden half of qkv, o_proj, the first neurons of the MLP that the
    head's narrower MLP holds, the norms, and fc passing the last captured layer through."""
    target = tiny_config("qwen2", num_layers=3)
    hidden, q, kv, neurons = 64, 4 * 16, 2 * 16, 32
    shapes = {
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "mlp.gate_proj.weight": (128, hidden),
        "mlp.up_proj.weight": (128, hidden),
        "mlp.down_proj.weight": (hidden, 128),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    weights = {f"model.layers.2.{name}": torch.randn(shape) for name, shape in shapes.items()}
    weights["model.norm.weight"] = torch.randn(hidden)
    save_file(weights, tmp_path / "model.safetensors")
    config = EagleConfig.for_target(target, 3, 48)
    head = EagleHead(dataclasses.replace(config, layer=dataclasses.replace(config.layer, intermediate_size=neurons)))
    embedding_half = head.layer.self_attn.qkv_proj.weight[:, :hidden].clone()
    from_target_layer(head, tmp_path, target.num_layers)
    layer = "model.layers.2."
    qkv = torch.cat([weights[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(head.layer.self_attn.qkv_proj.weight, torch.cat([embedding_half, qkv], dim=1))
    assert torch.equal(head.layer.self_attn.o_proj.weight, weights[layer + "self_attn.o_proj.weight"])
    gate, up = weights[layer + "mlp.gate_proj.weight"][:neurons], weights[layer + "mlp.up_proj.weight"][:neurons]
    assert torch.equal(head.layer.mlp.gate_up_proj.weight, torch.cat([gate, up]))
    assert torch.equal(head.layer.mlp.down_proj.weight, weights[layer + "mlp.down_proj.weight"][:, :neurons])
    assert torch.equal(head.hidden_norm.weight, weights[layer + "input_layernorm.weight"])
    assert torch.equal(head.norm.weight, weights["model.norm.weight"])
    features = torch.randn(5, 3 * hidden)  # [T, three captured layers]
    assert torch.equal(head.fc(features), features[:, -hidden:])
