"""``data=text``: local text files (a glob or a list of them), tokenized once into token
files and cached, then read window by window like ``data=token_file`` (docs/text.md).

- Input: any text files (each file one document, or each non-empty line one:
  ``document``), JSON lines (``.jsonl``/``.json``, or a ``.json`` array) and parquet
  (``.parquet``) by their ``column``; each compressed or not (``.gz``, ``.bz2``,
  ``.xz``, ``.zst``: read through, the name before it saying the format). Refused
  before any work, naming the file: a binary (NUL bytes), text that is not UTF-8
  beyond ``MAX_INVALID`` of its bytes, compressed bytes under a plain name, a JSON
  line that does not parse, a column no row has. ``source.json`` says per file what
  was read and how.
- A tokenizer: a ``tokenizer.json`` or a Hugging Face tokenizer directory; bytes when
  none is given (``tokenizer: null``: 257 ids, no package needed).
- Documents are split into train and validation by document (a fixed
  ``val_fraction`` of them, chosen with ``split_seed``; one document: its last
  tokens), each ending with the end-of-document token. ``packing: windows`` (the
  default): joined and cut into ``seq_len`` windows, where a token attends to the
  documents before it in its window (any model takes them). ``packing: documents``:
  whole documents packed into rows whose attention and positions restart at each
  document (packing.py; a document longer than a row is cut into pieces); the model
  takes ``position_ids`` (model=gpt and model=hf do).
- The token files and their sidecar JSON go to ``cache_dir/<key>/``, where the key is
  the files (names, sizes, modification times), the tokenizer and the options: a
  second run with the same key reads them instead of tokenizing again. One process
  tokenizes; the others of a launch wait for it (a file lock).
"""

from __future__ import annotations

import bz2
import glob
import gzip
import hashlib
import io
import json
import logging
import lzma
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ..contract import ConfigError, DataLoaders, load_tokenizer, locked, make_loaders, require
from .packing import PackedRows, pack, pieces
from .token_file import token_file, write_tokens

log = logging.getLogger(__name__)

DOCUMENTS = ("file", "line")
PACKING = ("windows", "documents")  # join and cut | whole documents, attention per document
CACHE_FORMAT = 2  # part of the key: a change to how files are read or written makes new ones
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


