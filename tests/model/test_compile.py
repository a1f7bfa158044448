"""The optional torch.compile path (`--compile`, Decoder.use_torch_compile): the same
numbers as eager PyTorch, compiled at load, and a clear error where it cannot work."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from specserve.errors import ConfigError
from specserve.model.decoder import Decoder, Segment
from specserve.model.graphs import StepKey
from tests.conftest import tiny_config


def decode(model: Decoder, ids: torch.Tensor) -> list[torch.Tensor]:
    """A prompt, three decode steps, and a 4-token verification: every shape class."""
    cache = model.new_cache()
    out = [model(ids[:12], [Segment(cache, 12)])]
    out += [model(ids[i : i + 1], [Segment(cache, 1)]) for i in range(12, 15)]
    out.append(model(ids[15:19], [Segment(cache, 4, one_query_at_a_time=True)]))
    return out


def test_compiled_decoder_computes_what_eager_does():
    torch.manual_seed(0)
    model = Decoder(tiny_config("qwen3")).eval()
    model.pack_linear_weights()
    ids = torch.randint(0, 96, (19,), generator=torch.Generator().manual_seed(1))
    eager = decode(model, ids)
    graphs = counters["stats"]["unique_graphs"]
    model.use_torch_compile()
    compiled_at_load = counters["stats"]["unique_graphs"] - graphs
    assert compiled_at_load >= 3  # qkv, finish and head, for one row and several
    compiled = decode(model, ids)
    assert counters["stats"]["unique_graphs"] - graphs == compiled_at_load  # nothing compiled in a request
    for got, expected in zip(compiled, eager):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_a_machine_where_compile_fails_gets_a_clear_error(monkeypatch):
    def broken(fn, **options):
        def run(*args):
            raise RuntimeError("no C++ compiler found")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    model = Decoder(tiny_config("llama")).eval()
    with pytest.raises(ConfigError, match="no C\\+\\+ compiler found.*drop --compile"):
        model.use_torch_compile()


def test_compile_by_default_falls_back_to_the_uncompiled_model(monkeypatch, caplog):
    """Compiling where nobody asked (the default on a GPU): a warning, and the model's
    own methods again."""
    model = Decoder(tiny_config("llama")).eval()
    ids = torch.arange(5)
    expected = model(ids, [Segment(model.new_cache(), 5)])

    def broken(fn, **options):
        def run(*args):
            raise RuntimeError("no C++ compiler found")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    assert model.use_torch_compile(required=False) is False
    assert "torch.compile does not work here" in caplog.text and not model.compiled
    torch.testing.assert_close(model(ids, [Segment(model.new_cache(), 5)]), expected, rtol=0, atol=0)


def test_compiled_static_steps_compute_what_eager_ones_do():
    """With --compile and CUDA graphs, the static step (model/graphs.py) runs the compiled
    pieces: compiled at load (RoPE's piece too), not in a request, and the same numbers."""
    torch.manual_seed(0)
    eager = Decoder(tiny_config("qwen2")).eval()
    compiled = Decoder(tiny_config("qwen2")).eval()
    compiled.load_state_dict(eager.state_dict())
    compiled.use_torch_compile()
    ids = torch.randint(0, 96, (19,), generator=torch.Generator().manual_seed(1))
    for model in (eager, compiled):
        model.use_cuda_graphs(num_slots=2, capacity=64)
    graphs = counters["stats"]["unique_graphs"]
    for got, expected in zip(decode(compiled, ids), decode(eager, ids)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled in a request
    assert StepKey(1, 1, 64) in compiled.static.steps  # the decode steps were static ones


def test_inductor_options_reach_torch_compile_and_a_mode_beside_them_is_refused(monkeypatch):
    """Inductor's settings (as gpu_check's coordinate-descent mode passes them) go to
    every compiled piece; torch.compile takes a mode or options, so both is an error."""
    seen = []

    def recorded(fn, **arguments):
        seen.append(arguments)
        return fn

    monkeypatch.setattr(torch, "compile", recorded)
    model = Decoder(tiny_config("llama")).eval()
    assert model.use_torch_compile(options={"coordinate_descent_tuning": True})
    assert seen and all(a == {"dynamic": True, "options": {"coordinate_descent_tuning": True}} for a in seen)
    with pytest.raises(ConfigError, match="a mode or inductor options, not both"):
        Decoder(tiny_config("llama")).use_torch_compile(
            mode="max-autotune", options={"coordinate_descent_tuning": True}
        )
