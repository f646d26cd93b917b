"""``data=hf``: a Hugging Face ``datasets`` dataset from local files (csv, json,
parquet, arrow) or a directory written by ``save_to_disk``; two columns become a
batch's ``(inputs, targets)``. Offline: nothing is fetched from the Hub at run time.
Needs the ``hf`` extra (``pip install -e '.[hf]'``). docs/data.md.
"""

from typing import Any

import torch
from torch.utils.data import Dataset

from ..contract import LOADER_KEYS, ConfigError, DataLoaders, make_loaders, require

# datasets' packaged builders for local files, and "disk" for load_from_disk
FORMATS = ("csv", "json", "parquet", "arrow", "disk")


class Columns(Dataset):
    """A ``datasets.Dataset`` in torch format as ``(inputs, targets)`` samples;
    several input columns (a table's features) are stacked along the last axis."""

    def __init__(self, table: Any, inputs: list[str], targets: str) -> None:
        self.table, self.inputs, self.targets = table, inputs, targets

    def __len__(self) -> int:
        return len(self.table)

    def _inputs(self, rows: dict) -> Any:
        if len(self.inputs) == 1:
            return rows[self.inputs[0]]
        return torch.stack([rows[c].float() for c in self.inputs], dim=-1)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        row = self.table[int(index)]
        return self._inputs(row), row[self.targets]

    def __getitems__(self, indices: list[int]) -> list[tuple[Any, Any]]:
        # One Arrow read per batch instead of one per sample (DataLoader uses this).
        rows = self.table[list(indices)]
        return list(zip(self._inputs(rows), rows[self.targets], strict=True))


def hf(
    batch_size: int,
    seed: int,
    format: str,
    train_files: str | list[str],
    inputs: str | list[str],
    targets: str,
    val_files: str | list[str] | None = None,
    val_fraction: float = 0.2,
    split_seed: int = 0,
    train_split: str = "train",
    val_split: str = "validation",
    cache_dir: str | None = None,
    val_batch_size: int = 512,
    num_workers: int = 0,
    pin_memory: bool | None = None,
    vocab_size: int | None = None,
    seq_len: int | None = None,
) -> DataLoaders:
    """``format`` reads ``train_files`` (and ``val_files``; null: a fixed
    ``val_fraction`` of the training rows, split with ``split_seed``). With
    ``format=disk``, ``train_files`` is a ``save_to_disk`` directory: a Dataset, or a
    DatasetDict whose ``train_split``/``val_split`` are used. ``inputs`` names the
    column (or a list of columns, stacked) the model is called with, ``targets`` the
    column of what it predicts. Token columns: ``vocab_size`` and ``seq_len`` (the keys a
    language model reads, ``+data.vocab_size=N +data.seq_len=T``) are checked against
    the first rows: ids below ``vocab_size``, sequences of ``seq_len`` tokens."""
    if format not in FORMATS:
        hub = "/" in str(format) or str(format).isidentifier()
        raise ConfigError(
            f"data.format={format!r} is not allowed: expected one of {', '.join(FORMATS)}"
            + (
                ". Hub datasets are not downloaded at run time: save one once with "
                "datasets.load_dataset(NAME).save_to_disk(DIR), then data.format=disk "
                "data.train_files=DIR"
                if hub
                else ""
            )
        )
    require(
        "data.val_fraction",
        val_fraction,
        isinstance(val_fraction, int | float) and 0 < val_fraction < 1,
        "a number between 0 and 1 (exclusive)",
    )
    try:
        import datasets
    except ImportError as err:
        raise ConfigError("data=hf needs the datasets package: pip install -e '.[hf]'") from err

    train, val = _load(datasets, format, train_files, val_files, train_split, val_split, cache_dir)
    if val is None:
        parts = train.train_test_split(test_size=val_fraction, seed=split_seed, shuffle=True)
        train, val = parts["train"], parts["test"]
    columns = [inputs] if isinstance(inputs, str) else [str(c) for c in inputs]
    for key, value, names in [("inputs", inputs, columns), ("targets", targets, [targets])]:
        unknown = [c for c in names if c not in train.column_names]
        require(
            f"data.{key}",
            value if isinstance(value, str) else names,
            not unknown and bool(names),
            f"a column of {train_files}; it has: {', '.join(train.column_names)}",
        )
    for table in (train, val):
        table.set_format("torch", columns=[*columns, targets])
    _check_tokens(train, columns[0], vocab_size, seq_len)
    return make_loaders(
        Columns(train, columns, targets),
        Columns(val, columns, targets),
        batch_size=batch_size,
        val_batch_size=val_batch_size,
        seed=seed,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


hf.resume_may_change = (*LOADER_KEYS, "cache_dir")


def _check_tokens(table: Any, column: str, vocab_size: int | None, seq_len: int | None) -> None:
    """The values a language model reads from the data, against its first rows."""
    if vocab_size is None and seq_len is None:
        return
    rows = table[: min(len(table), 256)][column]
    rows = rows if isinstance(rows, torch.Tensor) else torch.stack(list(rows))
    if vocab_size is not None:
        largest = int(rows.max())
        require("data.vocab_size", vocab_size, largest < vocab_size, f"more than the id {largest}")
    if seq_len is not None:
        length = rows.shape[-1]
        require("data.seq_len", seq_len, length == seq_len, f"the {length} tokens of a row")


def _load(datasets, format, train_files, val_files, train_split, val_split, cache_dir):
    """(train, val or None) as ``datasets.Dataset`` objects."""
    if format == "disk":
        loaded = datasets.load_from_disk(str(train_files))
        if isinstance(loaded, datasets.DatasetDict):
            require(
                "data.train_split",
                train_split,
                train_split in loaded,
                f"a split of {train_files}; it has: {', '.join(loaded)}",
            )
            return loaded[train_split], loaded.get(val_split)
        return loaded, None
    files = {"train": train_files} | ({"validation": val_files} if val_files else {})
    loaded = datasets.load_dataset(format, data_files=files, cache_dir=cache_dir)
    return loaded["train"], loaded.get("validation")
