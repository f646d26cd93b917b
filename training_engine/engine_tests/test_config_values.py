"""The engine's reading of config values: flattened for the trackers, the precision
``auto`` resolves to."""

import torch
from omegaconf import OmegaConf

from training_engine.accel import resolve_precision
from training_engine.config import flatten_config, resolve_config


def test_flatten_config_gives_scalar_leaves(compose_cfg):
    flat = flatten_config(OmegaConf.to_container(resolve_config(compose_cfg())))
    assert flat["optimizer/lr"] == 3e-3
    assert flat["optimizer/betas"] == "[0.9, 0.999]"
    assert flat["trainer/max_steps"] == "None"
    assert all(isinstance(v, str | int | float | bool) for v in flat.values())


def test_mixed_precision_auto_is_fp32_on_a_cpu_and_explicit_values_stay(compose_cfg):
    assert compose_cfg().trainer.mixed_precision == "auto"  # the default
    assert resolve_precision("auto", on_cpu=True) == ("no", "no GPU: fp32")
    assert resolve_precision(False, on_cpu=True) == ("no", "")  # YAML's unquoted `no`
    for explicit in ("no", "bf16", "fp16"):
        assert resolve_precision(explicit, on_cpu=True) == (explicit, "")
        assert resolve_precision(explicit, on_cpu=False) == (explicit, "")
    if torch.cuda.is_available():
        chosen, why = resolve_precision("auto", on_cpu=False)
        assert chosen == ("bf16" if torch.cuda.is_bf16_supported(False) else "no"), why
