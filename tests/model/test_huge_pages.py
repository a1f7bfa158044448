"""Weights moved into a mapping advised for transparent huge pages (model/huge_pages.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.model import huge_pages
from specserve.model.huge_pages import move_to_huge_pages

needs_thp = pytest.mark.skipif(
    huge_pages.unavailable_reason() is not None, reason=f"no huge pages here: {huge_pages.unavailable_reason()}"
)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1024, 512)  # 2 MB of float32
        self.head = nn.Linear(512, 1024, bias=False)
        self.head.weight = self.embed.weight  # tied, as small models are
        self.proj = nn.Linear(512, 512)
        self.register_buffer("packed", torch.randint(0, 255, (3, 1000), dtype=torch.uint8), persistent=False)
        self.register_buffer("strided", torch.zeros(8, 4).t(), persistent=False)  # not contiguous: stays

    def forward(self, ids):
        return self.head(self.proj(self.embed(ids))) + self.packed[:, :1].sum()


def mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    inside = False
    for line in open("/proc/self/smaps"):
        if "-" in line.split()[0] and ":" not in line.split()[0]:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_weights_move_and_compute_the_same():
    torch.manual_seed(0)
    model = Tied()
    ids = torch.tensor([1, 5, 1000])
    expected = model(ids)
    strided = model.strided
    moved = move_to_huge_pages(model)
    assert moved == 2**21 + 2**20 + 2048 + 3008  # each tensor once (the tied one too), 64-byte aligned
    assert torch.equal(model(ids), expected)
    assert model.head.weight is model.embed.weight and isinstance(model.embed.weight, nn.Parameter)
    assert model.strided is strided
    tensors = (model.embed.weight, model.proj.weight, model.proj.bias, model.packed)
    for tensor in tensors:
        assert "hg" in mapping_flags(tensor.data_ptr())  # advised MADV_HUGEPAGE
        assert tensor.data_ptr() % 64 == 0
    first = min(t.data_ptr() for t in tensors)
    assert first % huge_pages.HUGE_PAGE == 0  # the copies start on a huge page


@needs_thp
def test_the_copies_outlive_the_module():
    model = Tied()
    move_to_huge_pages(model)
    weight = model.proj.weight.detach()
    expected = weight.clone()
    del model
    assert torch.equal(weight, expected)  # the mapping is still there


def test_where_huge_pages_are_off_nothing_moves(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    model = Tied()
    before = model.proj.weight
    assert huge_pages.unavailable_reason() == "transparent huge pages are off ([never])"
    assert move_to_huge_pages(model) == 0
    assert model.proj.weight is before


def test_the_environment_can_turn_it_off(monkeypatch):
    monkeypatch.setenv("SPECSERVE_HUGE_PAGES", "0")
    model = Tied()
    before = model.proj.weight
    assert huge_pages.unavailable_reason() == "SPECSERVE_HUGE_PAGES=0"
    assert move_to_huge_pages(model) == 0 and model.proj.weight is before


@needs_thp
def test_a_mapping_that_fails_leaves_the_weights_where_they_are(monkeypatch, caplog):
    def no_room(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", no_room)
    model = Tied()
    before = model.proj.weight
    assert move_to_huge_pages(model) == 0 and model.proj.weight is before
    assert "Cannot allocate memory" in caplog.text
