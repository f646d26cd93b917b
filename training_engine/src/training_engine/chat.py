"""Chat templates: how a conversation (``messages``, each a role and a content) becomes
text and token ids, and which of those tokens are the assistant's. data=chat renders
its conversations with one, generate.py its ``messages=``, and ``export --format hf``
writes it beside the tokenizer, so transformers' ``apply_chat_template`` on the export
renders the same text (docs/finetune.md).

The rendering is transformers' own (``apply_chat_template``: its sandboxed Jinja, and
``return_assistant_tokens_mask``, which marks the tokens a template wraps in
``{% generation %}``), on the run's tokenizer (tokenizer.py) as a
``PreTrainedTokenizerFast``. Which template (``data.chat_template``):

- ``null``: the tokenizer's own (a Hugging Face tokenizer directory's
  ``chat_template.jinja``, or the ``chat_template`` of its ``tokenizer_config.json``),
  else ``DEFAULT``;
- a path to a Jinja file;
- the template itself (text holding ``{%`` or ``{{``).

``DEFAULT`` writes each role as a plain-text header and ends the assistant's turn with
the tokenizer's end-of-document token, where generation stops::

    <|system|>\\nYou add.\\n<|user|>\\nWhat is 2 + 3?\\n<|assistant|>\\n2 + 3 = 5.<|endoftext|>\\n

The assistant's tokens are its content and that token; the headers are not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .config import ConfigError
from .tokenizer import TextTokenizer

DEFAULT = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
MAX_TEMPLATE_BYTES = 2**20  # published templates are a few kB
ROLES = ("system", "user", "assistant", "tool")


def chat_template(setting: str | None, tokenizer: str | None) -> str:
    """The template ``data.chat_template`` names (module docstring); ConfigError
    naming the key when a file is missing or too large."""
    if setting is None:
        return _tokenizers_own(tokenizer) or DEFAULT
    if "{%" in setting or "{{" in setting:
        return setting
    return _read(Path(setting), f"data.chat_template={setting!r}")


def _tokenizers_own(tokenizer: str | None) -> str | None:
    folder = Path(tokenizer) if tokenizer else None
    if folder is None or not folder.is_dir():
        return None
    if (folder / "chat_template.jinja").is_file():
        return _read(folder / "chat_template.jinja", f"data.tokenizer={tokenizer!r}")
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        found = json.loads(_read(config, f"data.tokenizer={tokenizer!r}")).get("chat_template")
    except (ValueError, AttributeError):
        return None
    if isinstance(found, list):  # named templates: the default one
        found = next((t.get("template") for t in found if t.get("name") == "default"), None)
    return found if isinstance(found, str) else None


def _read(path: Path, key: str) -> str:
    if not path.is_file():
        raise ConfigError(
            f"{key} is not allowed: no such file ({path}); expected null (the tokenizer's "
            "own template, else the default), a Jinja file, or the template itself"
        )
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise ConfigError(f"{key} is not allowed: {path} is larger than a chat template")
    return path.read_text(encoding="utf-8")


def chat_tokenizer(codec: TextTokenizer, template: str) -> Any:
    """The run's tokenizer as transformers' fast tokenizer, with ``template``: its ids
    are ``codec``'s (bytes: the byte-level BPE without merges, tokenizer.py)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise ConfigError("chat templates need transformers: pip install -e '.[hf]'") from None
    inner = codec.as_tokenizers()
    eos = inner.id_to_token(codec.eos_id)
    return PreTrainedTokenizerFast(
        tokenizer_object=inner, eos_token=eos, pad_token=eos, chat_template=template
    )


def encode(
    tokenizer: Any, conversations: list[list[dict[str, str]]]
) -> list[tuple[list[int], list[int]]]:
    """Each conversation's token ids and, per token, 1 where the assistant says it."""
    if not conversations:
        return []
    out = tokenizer.apply_chat_template(
        conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(zip(out["input_ids"], out["assistant_masks"], strict=True))


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation so far, rendered with the assistant's header to continue from."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """``messages`` as a list of ``{role, content}`` with a known role and text content;
    ConfigError naming ``where`` and the first problem."""
    if hasattr(messages, "items") or not isinstance(messages, list | tuple) or not messages:
        raise ConfigError(
            f"{where}: messages must be a non-empty list of {{role, content}}, got "
            f"{type(messages).__name__}"
        )
    out = []
    for i, message in enumerate(messages):
        ok = hasattr(message, "get") and isinstance(message.get("content"), str)
        if not ok or message.get("role") not in ROLES:
            shown = dict(message) if hasattr(message, "items") else message
            raise ConfigError(
                f"{where}: message {i} is {shown!r}; expected {{role: one of "
                f"{', '.join(ROLES)}, content: text}}"
            )
        out.append({"role": str(message["role"]), "content": str(message["content"])})
    return out
