"""generate.py's work: continue a prompt with a trained causal language model (any of
the project's: model=gpt, model=hf, yours), one process. The run's tokenizer encodes
and decodes (data=text: its ``data.tokenizer``, or bytes); data without one (token
files of ids) takes and gives token ids. Greedy by default; ``temperature`` and
``top_k`` sample from a generator seeded with ``seed`` (the run's, or the command
line's): the same seed, the same text (docs/text.md).

A chat model takes ``messages`` instead of a prompt (a list of ``{role, content}``):
rendered with the run's chat template and the assistant's header (chat.py), the same
text its training rendered (data=chat), continued until the end-of-turn token.

One sampling loop for every model, not transformers' ``generate``: it draws from the
global RNG and exists only for transformers models.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from .chat import chat_template, chat_tokenizer, check_messages, prompt_ids
from .checkpoint import CheckpointError
from .config import ConfigError, require
from .evaluation import prepare
from .files import write_atomic, write_json_atomic
from .fits import model_positions
from .inference import load_checkpoint
from .task import build_task
from .tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def main(raw: DictConfig) -> None:
    try:
        cfg, out_dir = prepare(raw)
        generate(cfg, out_dir)
    except (ConfigError, CheckpointError) as err:
        log.error(str(err))
        sys.exit(err.exit_code)


def check_settings(cfg: DictConfig) -> None:
    g = cfg
    if g.get("messages") is not None:
        require("prompt", g.prompt, g.prompt is None, "null with messages (one or the other)")
        check_messages(_messages(g), "messages")
    else:
        ok = isinstance(g.prompt, str) and g.prompt != ""
        require("prompt", g.prompt, ok, "a non-empty text (or messages=[{role,content},...])")
    ok = isinstance(g.max_new_tokens, int) and not isinstance(g.max_new_tokens, bool)
    require("max_new_tokens", g.max_new_tokens, ok and g.max_new_tokens >= 1, "an integer >= 1")
    ok = isinstance(g.temperature, int | float) and not isinstance(g.temperature, bool)
    require("temperature", g.temperature, ok and g.temperature >= 0, "a number >= 0 (0: greedy)")
    ok = g.top_k is None or (isinstance(g.top_k, int) and g.top_k >= 1)
    require("top_k", g.top_k, ok, "null or an integer >= 1")


@torch.no_grad()
def generate(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Write ``generated.txt`` (prompt and continuation) and ``generation.json``; print
    the continuation. Returns what generation.json holds."""
    check_settings(cfg)
    loaded = load_checkpoint(cfg.ckpt, cfg.ckpt_pick, cfg.weights, model_config=cfg.model)
    model = loaded.model.eval()
    task = build_task(cfg.task)
    data = cfg.data
    tokenizer = (
        load_tokenizer(data.tokenizer, data.get("eos_token", "<|endoftext|>"))
        if ("tokenizer" in data)
        else None
    )
    messages = _messages(cfg)
    if messages is not None:  # a chat: the run's template, the assistant's turn to come
        if tokenizer is None:
            raise ConfigError("messages is not allowed: this run's data has no tokenizer")
        template = chat_template(data.get("chat_template"), data.get("tokenizer"))
        chat = chat_tokenizer(tokenizer, template)
        prompt = prompt_ids(chat, check_messages(messages, "messages"))
        text = chat.decode(prompt)  # the rendered conversation, special tokens included
    else:
        prompt, text = encode(cfg.prompt, tokenizer), cfg.prompt
    context = model_positions(model) or len(prompt) + cfg.max_new_tokens
    if len(prompt) > context:  # the model sees only its last `context` positions
        log.warning(
            f"the prompt is {len(prompt)} tokens and the model takes {context} positions: "
            f"it is cropped to its last {context} tokens ({len(prompt) - context} dropped), "
            "and the window slides on as tokens are generated"
        )
    generator = torch.Generator().manual_seed(int(cfg.seed))
    ids = torch.tensor([prompt], dtype=torch.long)
    eos = tokenizer.eos_id if tokenizer is not None else None
    for _ in range(cfg.max_new_tokens):
        scores = task.logits(model(ids[:, -context:]))[0, -1].float()
        token = next_token(scores, cfg.temperature, cfg.top_k, generator)
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
        if cfg.stop_at_eos and token.item() == eos:
            break
    new = ids[0, len(prompt) :].tolist()
    continuation = decode(new, tokenizer)
    result = {
        "checkpoint": str(loaded.checkpoint),
        "step": loaded.step,
        "prompt": text,
        **({"messages": messages} if messages is not None else {}),
        "continuation": continuation,
        "ids": new,
        "seed": int(cfg.seed),
        "temperature": cfg.temperature,
        "top_k": cfg.top_k,
        "max_new_tokens": cfg.max_new_tokens,
    }
    write_atomic(out_dir / "generated.txt", text + continuation)
    write_json_atomic(out_dir / "generation.json", result)
    print(continuation)
    log.info(f"{len(new)} tokens from {loaded.checkpoint} (step {loaded.step}): {out_dir}")
    return result


def _messages(cfg: DictConfig) -> list | None:
    """``messages=[{role: user, content: ...}]`` as plain data (None: a prompt)."""
    found = cfg.get("messages")
    return OmegaConf.to_container(found) if OmegaConf.is_config(found) else found


def next_token(
    scores: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator
) -> torch.Tensor:
    if temperature == 0:
        return scores.argmax()
    scores = scores / temperature
    if top_k is not None and top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)[0]


def encode(prompt: str, tokenizer: Any) -> list[int]:
    if tokenizer is not None:
        return tokenizer.encode_batch([prompt])[0]
    try:  # data of token ids: the prompt is ids
        return [int(t) for t in prompt.split()]
    except ValueError:
        raise ConfigError(
            f"prompt={prompt!r} is not allowed: this run's data has no tokenizer (token ids); "
            "expected token ids separated by spaces, e.g. prompt='12 7 3'"
        ) from None


def decode(ids: list[int], tokenizer: Any) -> str:
    return tokenizer.decode(ids) if tokenizer is not None else " " + " ".join(map(str, ids))
