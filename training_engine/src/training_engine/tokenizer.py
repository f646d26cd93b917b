"""The mapping between text and token ids of a run: a ``tokenizers`` tokenizer (a
``tokenizer.json``, or a Hugging Face tokenizer directory holding one), or bytes when
none is given (ids 0-255 are the UTF-8 bytes, 256 the end of a document). data=text
tokenizes with it, generate.py decodes with it, ``export --format hf`` writes it
beside the model (docs/text.md).

Bytes need no package; a tokenizer file needs ``tokenizers`` (the ``hf`` extra).
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import Any

from .config import ConfigError

EOS = "<|endoftext|>"  # the document separator's name in the bytes vocabulary
BYTES_VOCAB = 257  # 256 bytes + EOS
MAX_TOKENIZER_BYTES = 256 * 2**20


class TextTokenizer:
    """``encode``/``decode`` with one end-of-document id; ``inner`` is the
    ``tokenizers.Tokenizer`` (None: bytes)."""

    def __init__(self, inner: Any = None, eos_token: str = EOS, source: str | None = None) -> None:
        self.inner, self.source = inner, source
        if inner is None:
            self.vocab_size, self.eos_id = BYTES_VOCAB, BYTES_VOCAB - 1
        else:
            self.vocab_size = inner.get_vocab_size(with_added_tokens=True)
            eos = inner.token_to_id(eos_token)
            if eos is None:
                raise ConfigError(
                    f"data.eos_token={eos_token!r} is not allowed: the tokenizer {source} has "
                    "no such token; expected one of its special tokens (e.g. </s>, <|endoftext|>)"
                )
            self.eos_id = eos

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.inner is None:
            return [list(text.encode("utf-8")) for text in texts]
        return [e.ids for e in self.inner.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        if self.inner is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.inner.decode(ids, skip_special_tokens=False)

    def fingerprint(self) -> str:
        """Changes when the ids would (the tokenizer's own JSON)."""
        text = "bytes" if self.inner is None else self.inner.to_str()
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def as_tokenizers(self) -> Any:
        """The same mapping as a ``tokenizers.Tokenizer`` (bytes: a byte-level BPE
        without merges whose ids are the byte values), to save for transformers."""
        return self.inner if self.inner is not None else bytes_tokenizer()


def load_tokenizer(path: str | None, eos_token: str = EOS) -> TextTokenizer:
    """``path``: a ``tokenizer.json``, a directory holding one, or None (bytes)."""
    if path is None:
        return TextTokenizer()
    return _load(str(path), eos_token)


@cache
def _load(path: str, eos_token: str) -> TextTokenizer:
    file = tokenizer_file(path)
    size = file.stat().st_size
    if size > MAX_TOKENIZER_BYTES:  # read whole by tokenizers: bounded first
        raise ConfigError(
            f"data.tokenizer={path!r} is not allowed: {file} is {size} bytes, more than the "
            f"{MAX_TOKENIZER_BYTES} a tokenizer.json holds (published ones are a few MB)"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("data.tokenizer needs tokenizers: pip install -e '.[hf]'") from None
    try:
        inner = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception for any parse error
        why = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise ConfigError(
            f"data.tokenizer={path!r} is not allowed: {file} is not a tokenizer.json that "
            f"tokenizers reads ({why})"
        ) from None
    return TextTokenizer(inner, eos_token, source=str(file))


def tokenizer_file(path: str) -> Path:
    found = Path(path)
    if found.is_dir():
        found = found / "tokenizer.json"
    if not found.is_file():
        raise ConfigError(
            f"data.tokenizer={path!r} is not allowed: no such file; expected a tokenizer.json, "
            "a directory holding one (a Hugging Face tokenizer saved with save_pretrained), "
            "or null (bytes)"
        )
    return found


def vocab_size(path: str | None) -> int:
    """``${tokenizer_vocab:PATH}``: the vocabulary size a model needs for this tokenizer."""
    return BYTES_VOCAB if path in (None, "None", "") else load_tokenizer(path).vocab_size


def bytes_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab[EOS] = BYTES_VOCAB - 1
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, which byte-level BPE tokenizers use
    (tokenizers exposes the alphabet, not the mapping): printable bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(0x100 + i) for i, b in enumerate(others)},
    }


def save_for_transformers(
    tokenizer: TextTokenizer,
    directory: Path,
    model_max_length: int | None = None,
    chat_template: str | None = None,
) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` that ``AutoTokenizer`` reads:
    eos (also bos and pad: one end-of-document token), the model's context length
    (transformers' default is a 1e30 sentinel) and a chat model's template (chat.py)."""
    from transformers import PreTrainedTokenizerFast

    eos = tokenizer.as_tokenizers().id_to_token(tokenizer.eos_id)
    limit = {"model_max_length": model_max_length} if model_max_length else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.as_tokenizers(),
        eos_token=eos,
        bos_token=eos,
        pad_token=eos,
        **limit,
    )
    if chat_template is not None:
        fast.chat_template = chat_template  # saved beside it: chat_template.jinja
    fast.save_pretrained(str(directory))
