"""A small decoder-only transformer (GPT) for the token example: ``model=gpt data=tokens``.

Pre-norm blocks with causal self-attention through ``F.scaled_dot_product_attention``
(flash / memory-efficient kernels on GPUs) and a GELU MLP; learned positions. It
returns logits of shape (batch, seq_len, vocab_size); train.py's cross-entropy
treats every position as one prediction (task.py). ``flops_per_token`` lets train.py
report MFU (model FLOPs utilization) next to tokens/s.

Packed documents (training_engine.packing): ``position_ids`` that restart at 0 where a document
begins, as transformers models take them; each token then attends to the tokens of
its own document only (a block-diagonal causal mask, the documents found where the
position ids do not go up by one, as transformers finds them). ``model.peft=lora``
adapts the attention's projections (``peft_target_modules``).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..contract import require
from .digits import check_dropout


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_head, width // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,  # packed documents: block-diagonal and causal; else None
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None,
        )
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model, bias=False),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model, bias=False),
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), mask))
        return x + self.drop(self.mlp(self.norm2(x)))


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, T, T) bool: query i sees key j when j <= i in the same document; a
    document begins where the position ids do not go up by one."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    document = starts.cumsum(dim=1)
    same = document[:, :, None] == document[:, None, :]
    seq = position_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


class GPT(nn.Module):
    """``n_layer`` blocks of width ``d_model`` with ``n_head`` heads, over
    sequences of up to ``seq_len`` tokens from a vocabulary of ``vocab_size``."""

    # model.peft=lora's default target modules: the attention's projections
    peft_target_modules = ("qkv", "proj")

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 256,
        dropout: float = 0.0,
    ) -> None:
        for key, value in [("n_layer", n_layer), ("n_head", n_head), ("d_model", d_model)]:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            require(f"model.{key}", value, ok, "an integer >= 1")
        require(
            "model.d_model", d_model, d_model % n_head == 0, f"a multiple of model.n_head={n_head}"
        )
        check_dropout(dropout)
        super().__init__()
        self.seq_len = seq_len
        self.n_layer = n_layer
        self.d_model = d_model
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d_model)
        # Not tied to the token embedding: tied weights cannot sit in two FSDP units.
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # GPT-2: scale the residual projections
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def flops_per_token(self) -> int:
        """Training FLOPs (forward + backward) per token at full ``seq_len``:
        6 per weight of every linear layer, plus attention's 12 * layers * width * seq_len
        (PaLM, appendix B). Embedding lookups are not matmuls."""
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul_weights + 12 * self.n_layer * self.d_model * self.seq_len

    def flops_per_sample(self) -> int:
        """One sample is a sequence of ``seq_len`` tokens (preflight's MFU uses this)."""
        return self.flops_per_token() * self.seq_len

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``idx``; ``position_ids`` (batch, T): packed documents (module
        docstring), else one sequence per row from position 0."""
        if idx.shape[1] > self.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens > model.seq_len={self.seq_len}")
        mask = None
        if position_ids is None:
            pos = torch.arange(idx.shape[1], device=idx.device)
        else:
            pos, mask = position_ids, document_mask(position_ids)
        x = self.drop(self.tokens(idx) + self.positions(pos))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))
