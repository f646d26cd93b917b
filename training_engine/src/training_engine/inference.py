"""A trained run's model outside training: which checkpoint a path names, its
weights loaded safely (hash-verified, no unpickling), the model rebuilt from the
run's own config (``load_model``), and the config eval.py/predict.py run with
(the run's model, data and precision, plus the command line's overrides).
docs/lifecycle.md.

    from training_engine.inference import load_model
    model = load_model("runs/exp1")                  # best checkpoint, eval mode
    model = load_model("runs/exp1", weights="ema")   # the EMA weights (trainer.ema)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from . import trust
from .checkpoint import base, folder, judge, sharded, ties
from .checkpoint import format as fmt
from .checkpoint.format import CheckpointError
from .config import ConfigError, require

log = logging.getLogger(__name__)
PICKS = ("best", "latest")
WEIGHTS = ("raw", "ema")
EMA_FILE = "ema.safetensors"  # the ``ema`` stateful extra (ema.py), saved as tensors
# What eval.py/predict.py take from the trained run's config (so the model and
# data match what was trained); everything else comes from their own config.
FROM_RUN = (
    "task",
    "model",
    "data",
    "seed",
    "deterministic",
    "trainer.mixed_precision",
    "trainer.compile",
)
BUILT_FROM_RUN = ("task", "model", "data")  # of those, what names code (``_target_``)
TRUST_IN_CALL = "pass the module to load_model (or load_predictor): trusted="


@dataclass
class Loaded:
    """A model with its checkpoint's weights, and where they came from."""

    model: torch.nn.Module
    checkpoint: Path
    step: int
    weights: str
    config: dict[str, Any]  # the training run's resolved config (config.json)


def check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    require(key, value, value in allowed, "one of " + ", ".join(allowed))


def checkpoint_candidates(path: str | Path, pick: str = "best") -> list[Path]:
    """The checkpoints a path names, in the order to try them (the first valid one
    is used: ``read_first_valid``). One ``step_*`` dir: exactly that one. A run dir
    (or its ``checkpoints/``): ``latest``, newest first; ``best``, the one
    ``best.json`` names, then (should it be corrupt, or best.json itself) those that
    were a new best when saved, newest first, then the rest, newest first."""
    check_choice("pick", pick, PICKS)
    path = Path(path).expanduser().resolve()
    found = folder.find_checkpoints(path)  # CheckpointError: no such path, or a *.tmp
    if len(found) == 1 and (folder.step_of(path) is not None or (path / fmt.MANIFEST).exists()):
        return found
    if not found:
        raise CheckpointError(
            f"{path}: no checkpoint there (a run dir with checkpoints/step_*, or one step_* dir)"
        )
    newest_first = found[::-1]
    if pick == "latest":
        return newest_first
    root = found[-1].parent
    if not (root / fmt.BEST).is_file():
        raise CheckpointError(
            f"{path}: no best checkpoint ({root / 'best.json'} is missing: trained with "
            "checkpoint.save_best.enabled=false?); use pick=latest (eval.py: ckpt_pick=latest)"
        )
    try:
        named = [folder.read_pointer(root, fmt.BEST)]
    except CheckpointError as err:
        log.warning(f"{err}: taking the best of the valid checkpoints instead")
        named = []
    bests = [c for c in newest_first if _saved_as_best(c)]
    return list(dict.fromkeys([*named, *bests, *newest_first]))


def resolve_checkpoint(path: str | Path, pick: str = "best") -> Path:
    """The first checkpoint to try (``checkpoint_candidates``)."""
    return checkpoint_candidates(path, pick)[0]


def _saved_as_best(ckpt: Path) -> bool:
    try:
        manifest = fmt.read_manifest(ckpt)
    except CheckpointError:
        return False
    best = manifest.get("best")
    return isinstance(best, dict) and best.get("step") == manifest["step"]


def read_first_valid(
    path: str | Path,
    pick: str = "best",
    weights: str = "raw",
    spec_for: Callable[[dict], judge.ModelSpec | None] | None = None,
) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """(checkpoint, weights, run config) of the first valid checkpoint of
    ``checkpoint_candidates``: a corrupt one is skipped with a warning naming the
    file, as resume does. ``spec_for``: the model a checkpoint's run config builds
    (``model_spec``), whose weights it must hold (judged before they are read).
    CheckpointError when none is valid."""
    problems = []
    for ckpt in checkpoint_candidates(path, pick):
        try:
            expected = spec_for(_run_config(ckpt)) if spec_for is not None else None
            state, config = read_weights(ckpt, weights, expected)
        except CheckpointError as err:
            log.warning(f"skipping checkpoint {ckpt}: {err}")
            problems.append(str(err))
            continue
        if problems:
            log.warning(f"using {ckpt} ({pick} of the valid checkpoints)")
        return ckpt, state, config
    raise CheckpointError(f"{path}: no valid checkpoint:\n  " + "\n  ".join(problems))


