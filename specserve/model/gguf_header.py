"""A fast reader of a GGUF file's key/value header.

It walks only the key/value section (no tensor index, no weights): about 0.1 s for a
152k-token vocabulary, where `gguf.GGUFReader` takes seconds because it indexes every
tensor and wraps every array element in numpy. Values come back as plain Python
(str, int, float, bool, lists of them).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from specserve.errors import ModelLoadError

_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_header(path: str | Path, key_prefix: str = "") -> dict[str, Any]:
    """The key/values of a GGUF header (those starting with key_prefix) as python values."""
    path = Path(path)
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _GGUFHeader(data, path).fields(key_prefix)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({error}); is it complete?") from error


class _GGUFHeader:
    """A cursor over a GGUF (v2/v3, little-endian) key/value section."""

    def __init__(self, data: mmap.mmap, path: Path):
        magic, version = struct.unpack_from("<4sI", data, 0)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path} is not a readable GGUF file (it starts with {magic!r})")
        if version not in (2, 3):
            raise ModelLoadError(f"{path} is not a readable GGUF file (version {version}; versions 2 and 3 are read)")
        self.data, self.offset = data, 8

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return values

    def _string(self, keep: bool = True) -> str | None:
        (length,) = self._unpack("Q")
        start, self.offset = self.offset, self.offset + length
        return self.data[start : self.offset].decode("utf-8") if keep else None

    def _value(self, value_type: int, keep: bool) -> Any:
        if value_type == _GGUF_STRING:
            return self._string(keep)
        if value_type == _GGUF_ARRAY:
            item_type, count = self._unpack("IQ")
            if item_type in _GGUF_SCALAR_FORMATS:  # one unpack for the whole array
                fmt = f"{count}{_GGUF_SCALAR_FORMATS[item_type]}"
                if not keep:
                    self.offset += struct.calcsize("<" + fmt)
                    return None
                return list(self._unpack(fmt))
            items = [self._value(item_type, keep) for _ in range(count)]
            return items if keep else None
        if value_type not in _GGUF_SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF value type {value_type} at byte {self.offset}")
        (value,) = self._unpack(_GGUF_SCALAR_FORMATS[value_type])
        return value

    def fields(self, key_prefix: str) -> dict[str, Any]:
        _tensor_count, kv_count = self._unpack("QQ")
        fields = {}
        for _ in range(kv_count):
            key = self._string()
            (value_type,) = self._unpack("I")
            keep = key.startswith(key_prefix)
            value = self._value(value_type, keep)
            if keep:
                fields[key] = value
        return fields
