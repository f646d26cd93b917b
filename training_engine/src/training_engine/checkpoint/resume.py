"""Where a launch continues from: one ``ResumePlan``, chosen and verified once per
launch, before the schedule is built, and handed to whoever needs it: the gradient
accumulation, the trackers (run ids, TensorBoard's purge step), the manager's
restore, preflight and the summary. docs/checkpoints.md, "Resume".

Every rank verifies the checkpoint it will load (its files, the manifest, the
trainer state, the config) and the ranks agree on one: the newest that verifies
on all of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import allowed_config_changes, config_differences
from ..schema import section
from . import base, elastic, folder, judge, sharded, zero
from . import format as fmt
from .format import CheckpointError, ConfigMismatch
from .full_state import plain_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint this launch continues from (None: a fresh start), its files
    verified and parsed, and the gradient accumulation of the run."""

    checkpoint: Path | None = None
    manifest: dict[str, Any] = field(default_factory=dict, repr=False)
    files: dict[str, Any] = field(default_factory=dict, repr=False)  # name -> parsed
    grad_accum: int = 1
    skipped: tuple[str, ...] = ()  # why newer checkpoints were not taken

    @property
    def trainer(self) -> dict[str, Any]:
        """trainer_state.json: step, epoch, batch, best, stateful extras, run ids."""
        return self.files.get(fmt.TRAINER_STATE) or {}

    @property
    def step(self) -> int:
        return int(self.trainer.get("step", 0))

    @property
    def saved_world(self) -> int:
        return int(self.manifest.get("world_size", 1))

    @property
    def tracker_run_ids(self) -> dict[str, str]:
        """The W&B and MLflow runs the checkpoint's run logged to (a resume continues them)."""
        return dict(self.trainer.get("tracker_run_ids") or {})

    @property
    def rng_file(self) -> str:
        return next(n for n in self.files if n.startswith(fmt.RNG_PREFIX))


def verify(
    ckpt: Path,
    *,
    config: dict[str, Any],
    accelerator: Any,
    model: Any = None,
    optimizer: Any = None,
    frozen: Any = None,
) -> tuple[dict, dict]:
    """(manifest, parsed files) of ``ckpt`` as this rank loads it: every file's size
    and checksum against the manifest, what they hold judged (judge.py), the config
    compared with this run's, a trainable-only checkpoint's base against this run's
    (``frozen``: base.fingerprint of the built model), and (given the ``model`` and
    ``optimizer``, full layout) its weights' names, shapes and dtypes against the
    model's (its trainable ones, for such a checkpoint) before anything is read, its
    optimizer state's tensors against the live optimizer's parameters. CheckpointError
    for a damaged or forged one; ConfigMismatch for one of a run whose model, data or
    optimization differ; ConfigError (exit 2) for DeepSpeed's files on another world
    size or parallel mode (zero.py), or for another base than the checkpoint's (base.py)."""
    manifest = fmt.read_manifest(ckpt)
    fmt.check_format(ckpt, manifest)  # a later release's format: exit 2, not "corrupt"
    zero.check_resumable(ckpt, manifest, accelerator)
    saved_world, rank = int(manifest.get("world_size", 1)), accelerator.process_index
    # a rank beyond the saved world continues one saved rank's RNG streams
    rng_name = fmt.rng_file(rank % saved_world)
    names = [n for n in manifest["files"] if not n.startswith(fmt.RNG_PREFIX)] + [rng_name]
    # DeepSpeed's files: the ones this rank loads (each rank checks its own)
    names = [n for n in names if not zero.is_own(n) or zero.loaded_by(n, rank)]
    full = manifest.get("layout", "full") == "full" and model is not None
    plain = plain_model(accelerator, model) if full else None
    trainable = manifest.get("weights") == base.TRAINABLE  # the rest: base.json
    expected = judge.ModelSpec.of(plain) if full else None
    expected = expected.trainable() if expected is not None and trainable else expected
    # The config first (a small file, verified alone): a checkpoint of another run is
    # named by the keys that differ, not by the shapes its weights then do not fit.
    saved_config = fmt.verify_files(ckpt, [fmt.CONFIG], parse=_parse)[fmt.CONFIG]
    allowed = allowed_config_changes(config)
    diffs = config_differences(saved_config, config, allowed)
    if diffs:
        raise ConfigMismatch(
            f"cannot resume from {ckpt}: the config differs in keys that change the "
            "model, data or optimization:\n  " + "\n  ".join(diffs) + "\n"
            "Start a new run (another run_name, or checkpoint.resume=never), or put "
            "the keys back. Allowed to change: " + ", ".join(allowed)
        )
    files = fmt.verify_files(ckpt, names, parse=_parse, expected=expected)  # every rank
    if trainable:  # the adapter onto another base: refused before any work (exit 2)
        base.check(frozen, files[fmt.BASE], ckpt)
    if full and optimizer is not None:  # before load_state_dict, which takes any shape
        problem = judge.optimizer_problem(files[fmt.OPTIMIZER], judge.live_shapes(optimizer, plain))
        if problem:
            raise CheckpointError(f"{ckpt / fmt.OPTIMIZER}: refused: {problem}")
    return manifest, files


def _parse(name: str, path: Path) -> Any:
    """What a resume reads of each file: DeepSpeed's files unpickled with its
    allowlist only to refuse any other (zero.check), shards checked, the rest parsed."""
    return zero.check(path) if zero.is_own(name) else sharded.parse(name, path)


