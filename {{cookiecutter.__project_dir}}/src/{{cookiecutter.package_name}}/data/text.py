"""``data=text``: local text files (a glob or a list of them), tokenized once into token
files and cached, then read window by window like ``data=token_file`` (docs/text.md).

- Input: any text files (each file one document, or each non-empty line one:
  ``document``), JSON lines (``.jsonl``/``.json``) and parquet (``.parquet``) by their
  ``column``.
- A tokenizer: a ``tokenizer.json`` or a Hugging Face tokenizer directory; bytes when
  none is given (``tokenizer: null``: 257 ids, no package needed).
- Documents are joined with the end-of-document token and split into train and
  validation by document (a fixed ``val_fraction`` of them, chosen with
  ``split_seed``; one document: its last tokens), then packed into ``seq_len``
  windows.
- The token files and their sidecar JSON go to ``cache_dir/<key>/``, where the key is
  the files (names, sizes, modification times), the tokenizer and the options: a
  second run with the same key reads them instead of tokenizing again. One process
  tokenizes; the others of a launch wait for it (a file lock).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ..contract import DataLoaders, load_tokenizer, locked, require
from .token_file import token_file, write_tokens

DOCUMENTS = ("file", "line")
CACHE_FORMAT = 1  # part of the key: a change to how files are written makes new ones


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
    cache_dir: str = ".cache/text",
    val_batch_size: int = 64,
    num_workers: int = 0,
    pin_memory: bool | None = None,
) -> DataLoaders:
    """Loaders over the token files of ``files`` (module docstring). ``vocab_size`` is
    the tokenizer's (``${tokenizer_vocab:...}``; models read it as ``${data.vocab_size}``)."""
    require("data.document", document, document in DOCUMENTS, f"one of {', '.join(DOCUMENTS)}")
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
    key = cache_key(paths, codec.fingerprint(), document, column, val_fraction, split_seed)
    folder = Path(cache_dir) / key
    with locked(Path(cache_dir) / f"{key}.lock"):  # one process of a launch tokenizes
        if not (folder / "val.json").is_file():
            _tokenize_into(folder, paths, codec, document, column, val_fraction, split_seed)
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
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # the hf extra

        texts = [str(t) for t in pq.read_table(path, columns=[column]).column(column).to_pylist()]
    elif path.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
        texts = [str(row[column]) for row in rows if isinstance(row, dict) and column in row]
    else:
        texts = [path.read_text(encoding="utf-8", errors="replace")]
    if document == "line":
        return [line for t in texts for line in t.splitlines() if line.strip()]
    return [t for t in texts if t]


def _tokenize_into(folder, paths, codec, document, column, val_fraction, split_seed) -> None:
    documents = [d for path in paths for d in read_documents(path, document, column)]
    require("data.files", [str(p) for p in paths], bool(documents), "files holding some text")
    ids = codec.encode_batch(documents)
    order = list(range(len(ids)))
    random.Random(split_seed).shuffle(order)
    n_val = max(1, round(len(ids) * val_fraction)) if len(ids) > 1 else 0
    val_docs, train_docs = sorted(order[:n_val]), sorted(order[n_val:])

    def joined(indices: list[int]) -> np.ndarray:
        eos = np.array([codec.eos_id], dtype=np.int64)
        parts = [part for i in indices for part in (np.asarray(ids[i], dtype=np.int64), eos)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    train, val = joined(train_docs), joined(val_docs)
    if not n_val:  # one document: its last tokens validate
        cut = len(train) - max(1, round(len(train) * val_fraction))
        train, val = train[:cut], train[cut:]
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_tokens(tmp / "train.bin", train, codec.vocab_size)
    write_tokens(tmp / "val.bin", val, codec.vocab_size)
    (tmp / "source.json").write_text(
        json.dumps(
            {
                "files": [str(p) for p in paths],
                "documents": {"train": len(train_docs), "val": len(val_docs)},
                "tokens": {"train": len(train), "val": len(val)},
                "tokenizer": codec.source or "bytes",
                "eos_id": codec.eos_id,
            },
            indent=2,
        )
        + "\n"
    )
    os.replace(tmp, folder)  # complete or absent: a reader never sees half of it
