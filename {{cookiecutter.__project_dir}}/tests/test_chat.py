"""data=chat (docs/finetune.md): the loss covers exactly the assistant's tokens of a
hand-checked conversation (its answers and their end-of-turn token, not the headers,
the system or the user); a template renders and tokenizes back to the same text, with
the bytes and with a BPE trained as docs/text.md says; conversations over the context
are truncated or dropped and counted; a row that is no conversation is refused, named."""

import json
from pathlib import Path

import numpy as np
import pytest
from training_engine.config import ConfigError

from {{ cookiecutter.package_name }}.contract import IGNORE
from {{ cookiecutter.package_name }}.data.chat import chat

pytest.importorskip("transformers", reason="chat templates are transformers' (the hf extra)")

from training_engine.chat import DEFAULT, chat_tokenizer, encode
from training_engine.tokenizer import load_tokenizer

CONVERSATION = [
    {"role": "system", "content": "Add."},
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": "5."},
    {"role": "user", "content": "And 1+1, café?"},
    {"role": "assistant", "content": "2 ✓"},
]
RENDERED = (
    "<|system|>\nAdd.\n<|user|>\n2+3?\n<|assistant|>\n5.<|endoftext|>\n"
    "<|user|>\nAnd 1+1, café?\n<|assistant|>\n2 ✓<|endoftext|>\n"
)


def write(path: Path, conversations: list) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def rows(cache: Path, split: str = "train") -> tuple[np.ndarray, dict]:
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    return np.load(folder / f"{split}.npy"), json.loads((folder / "source.json").read_text())


def test_the_loss_covers_exactly_the_assistants_tokens(tmp_path):
    """Bytes: the assistant's tokens are '5.', eos, '2 ✓', eos; nothing else is a target."""
    tokenizer = chat_tokenizer(load_tokenizer(None), DEFAULT)
    ((ids, mask),) = encode(tokenizer, [CONVERSATION])
    assert tokenizer.decode(ids) == RENDERED  # the template round trip
    parts = [list(part.encode()) for part in RENDERED.split("<|endoftext|>")]
    assert ids == [*parts[0], 256, *parts[1], 256, *parts[2]]  # UTF-8 bytes, eos 256
    said = [i for i, m in zip(ids, mask, strict=True) if m]
    assert said == [*b"5.", 256, *"2 ✓".encode(), 256]
    assert sum(mask) == len(said) == 9 and mask[-1] == 0  # the newline after eos: not said

    files = write(tmp_path / "chat.jsonl", [CONVERSATION] * 4)
    cache = tmp_path / "cache"
    loaders = chat(
        files=str(files), batch_size=2, seed=0, vocab_size=257, seq_len=128,
        val_fraction=0.25, cache_dir=str(cache),
    )  # fmt: skip
    train, source = rows(cache)
    targets = train[:, 1][train[:, 1] != IGNORE]
    assert targets.tolist() == said * 3  # 3 conversations trained on, 1 validates
    assert source["conversations"]["train"] == {
        "read": 3, "truncated": 0, "dropped": 0, "no_targets": 0
    }  # fmt: skip
    batch = next(iter(loaders.val))
    assert len(batch) == 3 and int((batch[1] != IGNORE).sum()) == 9
    # loss_on=all: every token but each conversation's first is a target
    chat(
        files=str(files), batch_size=2, seed=0, vocab_size=257, seq_len=128,
        val_fraction=0.25, cache_dir=str(tmp_path / "all"), loss_on="all",
    )  # fmt: skip
    everything, _ = rows(tmp_path / "all")
    assert int((everything[:, 1] != IGNORE).sum()) == 3 * (len(ids) - 1)


def test_a_bpe_tokenizer_round_trips_the_template_and_keeps_the_mask(tmp_path):
    """A byte-level BPE trained as docs/text.md says (initial_alphabet: every byte)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([RENDERED.replace("<|endoftext|>", "")] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    codec = load_tokenizer(str(tmp_path / "tokenizer.json"))
    tokenizer = chat_tokenizer(codec, DEFAULT)
    ((ids, mask),) = encode(tokenizer, [CONVERSATION])
    assert tokenizer.decode(ids) == RENDERED and codec.decode(ids) == RENDERED
    said = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert said == "5.<|endoftext|>2 ✓<|endoftext|>"


def test_conversations_over_the_context_are_truncated_or_dropped_and_counted(tmp_path):
    short = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2."}]
    long_answer = [
        {"role": "user", "content": "Count."},
        {"role": "assistant", "content": "1 " * 40},
    ]
    long_question = [{"role": "user", "content": "x" * 80}, {"role": "assistant", "content": "y"}]
    files = write(tmp_path / "c.jsonl", [short, long_answer, long_question] * 4)
    common = {"files": str(files), "batch_size": 2, "seed": 0, "vocab_size": 257, "seq_len": 48}
    chat(**common, cache_dir=str(tmp_path / "truncate"), val_fraction=0.25)
    _, source = rows(tmp_path / "truncate")
    counts = [source["conversations"][s] for s in ("train", "val")]
    # the long answer is cut (kept: its start is learned); the long question loses the
    # answer entirely (nothing to learn: left out); both counted
    assert sum(c["read"] for c in counts) == 12
    assert sum(c["truncated"] for c in counts) == 8 and sum(c["no_targets"] for c in counts) == 4
    chat(**common, cache_dir=str(tmp_path / "drop"), val_fraction=0.25, overlong="drop")
    _, source = rows(tmp_path / "drop")
    counts = [source["conversations"][s] for s in ("train", "val")]
    assert sum(c["dropped"] for c in counts) == 8 and sum(c["truncated"] for c in counts) == 0


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"text": "no messages"}, "row 2 has no 'messages'"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "row 2: message 0 is"),
        ({"messages": "hi"}, "row 2: messages must be a non-empty list"),
    ],
)
def test_a_row_that_is_no_conversation_is_refused_naming_the_file_and_row(tmp_path, row, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError) as err:
        chat(files=str(path), batch_size=2, seed=0, vocab_size=257, cache_dir=str(tmp_path / "c"))
    assert str(path) in str(err.value) and expected in str(err.value)
