"""The GGUF file of a model, for peers that read GGUF themselves (llama.cpp).

Our own loader never keeps the GGUF: preparation joins a catalogue model's parts into
a temporary file, dequantizes it and deletes it. A peer needs the file itself, so a
multi-part catalogue model is joined once more into
`$SPECSERVE_CACHE/gguf-files/<name>.gguf` and kept.

Invariant: that path exists only complete and checked (size and sha256): it is written
as `.partial` and renamed into place.
"""

from __future__ import annotations

from pathlib import Path

import gguf

from specserve import catalogue
from specserve.errors import ModelLoadError


def gguf_file(name_or_path: str) -> Path:
    """The GGUF file behind a catalogue name or a .gguf path; ModelLoadError otherwise."""
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path  # the user's file, used as it is
    if name_or_path not in catalogue.CATALOGUE:
        raise ModelLoadError(f"{name_or_path!r} is not a GGUF file or a catalogue model")
    entry = catalogue.catalogue_entry(name_or_path)
    sources = entry.gguf_sources()
    if len(sources) == 1:
        return sources[0]  # already one file inside its package
    joined = catalogue.cache_root() / "gguf-files" / f"{name_or_path}.gguf"
    with catalogue.locked(f"gguf-file-{name_or_path}"):
        if not joined.is_file():
            joined.parent.mkdir(parents=True, exist_ok=True)
            partial = joined.with_name(joined.name + ".partial")
            try:
                catalogue.join_and_check(entry, partial)
                partial.rename(joined)
            finally:
                partial.unlink(missing_ok=True)
    return joined


def gguf_format(reader: gguf.GGUFReader) -> str:
    """The file's weight format as llama.cpp names it (`Q4_K_M`), else its file name."""
    field = reader.fields.get("general.file_type")
    if field is None:
        return Path(reader.data.filename).name
    file_type = int(field.parts[field.data[0]][0])
    try:
        return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"file type {file_type}"