def plan_resume(
    checkpoint: Any,
    *,
    config: dict[str, Any],
    run_dir: Path,
    accelerator: Any,
    configured: int,
    model: Any = None,
    optimizer: Any = None,
    frozen: Any = None,
) -> ResumePlan:
    """The plan for ``checkpoint.resume`` (``cfg.checkpoint``); sets the planned
    accumulation on ``accelerator``. A collective when there are checkpoints.

    ``auto``: this run dir's checkpoints, or a fresh start when there are none.
    ``never``: a fresh start (refused beside an earlier run's checkpoints). A path
    (run dir, checkpoints dir or one checkpoint): resume from there, or fail when
    nothing there is valid. Once this run dir has checkpoints of its own, a path
    outside it only started the run: the same command continues from this run's own
    checkpoints (a path inside it, e.g. an older checkpoint, is honored)."""
    checkpoint = section("checkpoint", checkpoint)  # every key (a test may give a few)
    enabled = checkpoint.enabled
    own_dir = Path(run_dir) / "checkpoints"
    mode = checkpoint.resume if enabled else "never"
    plan = ResumePlan(grad_accum=configured)
    if enabled and elastic.effective_mode(mode, own_dir) != mode:
        log.info(
            f"{own_dir} has checkpoints: continuing this run from them "
            f"(checkpoint.resume={mode} started it)"
        )
        mode = "auto"
    if mode == "never":
        existing = folder.committed_checkpoints(own_dir) if enabled else []
        if existing:
            raise CheckpointError(
                f"checkpoint.resume=never, but {own_dir} already holds checkpoints "
                f"({existing[-1].name}, ...) of an earlier run; saving beside them would "
                "mix two runs. Use another run_name, move them away, or resume=auto"
            )
        if enabled:
            log.info("checkpoint.resume=never: starting from scratch")
    else:
        found = elastic.candidates(mode, own_dir)
        if mode == "auto" and not found:
            log.info(f"no checkpoint in {own_dir}: starting from scratch")
        else:
            live = (model, optimizer, frozen)  # frozen: the base's fingerprint (base.py)
            plan = _agreed(found, mode, own_dir, config, accelerator, live)
            plan = _with_accumulation(plan, accelerator.num_processes, configured)
    accelerator.gradient_accumulation_steps = plan.grad_accum
    return plan


def _agreed(
    found: list[Path], mode: str, own_dir: Path, config: dict, accelerator: Any, live: tuple
) -> ResumePlan:
    """The newest of ``found`` that verifies on every rank: each rank takes its newest
    valid one at or below the agreed bound, the bound becomes the oldest taken,
    until all take the same step."""
    newest_first = list(reversed(found))
    problems: list[str] = []
    bound, taken = None, None
    while True:
        taken = _first_valid(newest_first, bound, own_dir, config, accelerator, live, problems)
        mine = folder.step_of(taken[0]) if taken else -1
        steps = _gather(accelerator, mine)
        bound = min(steps)
        if all(s == bound for s in steps):
            break
    if taken is None:
        where = f"checkpoint.resume={mode}"
        if mode == "auto":
            where += f" found {len(found)} in {own_dir}"
        detail = "\n  ".join(problems) or "no checkpoint folders there"
        raise CheckpointError(
            f"{where}: no valid checkpoint, so nothing to resume (not starting over "
            f"silently):\n  {detail}"
        )
    ckpt, manifest, files = taken
    return ResumePlan(ckpt, manifest, files, skipped=tuple(problems))


def _first_valid(
    newest_first: list[Path],
    bound: int | None,
    own_dir: Path,
    config: dict,
    accelerator: Any,
    live: tuple,
    problems: list[str],
) -> tuple[Path, dict, dict] | None:
    for ckpt in newest_first:
        if bound is not None and folder.step_of(ckpt) > bound:
            continue
        try:
            model, optimizer, frozen = live
            manifest, files = verify(
                ckpt,
                config=config,
                accelerator=accelerator,
                model=model,
                optimizer=optimizer,
                frozen=frozen,
            )
        except ConfigMismatch as err:
            # Another run's checkpoint (checkpoint.resume=PATH): no fallback fixes that.
            # One of this run's own that disagrees with the run (its config.json was
            # checked at the claim) is corrupt: the previous one is tried.
            if not ckpt.resolve().is_relative_to(own_dir.resolve()):
                raise
            problems.append(_skipping(ckpt, err))
            continue
        except CheckpointError as err:
            problems.append(_skipping(ckpt, err))
            continue
        return ckpt, manifest, files
    return None


def _skipping(ckpt: Path, err: Exception) -> str:
    log.warning(f"skipping checkpoint {ckpt}: {err}")
    return str(err)


def _gather(accelerator: Any, step: int) -> list[int]:
    if accelerator.num_processes == 1:
        return [step]
    from accelerate.utils import gather_object

    return [int(s) for s in gather_object([step])]


def _with_accumulation(plan: ResumePlan, world: int, configured: int) -> ResumePlan:
    """The accumulation that keeps the checkpoint's global batch on ``world``
    processes where it divides (elastic.grad_accum_for), else ``configured``."""
    saved_world = plan.saved_world
    saved_accum = int(plan.manifest.get("grad_accum_steps", configured))
    accum, warning = elastic.grad_accum_for(saved_world, saved_accum, world, configured)
    if warning:
        log.warning(warning)
    elif accum != configured:
        log.info(
            f"resuming a {saved_world}-process checkpoint on {world}: gradient accumulation "
            f"{accum} (trainer.grad_accum_steps={configured}) keeps its global batch"
        )
    return ResumePlan(plan.checkpoint, plan.manifest, plan.files, accum, plan.skipped)
