"""The catalogue and the artifacts cache: each failure gets one message naming the fix."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from specserve import catalogue
from specserve.catalogue import CatalogueEntry
from specserve.errors import ConfigError, ModelLoadError
from specserve.spec.factory import check_same_vocabulary


def test_catalogue_lists_the_bundled_models():
    assert {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"} <= set(catalogue.CATALOGUE)
    for entry in catalogue.CATALOGUE.values():
        assert len(entry.sha256) == 64 and entry.size > 0
        assert all("==" in p for p in entry.packages)  # pinned


def test_unknown_name_says_what_exists():
    with pytest.raises(ModelLoadError, match="neither a catalogue model .*smollm2-135m.*specserve models"):
        catalogue.resolve("no-such-model")


def test_missing_package_names_the_install_command(monkeypatch, prepared_cache):
    entry = CatalogueEntry(
        name="ghost", description="", params="1B", packages=("specserve-no-such-package==1.0",), part_modules=("nope1",)
    )
    monkeypatch.setitem(catalogue.CATALOGUE, "ghost", entry)
    with pytest.raises(ModelLoadError, match="specserve models install ghost"):
        catalogue.resolve("ghost")


def test_corrupt_file_is_refused_and_nothing_is_cached(monkeypatch, prepared_cache, tmp_path):
    real = catalogue.CATALOGUE["smollm2-135m"]
    corrupt = tmp_path / "corrupt.gguf"
    data = bytearray(real.gguf_sources()[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    corrupt.write_bytes(bytes(data))
    entry = dataclasses.replace(real, name="corrupt-copy")
    monkeypatch.setitem(catalogue.CATALOGUE, "corrupt-copy", entry)
    monkeypatch.setattr(CatalogueEntry, "gguf_sources", lambda self: [corrupt])
    with pytest.raises(ModelLoadError, match="corrupt.*specserve models install corrupt-copy --force"):
        catalogue.resolve("corrupt-copy")
    assert not catalogue.is_prepared(catalogue.prepared_dir("corrupt-copy"))
    assert not list(catalogue.prepared_dir("corrupt-copy").parent.glob("corrupt-copy*"))


def test_paths_that_are_not_models(tmp_path, prepared_cache):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF but not really")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        catalogue.resolve(str(junk))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor a checkpoint folder"):
        catalogue.resolve(str(tmp_path / "empty"))


def test_gguf_path_and_checkpoint_folder_load_like_the_catalogue_name(prepared_cache, tmp_path):
    by_name = catalogue.load_model("smollm2-135m")
    gguf = catalogue.CATALOGUE["smollm2-135m"].gguf_sources()[0]
    by_path = catalogue.load_model(str(gguf))
    folder = tmp_path / "checkpoint"
    shutil.copytree(catalogue.prepared_dir("smollm2-135m"), folder)
    by_folder = catalogue.load_model(str(folder))
    ids = torch.tensor(by_name.tokenizer.encode("Hello there"))
    logits = [m.decoder(ids, [_segment(m, len(ids))]) for m in (by_name, by_path, by_folder)]
    torch.testing.assert_close(logits[0], logits[1])
    torch.testing.assert_close(logits[0], logits[2])


def _segment(model, n):
    from specserve.model.decoder import Segment

    return Segment(model.decoder.new_cache(), n)


def test_truncated_prepared_weights_say_how_to_recover(prepared_cache, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(catalogue.prepared_dir("smollm2-135m"), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="delete its folder"):
        catalogue.load_model(str(folder))


def test_draft_with_another_vocabulary_is_refused(prepared_cache, tmp_path):
    """A checkpoint whose tokenizer differs in two token ids is caught, with a token named."""
    target = catalogue.load_model("smollm2-135m")
    folder = tmp_path / "other-vocab"
    shutil.copytree(catalogue.prepared_dir("smollm2-135m"), folder)
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"]
    first, second = (next(t for t, i in vocab.items() if i == n) for n in (1000, 1001))
    vocab[first], vocab[second] = 1001, 1000  # two tokens trade ids
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    draft = catalogue.load_model(str(folder))
    with pytest.raises(ConfigError, match="does not share the vocabulary.*token 1000"):
        check_same_vocabulary(target, draft)
    check_same_vocabulary(target, target)  # and the same one passes


def test_a_copy_of_the_gguf_file_prepares_a_model_without_its_packages(monkeypatch, prepared_cache, tmp_path, capsys):
    """A machine without PyPI (a GPU server) gets the file copied over; it must be the
    catalogue's file to the byte."""
    from specserve.cli import main

    real = catalogue.CATALOGUE["smollm2-135m"]
    monkeypatch.setitem(
        catalogue.CATALOGUE,
        "offline-copy",
        dataclasses.replace(
            real, name="offline-copy", packages=("specserve-no-such-package==1.0",), file_in_package=("nope", "x.gguf")
        ),
    )
    shutil.rmtree(catalogue.prepared_dir("offline-copy"), ignore_errors=True)  # SPECSERVE_TEST_CACHE may keep it
    copy = tmp_path / "copied.gguf"
    data = bytearray(real.gguf_sources()[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    assert main(["models", "prepare", "offline-copy", "--from-gguf", str(copy)]) == 2
    assert "is not the catalogue's file of 'offline-copy'" in capsys.readouterr().err
    assert not catalogue.is_prepared(catalogue.prepared_dir("offline-copy"))

    data[len(data) // 2] ^= 0xFF  # the true bytes
    copy.write_bytes(bytes(data))
    assert main(["models", "prepare", "offline-copy", "--from-gguf", str(copy)]) == 0
    assert catalogue.resolve("offline-copy") == catalogue.prepared_dir("offline-copy")  # no package asked for
    ids = torch.tensor(catalogue.load_model("smollm2-135m").tokenizer.encode("Hello there"))
    logits = [
        m.decoder(ids, [_segment(m, len(ids))]) for m in map(catalogue.load_model, ("smollm2-135m", "offline-copy"))
    ]
    torch.testing.assert_close(logits[0], logits[1])


def test_export_writes_the_checked_file_that_from_gguf_takes(monkeypatch, prepared_cache, tmp_path, capsys):
    from specserve.cli import main

    assert main(["models", "export", "smollm2-135m", "--to", str(tmp_path / "out")]) == 0
    exported = tmp_path / "out" / "smollm2-135m.gguf"
    assert capsys.readouterr().out.strip() == str(exported)
    assert exported.read_bytes() == catalogue.CATALOGUE["smollm2-135m"].gguf_sources()[0].read_bytes()
    assert [p.name for p in exported.parent.iterdir()] == [exported.name]  # no partial file left
    # Prepared under another name: preparing smollm2-135m again would change the folder
    # that other tests' quantized files are keyed by.
    monkeypatch.setitem(
        catalogue.CATALOGUE,
        "exported-copy",
        dataclasses.replace(catalogue.CATALOGUE["smollm2-135m"], name="exported-copy"),
    )
    shutil.rmtree(catalogue.prepared_dir("exported-copy"), ignore_errors=True)
    capsys.readouterr()
    assert main(["models", "prepare", "exported-copy", "--from-gguf", str(exported), "--quantization", "int8"]) == 0
    assert catalogue.is_prepared(catalogue.prepared_dir("exported-copy"))
    folder, quantized = capsys.readouterr().out.split()  # --quantization applies to a --from-gguf prepare too
    assert folder == str(catalogue.prepared_dir("exported-copy")) and quantized.endswith(".safetensors")
    # Keyed by the new folder's times: a kept test cache would gain a copy every run.
    Path(quantized).unlink()
    shutil.rmtree(folder)


def test_from_gguf_and_export_say_how_they_are_used(prepared_cache, capsys, tmp_path):
    from specserve.cli import main

    assert main(["models", "prepare", "smollm2-135m", "qwen2.5-coder-0.5b", "--from-gguf", str(tmp_path)]) == 2
    assert "--from-gguf prepares one model" in capsys.readouterr().err
    assert main(["models", "prepare", "qwen2.5-coder-0.5b", "--from-gguf", str(tmp_path / "none.gguf"), "--force"]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert main(["models", "export", "smollm2-135m"]) == 2
    assert main(["models", "prepare", "smollm2-135m", "--to", str(tmp_path)]) == 2
    assert "export NAME ... --to DIR" in capsys.readouterr().err
