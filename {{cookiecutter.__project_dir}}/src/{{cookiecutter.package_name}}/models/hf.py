"""Hugging Face ``transformers`` models as a model option (``model=hf``): a causal
language model built from a config (random init, no download) or loaded from a local
pretrained directory. The model is transformers' own object: its weights keep their
Hugging Face names, ``load_model`` returns it, and ``export --format hf`` writes a
directory ``from_pretrained`` reads (docs/hf.md). Needs the ``hf`` extra.

Its forward returns an output object; task.py takes its ``.logits`` (the task's own
loss, on targets the data already shifted: transformers' ``labels=`` would shift
them a second time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..contract import ConfigError, require

# The auto classes this option may build: causal LMs (the token task predicts the next
# token). A name from this list, never an arbitrary attribute of transformers.
AUTO_CLASSES = ("AutoModelForCausalLM",)


def causal_lm(
    config: dict[str, Any] | None = None,
    pretrained: str | None = None,
    auto_class: str = "AutoModelForCausalLM",
    attn_implementation: str = "sdpa",
) -> Any:
    """``config``: ``{model_type: gpt2, n_layer: ..., vocab_size: ...}`` (the keys of that
    model type's config class), built with random weights; or ``pretrained``: a local
    directory written by ``save_pretrained`` (never the Hub: no download at run time).
    Exactly one of the two."""
    require(
        "model.auto_class",
        auto_class,
        auto_class in AUTO_CLASSES,
        "one of " + ", ".join(AUTO_CLASSES),
    )
    require(
        "model.config",
        config,
        (config is None) != (pretrained is None),
        "a config (model_type and its keys) or model.pretrained=DIR, exactly one of them",
    )
    try:
        import transformers
    except ImportError:
        raise ConfigError("model=hf needs transformers: pip install -e '.[hf]'") from None
    auto = getattr(transformers, auto_class)
    if pretrained is not None:
        path = Path(pretrained)
        require(
            "model.pretrained",
            pretrained,
            path.is_dir() and (path / "config.json").is_file(),
            "a local directory written by save_pretrained (config.json and weights); Hub "
            "names are not downloaded at run time: save one once with from_pretrained(NAME)"
            ".save_pretrained(DIR)",
        )
        return auto.from_pretrained(
            path,
            local_files_only=True,
            trust_remote_code=False,  # code in a model directory is never run
            attn_implementation=attn_implementation,
        )
    config = dict(config)
    model_type = config.pop("model_type", None)
    require(
        "model.config.model_type",
        model_type,
        isinstance(model_type, str),
        "a transformers model type, e.g. gpt2, llama, qwen2",
    )
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **config)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"model.config: not a config of {model_type!r}: {err}") from None
    vocab = getattr(hf_config, "vocab_size", None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token = getattr(hf_config, key, None)
        if isinstance(token, int) and isinstance(vocab, int) and token >= vocab:
            setattr(hf_config, key, None)  # the default ids of a larger vocabulary (GPT-2's 50256)
    return auto.from_config(hf_config, attn_implementation=attn_implementation)
