"""``data=text``: local text files (a glob or a list of them), tokenized once into token
files and cached, then read window by window like ``data=token_file`` (docs/text.md).

- Input: any text files (each file one document, or each non-empty line one:
  ``document``), JSON lines (``.jsonl``/``.json``, or a ``.json`` array) and parquet
  (``.parquet``) by their ``column``; each compressed or not. The engine's
  ``training_engine.text_files`` reads them, or refuses one before any work, naming
  it (a binary, text that is not UTF-8, compressed bytes under a plain name, ...).
  ``source.json`` says per file what was read and how.
- A tokenizer: a ``tokenizer.json`` or a Hugging Face tokenizer directory; bytes when
  none is given (``tokenizer: null``: 257 ids, no package needed).
- Documents are split into train and validation by document (a fixed
  ``val_fraction`` of them, chosen with ``split_seed``; one document: its last
  tokens), each ending with the end-of-document token. ``packing: windows`` (the
  default): joined and cut into ``seq_len`` windows, where a token attends to the
  documents before it in its window (any model takes them). ``packing: documents``:
  whole documents packed into rows whose attention and positions restart at each
  document (training_engine.packing; a document longer than a row is cut into pieces); the model
  takes ``position_ids`` (model=gpt and model=hf do).
- The token files and their sidecar JSON go to ``cache_dir/<key>/``, where the key is
  the files (names, sizes, modification times), the tokenizer and the options: a
  second run with the same key reads them instead of tokenizing again. One process
  tokenizes; the others of a launch wait for it (a file lock).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ..contract import (
    DataLoaders,
    PackedRows,
    find_files,
    load_tokenizer,
    locked,
    make_loaders,
    pack,
    pieces,
    read_file,
    require,
    token_file,
    write_tokens,
)

log = logging.getLogger(__name__)

DOCUMENTS = ("file", "line")
PACKING = ("windows", "documents")  # join and cut | whole documents, attention per document
CACHE_FORMAT = 2  # part of the key: a change to how files are read or written makes new ones


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


def cache_key(paths: list[Path], tokenizer: str, *options: Any) -> str:
    parts = [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in paths]
    digest = hashlib.sha256(json.dumps([CACHE_FORMAT, parts, tokenizer, *options]).encode())
    return digest.hexdigest()[:20]


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