def _run_config(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's config.json, read bounded (its checksum: ``read_weights``)."""
    try:
        return fmt.check_object(trust.read_json(trust.inside(fmt.CONFIG, ckpt)))
    except (trust.Malformed, ValueError) as err:
        raise CheckpointError(f"{ckpt / fmt.CONFIG}: unreadable ({err})") from err


def read_weights(
    ckpt: Path, weights: str = "raw", expected: judge.ModelSpec | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """(model state dict, the run's config) of one checkpoint, every file read
    verified against its manifest and judged (checkpoint/judge.py; ``expected``: the
    model its weights must fit). ``weights=ema``: the EMA weights. The config is
    data: build nothing from it without ``trusted_config``."""
    check_choice("weights", weights, WEIGHTS)
    manifest = fmt.read_manifest(ckpt)
    shards = manifest.get("layout") == "sharded" and weights == "raw"  # model/ shards
    name = fmt.MODEL if weights == "raw" else EMA_FILE
    if name not in manifest["files"] and not shards:
        raise CheckpointError(
            f"{ckpt} holds no EMA weights (trained without trainer.ema.enabled=true): "
            "use weights=raw"
        )
    if expected is not None and manifest.get("weights") == base.TRAINABLE and weights == "raw":
        expected = expected.trainable()  # a checkpoint of the trainable weights (base.py)
    # Every file verified, as resume and the CLI do; only these read whole.
    wanted = (name, fmt.CONFIG, ties.TIES_FILE)
    loaded = fmt.verify_files(
        ckpt,
        parse=lambda n, p: fmt.parse_file(n, p) if n in wanted else fmt.check_content(n, p),
        expected=expected if weights == "raw" else None,
    )
    full = sharded.full_model_state(ckpt) if shards else loaded[name]  # consolidated
    state = ties.restore(full, ties.of_checkpoint(loaded, ckpt))  # tied: stored once
    if weights == "ema":  # torch.optim.swa_utils.AveragedModel's keys: module.* + n_averaged
        state = {k.removeprefix("module."): v for k, v in state.items() if k != "n_averaged"}
        found = judge.ModelSpec(judge.ModelSpec.of_state(state).tensors)
        wrong = judge.misfit(expected, found) if expected is not None else None
        if wrong:
            raise CheckpointError(f"{ckpt / EMA_FILE}: its weights do not fit this model: {wrong}")
    return state, loaded[fmt.CONFIG]


def model_spec(model_config: Any) -> judge.ModelSpec:
    """What the model of ``model_config`` holds (names, shapes, dtypes), built on the
    meta device (no memory, no initialisation; on the CPU where a model cannot be
    built there), once per config. Build only a config ``trusted_config`` passed."""
    node = OmegaConf.create(model_config)
    key = json.dumps(OmegaConf.to_container(node, resolve=True), sort_keys=True, default=str)
    if key not in _SPECS:
        from .adapters import build_model  # model.peft: the adapter's names, its frozen base

        try:
            with torch.device("meta"):
                model = build_model(node, seed=0)
        except Exception:  # a model that reads a tensor's values while built, or one
            # from_pretrained loads (transformers refuses the meta device): on the CPU,
            # where a config that cannot build fails again, with its own message
            model = build_model(node, seed=0)
        _SPECS[key] = judge.ModelSpec.of(model)
    return _SPECS[key]


_SPECS: dict[str, judge.ModelSpec] = {}  # model_spec's, by config


def run_model_spec(ckpt: Path, trusted: Any = ()) -> judge.ModelSpec | None:
    """The model a checkpoint's own config.json builds (``model_spec``), for readers
    that have none (the checkpoint CLI): None when the config names code this project
    does not trust, or cannot be read or built (then judged without the model)."""
    try:
        config = _run_config(ckpt)
        where = str(ckpt / fmt.CONFIG)
        node = trusted_config(config, ("model",), trusted=trusted, where=where)["model"]
        spec = model_spec(node)
        trainable = fmt.read_manifest(ckpt).get("weights") == base.TRAINABLE
        return spec.trainable() if trainable else spec  # the rest: base.json (base.py)
    except Exception:  # any config: the CLI judges what it can without the model
        return None


def trusted_config(
    config: dict[str, Any],
    keys: tuple[str, ...],
    *,
    trusted: Any,
    where: str,
    hint: str = trust.TRUST_IN_CONFIG,
) -> dict[str, Any]:
    """``config`` (read from a run dir) made safe to build: every ``_target_`` under
    ``keys`` checked against the project's trust (trust.check_targets: exit 2
    before any import), every ``${`` taken literally."""
    node = OmegaConf.create(trust.literal(config))
    for key in keys:
        sub = OmegaConf.select(node, key, default=None)
        if isinstance(sub, DictConfig):
            tree = OmegaConf.to_container(sub, resolve=False)
            where_key = f"{where} ({key})"
            trust.check_targets(tree, trusted=list(trusted or ()), where=where_key, hint=hint)
    return trust.literal(config)


def load_checkpoint(
    path: str | Path,
    pick: str = "best",
    weights: str = "raw",
    model_config: Any = None,
    trusted: Any = (),
) -> Loaded:
    """The model of ``model_config`` (default: the run's own, built only from targets
    the project trusts: trust.check_targets, plus the modules in ``trusted``) with a
    checkpoint's weights, on the CPU, in eval mode; strict: every key and shape must match."""

    def model_of(config: dict) -> Any:
        if model_config is not None:
            return model_config
        return trusted_config(
            config, ("model",), trusted=trusted, where="config.json", hint=TRUST_IN_CALL
        )["model"]

    # every candidate judged against the model before its weights are read
    ckpt, state, config = read_first_valid(path, pick, weights, lambda c: model_spec(model_of(c)))
    if model_config is None:
        where = f"{ckpt / 'config.json'}"
        model_config = trusted_config(
            config, ("model",), trusted=trusted, where=where, hint=TRUST_IN_CALL
        )["model"]
    node = OmegaConf.create(model_config)
    manifest = fmt.read_manifest(ckpt)
    trainable = manifest.get("weights") == base.TRAINABLE and weights == "raw"
    model = rebuild(node, config, with_base=trainable)
    if trainable:  # the adapter's base, rebuilt: the one it was trained on, or refused
        base.check(base.fingerprint(model), read_base(ckpt), ckpt)
    try:
        base.check_loaded(model.load_state_dict(state, strict=not trainable), model)
    except RuntimeError as err:
        raise ConfigError(
            f"{ckpt}: the weights do not fit the model {node._target_}: {err}"
        ) from err
    return Loaded(model.eval(), ckpt, int(manifest["step"]), weights, config)


def rebuild(node: Any, config: dict[str, Any], *, with_base: bool) -> torch.nn.Module:
    """The run's model as the trainer built it (adapters.build_model): from the run's
    seed and, ``with_base`` (a checkpoint of trainable weights only), its
    ``checkpoint.init_from`` weights too, before the adapter."""
    from .adapters import build_model
    from .finetune import init_from

    source = (config.get("checkpoint") or {}) if with_base else {}
    init = (lambda model: init_from(source, model=model)) if source.get("init_from") else None
    return build_model(node, seed=int(config.get("seed") or 0), init=init)


def read_base(ckpt: Path) -> dict[str, Any]:
    """A trainable-only checkpoint's ``base.json``, verified against its manifest."""
    loaded = fmt.verify_files(ckpt, [base.BASE_FILE], parse=fmt.parse_file)
    if base.BASE_FILE not in loaded:
        raise CheckpointError(f"{ckpt}: holds trainable weights only, and no {base.BASE_FILE}")
    return base.parse(loaded[base.BASE_FILE], str(ckpt / base.BASE_FILE))


def load_model(
    path: str | Path, pick: str = "best", weights: str = "raw", trusted: Any = ()
) -> torch.nn.Module:
    """The eager ``nn.Module`` of a trained run, weights loaded, in eval mode.

    ``path``: a run dir (``pick``: its best or latest checkpoint) or one
    ``step_*`` dir; ``weights``: ``raw`` or ``ema`` (trainer.ema's average).
    The run's config.json may only name classes of this project's package, or of
    the modules listed in ``trusted`` (e.g. ``trusted=["mylib.models"]``)."""
    return load_checkpoint(path, pick, weights, trusted=trusted).model


def run_config(saved: dict, composed: DictConfig, overrides: list[str]) -> DictConfig:
    """The config eval.py/predict.py run with: ``composed`` (their own, resolved)
    with FROM_RUN taken (replaced whole) from the trained run's ``saved`` config, then the command
    line's ``overrides`` of those keys applied again (``data.val_batch_size=64``,
    ``data=tokens``): Hydra composed and checked them in ``composed``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg = OmegaConf.create(OmegaConf.to_container(composed, resolve=True))
    run = OmegaConf.create(saved)
    for key in FROM_RUN:
        if OmegaConf.select(run, key, default="<absent>") != "<absent>":
            OmegaConf.update(cfg, key, OmegaConf.select(run, key), merge=False, force_add=True)
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in FROM_RUN):
            value = OmegaConf.select(composed, key)
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    OmegaConf.set_struct(cfg, True)
    return cfg


def run_values(config: Any) -> dict[str, Any]:
    """The FROM_RUN values of a config (for eval.json's differences)."""
    node = OmegaConf.create(config)
    values = {key: OmegaConf.select(node, key, default=None) for key in FROM_RUN}
    return OmegaConf.to_container(OmegaConf.create(values))
