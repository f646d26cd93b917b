"""Adapters through ``peft`` (``model.peft``): LoRA on any transformers causal LM and on
a model of the project's own. The base weights are frozen; the adapters are the only
trainable ones, so checkpoints hold them alone (checkpoint/base.py) and the optimizer
state shrinks with them. docs/finetune.md.

``model.peft`` is the engine's key inside the model's config node:

- ``null``: no adapter, every weight trains (the default);
- ``lora``: LoRA with ``DEFAULTS``;
- a mapping ``{method: lora, r: 16, alpha: 32, dropout: 0.05, target_modules: [...]}``:
  the keys given replace the defaults.

The key is taken out of the node before the model's ``_target_`` is built
(``base_node``); the built model (with ``checkpoint.init_from``'s weights loaded, if
any) is then wrapped with peft's ``get_peft_model`` (``attach``), its LoRA matrices
drawn from the run's seed. The target modules are ``model.peft.target_modules``, else
the model's own ``peft_target_modules`` attribute (model=gpt names its attention
projections), else peft's table for the transformers model type (GPT-2: ``c_attn``;
Llama, Qwen2, Mistral: ``q_proj``, ``v_proj``); ``all-linear`` is every linear layer but
the output head.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from .config import ConfigError, instantiate
from .seeding import same_on_every_rank

KEY = "peft"  # in the model's node
METHODS = ("lora",)
DEFAULTS: dict[str, Any] = {
    "method": "lora",
    "r": 8,
    "alpha": 16,
    "dropout": 0.0,
    "target_modules": None,  # None: the model's own, else peft's table for its type
}
MODEL_ATTRIBUTE = "peft_target_modules"  # a model class's default target modules


def settings(value: Any) -> dict[str, Any] | None:
    """``model.peft`` as a full mapping (None: no adapter); ConfigError naming the key,
    the value and what is allowed."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"method": value}
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value, resolve=True)
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"model.peft={value!r} is not allowed: expected null, lora, or a mapping "
            "{method: lora, r: 8, alpha: 16, dropout: 0.0, target_modules: [...]}"
        )
    unknown = sorted(set(value) - set(DEFAULTS))
    if unknown:
        raise ConfigError(
            f"model.peft.{unknown[0]} is not allowed: model.peft has the keys "
            + ", ".join(DEFAULTS)
        )
    out = {**DEFAULTS, **value}
    problems = []
    if out["method"] not in METHODS:
        problems.append(f"model.peft.method={out['method']!r}: expected one of {METHODS}")
    if not _positive_int(out["r"]):
        problems.append(f"model.peft.r={out['r']!r}: expected an integer >= 1 (the rank)")
    if not _number(out["alpha"]) or out["alpha"] <= 0:
        problems.append(f"model.peft.alpha={out['alpha']!r}: expected a number > 0")
    if not _number(out["dropout"]) or not 0 <= out["dropout"] < 1:
        problems.append(f"model.peft.dropout={out['dropout']!r}: expected a number in [0, 1)")
    targets = out["target_modules"]
    names = isinstance(targets, list | tuple) and all(isinstance(t, str) for t in targets)
    names = names and len(targets) > 0
    if not (targets is None or targets == "all-linear" or names):
        problems.append(
            f"model.peft.target_modules={targets!r}: expected null (the model's default), "
            "all-linear, or a list of module names (e.g. [q_proj, v_proj])"
        )
    if problems:
        raise ConfigError("model.peft is not allowed: " + "; ".join(problems))
    if isinstance(targets, tuple):
        out["target_modules"] = list(targets)
    return out


