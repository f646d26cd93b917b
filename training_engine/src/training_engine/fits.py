"""Does the built model fit the data? Checked before any work, so that a model whose
vocabulary is smaller than the data's, or whose positions are fewer than a
sample's tokens, stops with one message naming both values (exit 2) instead of an
``IndexError`` somewhere in preflight or the first step.

Read from the model the way transformers exposes it (``get_input_embeddings()``,
``config.max_position_embeddings``/``n_positions``) or, for any other module, its
first ``nn.Embedding`` and a ``seq_len`` attribute; from the data, the config keys
``vocab_size`` and ``seq_len`` that models read (``${data.vocab_size}``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .config import ConfigError

POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")


def check_model_fits_data(model: nn.Module, data: Any) -> None:
    """ConfigError naming both values when the model cannot take the data's tokens."""
    vocab, seq_len = data.get("vocab_size"), data.get("seq_len")
    embedding = input_embedding(model)
    if _is_int(vocab) and embedding is not None and embedding.num_embeddings < vocab:
        raise ConfigError(
            f"the model's input embedding has {embedding.num_embeddings} rows, but "
            f"data.vocab_size={vocab}: token ids up to {vocab - 1} would not fit. Give the model "
            f"a vocabulary of at least {vocab} (its YAML: vocab_size: " + "${data.vocab_size})"
        )
    positions = model_positions(model)
    if _is_int(seq_len) and positions is not None and positions < seq_len:
        raise ConfigError(
            f"data.seq_len={seq_len} is not allowed with this model: it takes at most "
            f"{positions} positions; expected data.seq_len <= {positions}"
        )


def input_embedding(model: nn.Module) -> nn.Embedding | None:
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            found = get()
        except NotImplementedError:  # a transformers model that does not say
            found = None
        if isinstance(found, nn.Embedding):
            return found
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def model_positions(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for key in POSITION_KEYS:
        value = getattr(config, key, None)
        if _is_int(value):
            return value
    value = getattr(model, "seq_len", None)
    return value if _is_int(value) else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
