"""A Hugging Face ``transformers`` GPT-2 plugged in as a user plugs in a model of
their own (docs/own-model.md, "Add your own model and data"): a function whose arguments are
the config keys, here ``model=gpt``'s (``model._target_=engine_tests.hf_gpt2.gpt2``). Built
from a config (no download), with GPT-2's tied embeddings: ``lm_head.weight`` is
``transformer.wte.weight``. It returns a ``ModelOutput``; the task reads its ``.logits``.
"""

import torch


def gpt2(
    vocab_size: int,
    seq_len: int,
    n_layer: int = 2,
    n_head: int = 2,
    d_model: int = 32,
    dropout: float = 0.0,
) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        n_embd=d_model,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        tie_word_embeddings=True,
        bos_token_id=0,  # inside this small vocabulary (GPT-2's own is 50256)
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)
