"""Text corpora on disk, read as text or refused (data=text's and data=chat's files;
the template's docs/text.md): plain text, JSON lines or a JSON array, and parquet, each
compressed or not (``.gz``, ``.bz2``, ``.xz``, ``.zst``: read through, the name before it
saying the format). Refused before any work, naming the file: a binary (NUL bytes),
text that is not UTF-8 beyond ``MAX_INVALID`` of its bytes, compressed bytes under a
plain name (they would train as noise), a JSON line that does not parse, a column no
row has. Each read returns a report of what was read (for ``source.json``).
"""

from __future__ import annotations

import bz2
import glob
import gzip
import io
import json
import lzma
import re
from pathlib import Path
from typing import Any

from .config import ConfigError, require

# Bytes that are not valid UTF-8 become U+FFFD up to this share of a file (a stray
# byte in a large corpus); beyond it the file is not UTF-8 text and is refused.
MAX_INVALID = 0.001
COMPRESSED = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}
MAGIC = {  # how each compressed format's bytes begin
    "gzip": lambda head: head.startswith(b"\x1f\x8b\x08"),
    "bzip2": lambda head: head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] == b"1AY&SY",
    "xz": lambda head: head.startswith(b"\xfd7zXZ\x00"),
    "zstd": lambda head: head.startswith(b"\x28\xb5\x2f\xfd"),
}
_INVALID = re.compile("[\udc80-\udcff]")  # the bytes surrogateescape kept aside


def find_files(files: str | list[str]) -> list[Path]:
    """The files a glob (or list of globs) names, sorted: the same order everywhere."""
    patterns = [files] if isinstance(files, str) else list(files)
    found = sorted(
        {Path(p) for pattern in patterns for p in glob.glob(str(pattern), recursive=True)}
    )
    found = [p for p in found if p.is_file()]
    require(
        "data.files",
        files,
        bool(found),
        "a glob (or a list of globs) that matches at least one file, e.g. 'corpus/**/*.txt'",
    )
    return found


def read_documents(path: Path, document: str, column: str) -> list[str]:
    return read_file(path, document, column)[0]


def read_file(path: Path, document: str, column: str) -> tuple[list[str], dict[str, Any]]:
    """The documents of one file and what was read (for source.json), or a
    ConfigError naming the file and what is wrong with it."""
    compression = COMPRESSED.get(path.suffix.lower())
    kind = (path.with_suffix("") if compression else path).suffix.lower()
    raw = _read_bytes(path, compression)
    report: dict[str, Any] = {
        "path": str(path),
        "compression": compression or "none",
        "bytes": len(raw),
    }
    if kind == ".parquet":
        import pyarrow.parquet as pq  # the hf extra

        table = pq.read_table(io.BytesIO(raw))
        if column not in table.column_names:
            raise _not_text(
                path, f"it has no column {column!r} (data.column); it has {table.column_names}"
            )
        texts = [str(t) for t in table.column(column).to_pylist() if t is not None]
        report |= {"format": "parquet", "rows": table.num_rows, "invalid_bytes": 0}
    else:
        text, invalid = _decode(path, raw)
        if kind in (".jsonl", ".json"):
            rows = _json_rows(path, text)
            texts = [
                str(r[column]) for r in rows if isinstance(r, dict) and r.get(column) is not None
            ]
            if rows and not texts:
                keys = sorted({k for r in rows if isinstance(r, dict) for k in r})[:10]
                raise _not_text(
                    path, f"no row has the column {column!r} (data.column); its keys: {keys}"
                )
            report |= {
                "format": "json",
                "rows": len(rows),
                "rows_without_column": len(rows) - len(texts),
            }
        else:
            texts = [text]
            report["format"] = "text"
        report["invalid_bytes"] = invalid
    if document == "line":
        texts = [line for t in texts for line in t.splitlines() if line.strip()]
    else:
        texts = [t for t in texts if t]
    report |= {"documents": len(texts), "characters": sum(map(len, texts))}
    return texts, report


def json_rows(path: Path) -> tuple[list[Any], dict[str, Any]]:
    """The rows of a JSON lines file or a JSON array, compressed or not (data=chat's
    conversations), and what was read; refused as ``read_file`` refuses."""
    compression = COMPRESSED.get(path.suffix.lower())
    raw = _read_bytes(path, compression)
    decoded, invalid = _decode(path, raw)
    rows = _json_rows(path, decoded)
    report = {"path": str(path), "compression": compression or "none", "bytes": len(raw)}
    return rows, {**report, "format": "json", "rows": len(rows), "invalid_bytes": invalid}


def _read_bytes(path: Path, compression: str | None) -> bytes:
    """The file's bytes, decompressed as its name says; compressed bytes under a
    plain name are refused (they would train as noise)."""
    with open(path, "rb") as f:
        head = f.read(10)
    found = next((name for name, looks in MAGIC.items() if looks(head)), None)
    if found and found != compression:
        suffix = next(k for k, v in COMPRESSED.items() if v == found)
        raise _not_text(
            path,
            f"its bytes are {found}-compressed, but its name does not say so: name it "
            f"{path.name}{suffix}",
        )
    if compression is None:
        return path.read_bytes()
    decompress = _decompressor(path, compression)
    try:
        return decompress(path.read_bytes())
    except (OSError, EOFError, lzma.LZMAError, ValueError) as err:  # zstandard's: ValueError
        raise _not_text(path, f"it does not decompress as {compression} ({err})") from None


def _decompressor(path: Path, compression: str) -> Any:
    if compression == "zstd":
        try:
            import zstandard
        except ImportError:
            raise ConfigError(
                f"data.files: {path} is zstd-compressed; reading it needs zstandard: "
                "pip install zstandard (the hf extra has it)"
            ) from None
        return lambda data: zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
    return {"gzip": gzip.decompress, "bzip2": bz2.decompress, "xz": lzma.decompress}[compression]


def _decode(path: Path, raw: bytes) -> tuple[str, int]:
    """UTF-8 text and how many of its bytes were not valid UTF-8 (then U+FFFD)."""
    if b"\x00" in raw:
        at = raw.index(b"\x00")
        raise _not_text(path, f"it holds NUL bytes (the first at byte {at}): a binary, not text")
    text = raw.decode("utf-8", errors="surrogateescape")
    invalid = len(_INVALID.findall(text))
    if invalid > MAX_INVALID * max(1, len(raw)):
        raise _not_text(
            path,
            f"{invalid} of its {len(raw)} bytes ({invalid / len(raw):.1%}) are not valid UTF-8 "
            f"(at most {MAX_INVALID:.1%} are read as U+FFFD); convert it, e.g. "
            "iconv -f latin1 -t utf-8",
        )
    return (_INVALID.sub("\ufffd", text) if invalid else text), invalid


def _json_rows(path: Path, text: str) -> list[Any]:
    if text.lstrip().startswith("["):  # one JSON array
        try:
            rows = json.loads(text)
        except ValueError as err:
            raise _not_text(path, f"it is not JSON ({err})") from None
        return rows if isinstance(rows, list) else [rows]
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as err:
                raise _not_text(path, f"line {number} is not JSON ({err})") from None
    return rows


def _not_text(path: Path, why: str) -> ConfigError:
    return ConfigError(f"data.files: {path} cannot be read as text: {why}")
