"""``data=chat``: supervised fine-tuning on conversations (docs/finetune.md).

- Input: JSON lines (or a JSON array), compressed or not, one conversation per row:
  ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}``
  (``column``). A row that is not one is refused before any work, naming the file
  and the row.
- Rendered with a chat template (the engine's chat.py: ``chat_template`` null is the
  tokenizer's own, else the default one) and tokenized with the run's tokenizer;
  ``loss_on: assistant`` (default) trains on the assistant's tokens only (its answer
  and the end-of-turn token; the template's generation block), ``all`` on every
  token. Evaluation counts the same tokens: val/loss and val/ppl are per counted token.
- A conversation longer than ``seq_len + 1`` tokens (``overlong``): ``truncate`` keeps
  its first ``seq_len + 1`` tokens (TRL's keep-start), ``drop`` leaves it out. A
  conversation left with no token to learn (loss_on=assistant, the answer cut off) is
  left out too. Each is counted in ``source.json`` and said in the log.
- ``packing: documents`` (default): conversations packed into rows that attend and
  count positions per conversation (training_engine.packing); ``none``: one per row, padded.
- Split into train and validation by conversation (``val_fraction``, ``split_seed``);
  cached in ``cache_dir/<key>/`` (the files, the tokenizer, the template and every
  option that changes the rows), one process building while the others wait.
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
    ConfigError,
    DataLoaders,
    PackedRows,
    chat_tokenizer,
    check_messages,
    encode_chat,
    find_files,
    json_rows,
    load_tokenizer,
    locked,
    make_loaders,
    pack,
    require,
)
from ..contract import chat_template as find_chat_template
from .text import cache_key

log = logging.getLogger(__name__)

LOSS_ON = ("assistant", "all")
OVERLONG = ("truncate", "drop")
PACKING = ("documents", "none")


def chat(
    files: str | list[str],
    batch_size: int,
    seed: int,
    vocab_size: int,
    tokenizer: str | None = None,
    eos_token: str = "<|endoftext|>",
    chat_template: str | None = None,
    column: str = "messages",
    loss_on: str = "assistant",
    seq_len: int = 256,
    overlong: str = "truncate",
    packing: str = "documents",
    val_fraction: float = 0.1,
    split_seed: int = 0,
    cache_dir: str = ".cache/chat",
    val_batch_size: int = 32,
    num_workers: int = 0,
    pin_memory: bool | None = None,
) -> DataLoaders:
    """Loaders of packed rows ``(inputs, targets, positions)`` of the conversations in
    ``files`` (module docstring); targets the loss ignores are -100."""
    require("data.loss_on", loss_on, loss_on in LOSS_ON, f"one of {', '.join(LOSS_ON)}")
    require("data.overlong", overlong, overlong in OVERLONG, f"one of {', '.join(OVERLONG)}")
    require("data.packing", packing, packing in PACKING, f"one of {', '.join(PACKING)}")
    ok = isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len >= 2
    require("data.seq_len", seq_len, ok, "an integer >= 2")
    ok = isinstance(val_fraction, int | float) and 0 < val_fraction < 1
    require("data.val_fraction", val_fraction, ok, "a number between 0 and 1 (exclusive)")
    paths = find_files(files)
    codec = load_tokenizer(tokenizer, eos_token)
    require(
        "data.vocab_size",
        vocab_size,
        vocab_size == codec.vocab_size,
        f"the tokenizer's vocabulary size, {codec.vocab_size}",
    )
    template = find_chat_template(chat_template, tokenizer)
    digest = hashlib.sha256(template.encode()).hexdigest()[:16]
    options = (column, loss_on, seq_len, overlong, packing, val_fraction, split_seed, digest)
    key = cache_key(paths, codec.fingerprint(), *options)
    folder = Path(cache_dir) / key
    with locked(Path(cache_dir) / f"{key}.lock"):  # one process of a launch builds
        if not (folder / "source.json").is_file():
            rendered = Rendering(codec, template, loss_on, seq_len, overlong, packing)
            _build(folder, paths, column, rendered, val_fraction, split_seed)
    return make_loaders(
        PackedRows(folder / "train.npy"),
        PackedRows(folder / "val.npy"),
        batch_size=batch_size,
        val_batch_size=val_batch_size,
        seed=seed,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


chat.resume_may_change = ("num_workers", "pin_memory", "val_batch_size", "cache_dir")


def read_conversations(path: Path, column: str) -> tuple[list[list[dict]], dict[str, Any]]:
    """The conversations of one file, checked, and what was read (for source.json)."""
    rows, report = json_rows(path)
    conversations = []
    for number, row in enumerate(rows, start=1):
        messages = row.get(column) if isinstance(row, dict) else None
        if messages is None:
            keys = sorted(row)[:10] if isinstance(row, dict) else type(row).__name__
            raise ConfigError(
                f"data.files: {path} row {number} has no {column!r} (data.column) list of "
                f"messages; it has {keys}"
            )
        conversations.append(check_messages(messages, f"data.files: {path} row {number}"))
    return conversations, {**report, "conversations": len(conversations)}


class Rendering:
    """How conversations become packed rows: template, loss mask, length rule."""

    def __init__(self, codec, template, loss_on, seq_len, overlong, packing) -> None:
        self.codec, self.template, self.loss_on = codec, template, loss_on
        self.seq_len, self.overlong, self.packing = seq_len, overlong, packing
        self.tokenizer = chat_tokenizer(codec, template)

    def documents(self, conversations: list[list[dict]]) -> tuple[list, dict[str, int]]:
        """(ids, target mask) per conversation kept, and how many were cut or left out."""
        counts = {"read": len(conversations), "truncated": 0, "dropped": 0, "no_targets": 0}
        kept = []
        limit = self.seq_len + 1  # n tokens give n - 1 predictions
        for ids, assistant in encode_chat(self.tokenizer, conversations):
            ids = np.asarray(ids, dtype=np.int64)
            mask = np.asarray(assistant if self.loss_on == "assistant" else [1] * len(ids))
            if len(ids) > limit:
                if self.overlong == "drop":
                    counts["dropped"] += 1
                    continue
                counts["truncated"] += 1
                ids, mask = ids[:limit], mask[:limit]
            if not mask[1:].any():  # nothing to learn from it (e.g. the answer cut off)
                counts["no_targets"] += 1
                continue
            kept.append((ids, mask))
        return kept, counts

    def rows(self, documents: list) -> tuple[np.ndarray, dict[str, Any]]:
        if self.packing == "documents":
            return pack(documents, self.seq_len, self.codec.eos_id)
        parts = [pack([d], self.seq_len, self.codec.eos_id) for d in documents]  # one per row
        rows = np.concatenate([r for r, _ in parts]) if parts else np.zeros((0, 3, self.seq_len))
        targets = sum(report["targets"] for _, report in parts)
        report = {"rows": len(rows), "documents": len(parts), "targets": targets}
        return rows.astype(np.int32), report


def _build(folder, paths, column, rendering, val_fraction, split_seed) -> None:
    conversations, reports = [], []
    for path in paths:
        found, report = read_conversations(path, column)
        conversations.extend(found)
        reports.append(report)
    names = [str(p) for p in paths]
    require("data.files", names, len(conversations) >= 2, "2 conversations or more")
    order = list(range(len(conversations)))
    random.Random(split_seed).shuffle(order)
    n_val = max(1, round(len(order) * val_fraction))
    split = {"train": sorted(order[n_val:]), "val": sorted(order[:n_val])}
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    source: dict[str, Any] = {"files": reports, "conversations": {}, "packing": {}}
    for name, indices in split.items():
        documents, counts = rendering.documents([conversations[i] for i in indices])
        rows, packed = rendering.rows(documents)
        require("data.files", names, len(rows) > 0, f"{name} conversations to learn from")
        np.save(tmp / f"{name}.npy", rows)
        source["conversations"][name] = counts
        source["packing"][name] = packed
        cut = counts["truncated"] + counts["dropped"] + counts["no_targets"]
        if cut:
            log.warning(
                f"data=chat ({name}): of {counts['read']} conversations, {counts['truncated']} "
                f"truncated and {counts['dropped']} dropped as longer than data.seq_len + 1 = "
                f"{rendering.seq_len + 1} tokens (data.overlong={rendering.overlong}), "
                f"{counts['no_targets']} left out with no token to learn (source.json)"
            )
    source |= {
        "tokenizer": rendering.codec.source or "bytes",
        "eos_id": rendering.codec.eos_id,
        "loss_on": rendering.loss_on,
        "chat_template": rendering.template,
    }
    (tmp / "source.json").write_text(json.dumps(source, indent=2) + "\n")
    os.replace(tmp, folder)  # complete or absent: a reader never sees half of it