def text(
    files: str | list[str],
    batch_size: int,
    seed: int,
    vocab_size: int,
    tokenizer: str | None = None,
    eos_token: str = "<|endoftext|>",
    document: str = "file",
    column: str = "text",
    seq_len: int = 256,
    val_fraction: float = 0.1,
    split_seed: int = 0,
    windows: str = "random",
    samples_per_epoch: int | None = None,
    packing: str = "windows",
    cache_dir: str = ".cache/text",
    val_batch_size: int = 64,
    num_workers: int = 0,
    pin_memory: bool | None = None,
) -> DataLoaders:
    """Loaders over the token files of ``files`` (module docstring). ``vocab_size`` is
    the tokenizer's (``${tokenizer_vocab:...}``; models read it as ``${data.vocab_size}``)."""
    require("data.document", document, document in DOCUMENTS, f"one of {', '.join(DOCUMENTS)}")
    require("data.packing", packing, packing in PACKING, f"one of {', '.join(PACKING)}")
    packed = packing == "documents"
    ok = isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len >= 1
    require("data.seq_len", seq_len, ok, "an integer >= 1")
    require(
        "data.val_fraction",
        val_fraction,
        isinstance(val_fraction, int | float) and 0 < val_fraction < 1,
        "a number between 0 and 1 (exclusive)",
    )
    paths = find_files(files)
    codec = load_tokenizer(tokenizer, eos_token)
    require(
        "data.vocab_size",
        vocab_size,
        vocab_size == codec.vocab_size,
        f"the tokenizer's vocabulary size, {codec.vocab_size}",
    )
    options = (document, column, val_fraction, split_seed, *([packing, seq_len] if packed else []))
    key = cache_key(paths, codec.fingerprint(), *options)
    folder = Path(cache_dir) / key
    with locked(Path(cache_dir) / f"{key}.lock"):  # one process of a launch tokenizes
        if not (folder / "source.json").is_file():
            split = _split_documents(paths, codec, document, column, val_fraction, split_seed)
            _write(folder, codec, split, seq_len if packed else None)
    if packed:
        return make_loaders(
            PackedRows(folder / "train.npy"),
            PackedRows(folder / "val.npy"),
            batch_size=batch_size,
            val_batch_size=val_batch_size,
            seed=seed,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )
    meta = json.loads((folder / "train.json").read_text())
    return token_file(
        batch_size=batch_size,
        seed=seed,
        train_path=str(folder / "train.bin"),
        val_path=str(folder / "val.bin"),
        vocab_size=vocab_size,
        seq_len=seq_len,
        dtype=meta["dtype"],
        windows=windows,
        samples_per_epoch=samples_per_epoch,
        val_batch_size=val_batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


text.resume_may_change = ("num_workers", "pin_memory", "val_batch_size", "cache_dir")


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


def cache_key(paths: list[Path], tokenizer: str, *options: Any) -> str:
    parts = [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in paths]
    digest = hashlib.sha256(json.dumps([CACHE_FORMAT, parts, tokenizer, *options]).encode())
    return digest.hexdigest()[:20]


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


def check_round_trip(codec: Any, documents: list[str], sample: int = 200) -> float:
    """The share of (up to ``sample``, spread over the corpus) documents that the
    tokenizer does not give back unchanged; a warning when any: a byte-level BPE
    trained without the byte alphabet, or a normalising one, loses characters."""
    if not documents:
        return 0.0
    step = max(1, len(documents) // sample)
    picked = documents[::step][:sample]
    ids = codec.encode_batch(picked)
    lost = [d for d, i in zip(picked, ids, strict=True) if codec.decode(i) != d]
    share = len(lost) / len(picked)
    if lost:
        first = next(
            (c for c in lost[0] if c not in codec.decode(codec.encode_batch([c])[0])), None
        )
        log.warning(
            f"data.tokenizer: {share:.0%} of {len(picked)} documents sampled do not come back "
            f"unchanged from encode then decode (e.g. {first!r}): the tokenizer loses "
            "characters (a byte-level BPE needs initial_alphabet=ByteLevel.alphabet(); "
            "docs/text.md)"
        )
    return share


def _split_documents(paths, codec, document, column, val_fraction, split_seed) -> dict[str, Any]:
    """Every file read and tokenized: the train and validation documents (token ids,
    each ending with the end-of-document token) and what was read, per file."""
    documents, reports = [], []
    for path in paths:
        texts, report = read_file(path, document, column)
        documents.extend(texts)
        reports.append(report)
    require("data.files", [str(p) for p in paths], bool(documents), "files holding some text")
    check_round_trip(codec, documents)
    eos = np.array([codec.eos_id], dtype=np.int64)
    encoded = codec.encode_batch(documents)
    ids = [np.concatenate([np.asarray(d, dtype=np.int64), eos]) for d in encoded]
    order = list(range(len(ids)))
    random.Random(split_seed).shuffle(order)
    n_val = max(1, round(len(ids) * val_fraction)) if len(ids) > 1 else 0
    train, val = [ids[i] for i in sorted(order[n_val:])], [ids[i] for i in sorted(order[:n_val])]
    if not n_val:  # one document: its last tokens validate
        cut = len(train[0]) - max(1, round(len(train[0]) * val_fraction))
        train, val = [train[0][:cut]], [train[0][cut:]]
    return {"train": train, "val": val, "files": reports, "documents": (len(ids) - n_val, n_val)}


def _write(folder: Path, codec: Any, split: dict[str, Any], seq_len: int | None) -> None:
    """The token files of a split (``seq_len``: packed rows, else the documents joined)
    and source.json into ``folder``, which appears whole or not at all."""
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    report: dict[str, Any] = {"tokens": {}}
    for name in ("train", "val"):
        docs = split[name]
        report["tokens"][name] = sum(len(d) for d in docs)
        if seq_len is None:
            joined = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
            write_tokens(tmp / f"{name}.bin", joined, codec.vocab_size)
            continue
        cut = [p for d in docs for p in pieces(d, np.ones_like(d), seq_len + 1)]
        rows, packed = pack(cut, seq_len, codec.eos_id)
        require("data.seq_len", seq_len, len(rows) > 0, f"a length the {name} documents fill")
        np.save(tmp / f"{name}.npy", rows)
        report.setdefault("packing", {})[name] = {**packed, "pieces": len(cut)}
    train_docs, val_docs = split["documents"]
    (tmp / "source.json").write_text(
        json.dumps(
            {
                "files": split["files"],  # per file: how it was read, documents, bytes
                "documents": {"train": train_docs, "val": val_docs},
                **report,  # tokens per split; packed: rows, pieces, padding, targets
                "tokenizer": codec.source or "bytes",
                "eos_id": codec.eos_id,
            },
            indent=2,
        )
        + "\n"
    )
    os.replace(tmp, folder)  # complete or absent: a reader never sees half of it
