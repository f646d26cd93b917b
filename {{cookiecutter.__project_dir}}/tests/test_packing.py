"""Packed documents do not see each other (training_engine.packing, docs/finetune.md): a
document's logits are its logits alone whatever is packed before it, for model=gpt and
for transformers models (GPT-2, Llama) called the way the task calls them; rows are
packed tightly, positions restart per document, the targets of padding are ignored;
data=text's ``packing: documents`` keeps every document's tokens.

Measured here (CPU, float32): a document alone and the same document packed after
another differ by at most 1.8e-7 (model=gpt), 1.5e-7 (GPT-2) and 1.2e-7 (Llama) in
their logits: the masked attention's other kernel, not leaked attention, which the
same models show at 0.16 to 0.46 when a transformers model keeps its cache."""

import json

import numpy as np
import pytest
import torch

from {{ cookiecutter.package_name }}.contract import IGNORE, pack, pieces
from {{ cookiecutter.package_name }}.data.text import text
from {{ cookiecutter.package_name }}.models.gpt import GPT
from {{ cookiecutter.package_name }}.tasks.language_model import LanguageModel

TOLERANCE = 1e-5  # float32 rounding; a leak across documents is of order 0.1


def alone_and_packed(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of a 30-token document alone, and packed after a 20-token one and
    before padding, as the language-model task calls the model."""
    task, generator = LanguageModel(), torch.Generator().manual_seed(0)
    before, doc, after = (torch.randint(0, 257, (1, n), generator=generator) for n in (20, 30, 14))
    row = torch.cat([before, doc, after], dim=1)
    positions = torch.cat([torch.arange(20), torch.arange(30), torch.arange(14)])[None]
    with torch.no_grad():
        alone = task.logits(task.call_model(model, (doc, doc, torch.arange(30)[None])))
        packed = task.logits(task.call_model(model, (row, row, positions)))[:, 20:50]
    return alone, packed


def test_model_gpt_does_not_attend_across_packed_documents():
    torch.manual_seed(0)
    model = GPT(vocab_size=257, seq_len=64, n_layer=2, n_head=2, d_model=64).eval()
    alone, packed = alone_and_packed(model)
    assert torch.allclose(alone, packed, rtol=0, atol=TOLERANCE)
    with torch.no_grad():  # one document from 0: the same as without position ids
        assert torch.equal(model(torch.arange(30)[None]), model(torch.arange(30)[None], None))


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_a_transformers_model_does_not_attend_across_packed_documents(model_type):
    transformers = pytest.importorskip("transformers", reason="the hf extra")
    sizes = {
        "gpt2": {"n_positions": 64, "n_layer": 2, "n_head": 2, "n_embd": 64},
        "llama": {
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        },
    }[model_type]  # fmt: skip
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=257, bos_token_id=256, eos_token_id=256, **sizes
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    alone, packed = alone_and_packed(model.eval())
    assert torch.allclose(alone, packed, rtol=0, atol=TOLERANCE)


def test_rows_are_packed_tightly_with_positions_restarting_and_padding_ignored():
    sizes = [9, 5, 4, 3, 2, 2]  # tokens per document: 8, 4, 3, 2, 1, 1 positions
    docs = [(np.arange(n) + 10 * i, np.ones(n, dtype=np.int64)) for i, n in enumerate(sizes)]
    docs[1][1][:2] = 0  # document 1's first two tokens are a prompt: not targets
    rows, report = pack(docs, seq_len=8, pad_id=256)
    assert report["rows"] == 3 and report["documents"] == 6  # 19 positions in 3 rows of 8
    assert report["padding"] == round(1 - 19 / 24, 4)
    inputs, targets, positions = rows[:, 0], rows[:, 1], rows[:, 2]
    assert inputs[0].tolist() == list(range(8)) and targets[0].tolist() == list(range(1, 9))
    assert positions[0].tolist() == list(range(8))
    # best fit: the 4-position document, then the 3- and the 1-position ones fill a row
    assert positions[1].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert targets[1][:4].tolist() == [IGNORE, 12, 13, 14]  # its prompt is not learned
    # the last row: what is left, then padding (its own positions, no targets)
    assert (targets[2] == IGNORE).sum() == 8 - 3 and inputs[2][-1] == 256
    assert report["targets"] == int((targets != IGNORE).sum()) == 19 - 1
    # a document longer than a row: pieces that overlap by one token, each target once
    cut = pieces(np.arange(20), np.ones(20), limit=9)
    assert [p[0][0] for p in cut] == [0, 8, 16] and sum(len(p[0]) - 1 for p in cut) == 19


def test_text_packed_by_document_keeps_every_token(tmp_path):
    docs = ["first document\nwith two lines", "a second, longer document " * 6, "third"]
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d)
    cache = tmp_path / "cache"
    loaders = text(
        files=str(tmp_path / "*.txt"), batch_size=2, seed=0, vocab_size=257, seq_len=32,
        packing="documents", val_fraction=0.3, cache_dir=str(cache),
    )  # fmt: skip
    inputs, targets, positions = next(iter(loaders.val))
    assert inputs.shape == targets.shape == positions.shape
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    source = json.loads((folder / "source.json").read_text())
    packed = source["packing"]
    # every token but a document's first is a target once (pieces overlap by one token)
    assert packed["train"]["pieces"] > source["documents"]["train"]  # the long one is cut
    for split in ("train", "val"):
        counted = source["tokens"][split] - source["documents"][split]
        assert packed[split]["targets"] == counted, split
        rows = np.load(folder / f"{split}.npy")
        assert int((rows[:, 1] != IGNORE).sum()) == counted