def problems(cfg: Any) -> list[str]:
    """What ``check_config`` reports about ``model.peft`` before any work."""
    model = cfg.get("model") if hasattr(cfg, "get") else None
    value = model.get(KEY) if hasattr(model, "get") else None
    try:
        found = settings(value)
    except ConfigError as err:
        return [str(err)]
    if found is None:
        return []
    out = []
    if importlib.util.find_spec("peft") is None:
        out.append("model.peft needs peft: pip install -e '.[hf]'")
    mode = (cfg.get("parallel") or {}).get("mode")
    if mode == "deepspeed":
        out.append(
            "model.peft is not supported with parallel=deepspeed (its checkpoints hold every "
            "weight): use parallel=fsdp, ddp or none"
        )
    ema = ((cfg.get("trainer") or {}).get("ema") or {}).get("enabled")
    if ema is True:
        out.append(
            "model.peft is not supported with trainer.ema.enabled=true (the average would "
            "hold every weight, the frozen base too, in every checkpoint): "
            "trainer.ema.enabled=false"
        )
    return out


def base_node(node: Any) -> Any:
    """The model's node without ``peft``: what its ``_target_`` takes."""
    if isinstance(node, DictConfig):
        if KEY not in node:
            return node
        plain = OmegaConf.to_container(node, resolve=False)
        plain.pop(KEY)
        return OmegaConf.create(plain)
    if isinstance(node, Mapping) and KEY in node:
        return {k: v for k, v in node.items() if k != KEY}
    return node


def attach(model: torch.nn.Module, value: Any, seed: int) -> torch.nn.Module:
    """``model`` wrapped with the adapter ``value`` names (``model.peft``); the model
    itself when it names none. The adapter's random matrices come from ``seed``."""
    found = settings(value)
    if found is None:
        return model
    from peft import LoraConfig, get_peft_model
    from transformers import PreTrainedModel

    hf = isinstance(model, PreTrainedModel)
    targets = found["target_modules"] or getattr(model, MODEL_ATTRIBUTE, None)
    if targets is None and not _peft_knows(model):
        raise ConfigError(
            f"model.peft.target_modules=null is not allowed for {type(model).__name__}: "
            "peft has no default for it; name its layers, e.g. model.peft={method:lora,"
            f"target_modules:[{', '.join(linear_names(model)[:3])}]}} (or set "
            f"{MODEL_ATTRIBUTE} on the model class)"
        )
    config = LoraConfig(
        r=found["r"],
        lora_alpha=found["alpha"],
        lora_dropout=found["dropout"],
        target_modules=list(targets) if isinstance(targets, list | tuple) else targets,
        # CAUSAL_LM for transformers models: adapter_config.json then loads with
        # AutoPeftModelForCausalLM; a model of the project's takes its forward as it is
        task_type="CAUSAL_LM" if hf else None,
    )
    with warnings.catch_warnings(), same_on_every_rank(seed):
        # peft sets fan_in_fan_out for GPT-2's Conv1D itself and says so; transformers
        # deprecates an attribute peft reads: neither is the user's to act on
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        try:
            return get_peft_model(model, config)
        except ValueError as err:  # e.g. a target module that the model does not have
            raise ConfigError(f"model.peft: {err}") from None


def build_model(node: Any, *, seed: int, init: Any = None) -> torch.nn.Module:
    """The model a run trains, built as the trainer builds it: the ``_target_`` from
    ``seed``, ``init(model)`` (``checkpoint.init_from``'s weights) when given, then the
    adapter of ``model.peft``. What load_model and export rebuild a base from."""
    with same_on_every_rank(seed):
        model = instantiate(base_node(node), what="model")
    if init is not None:
        init(model)
    return attach(model, node.get(KEY) if hasattr(node, "get") else None, seed)


def is_adapted(model: torch.nn.Module) -> bool:
    """A peft model (its base frozen, its adapters trained)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (target_modules candidates)."""
    found = dict.fromkeys(
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name
    )
    return list(found)


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters, each shared one once (ZeRO-3: its full count)."""
    seen: set[int] = set()
    trainable = total = 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        count = getattr(param, "ds_numel", param.numel())
        total += count
        trainable += count if param.requires_grad else 0
    return trainable, total


def describe_parameters(model: torch.nn.Module) -> str:
    """``19,276,288 parameters (98,304 trainable)`` for the log."""
    trainable, total = parameter_counts(model)
    return f"{total:,} parameters ({trainable:,} trainable)"


def _peft_knows(model: torch.nn.Module) -> bool:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
