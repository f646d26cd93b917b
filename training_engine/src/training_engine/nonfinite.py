"""Watch the training loss for NaN/inf (``trainer.on_nan``).

- ``stop`` (default): the run stops with exit code 3 and a message naming the
  first optimizer step whose loss was not finite. No checkpoint is written after
  that step, so the newest checkpoint is the last good one. Detection costs no
  host sync and no collective per step: each rank keeps its flag on the device;
  the ranks agree on it at log steps, before every checkpoint save and at the end
  (agreement.py: one all-reduce that also carries the stop signal).
- ``skip``: an optimizer step whose loss was not finite is dropped (its
  gradients are zeroed, the optimizer does not step) and counted. More than
  ``trainer.skip_budget`` dropped in a row stop the run as ``stop`` does (exit 3,
  naming the steps): a run that skips nearly everything is not a success. Deciding to
  drop needs the flag on the host, so this mode reads it once per optimizer step
  (not per micro-batch), as a GradScaler does; under several processes that is
  the step's one all-reduce (agreement.py), and the stop signal rides along.

The count of skipped steps is saved in checkpoints (``trainer_state.json``) and
reported in ``summary.json`` as ``skipped_nan_steps``. docs/checkpoints.md.
"""

import logging
from typing import Any

import torch
from accelerate import Accelerator

ON_NAN = ("stop", "skip")
EXIT_NONFINITE = 3

log = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    """The loss was NaN or infinite and ``trainer.on_nan=stop``."""

    exit_code = EXIT_NONFINITE


class LossGuard:
    """This rank's losses: a flag per micro-batch, kept on the device; the ranks agree
    on them in agreement.py's all-reduce, which calls ``check``."""

    # Stop mode keeps one flag per micro-batch (``torch.isfinite(loss)``: one op, on
    # the device) and the micro-batch count at each optimizer step's end (host ints);
    # ``_fold`` turns them into the first bad step at a check. Per step that is one
    # op instead of ~6 for a running flag and count (~0.1 ms of a 10 ms CPU step
    # here, a kernel launch each on a GPU). Folded every FOLD_AT micro-batches, so a
    # long log interval keeps a bounded list.
    FOLD_AT = 1024

    def __init__(
        self,
        on_nan: str,
        accelerator: Accelerator,
        *,
        skip_budget: int | None = None,
        clipping: bool = False,
    ) -> None:
        self.mode = on_nan
        self.accelerator = accelerator
        self.skip_budget = skip_budget  # skip mode: the most updates dropped in a row
        self.clipping = clipping  # trainer.grad_clip_norm is set (for the advice)
        self.skipped = 0
        self.in_a_row = 0  # updates dropped since the last applied one
        device = accelerator.device
        self._flags: list[torch.Tensor] = []  # finite? per micro-batch since the last fold
        self._ends: list[int] = []  # len(_flags) at the end of each optimizer step since
        self._all_ok = torch.ones((), dtype=torch.bool, device=device)  # folded: all good
        self._ok_steps = torch.zeros((), dtype=torch.int64, device=device)  # before a bad one
        self._checked_step = 0

    def observe(self, loss: torch.Tensor) -> None:
        """Every micro-batch; stays on the device."""
        finite = torch.isfinite(loss.detach())
        self._flags.append(finite if finite.dim() == 0 else finite.all())

    def end_step(self) -> None:
        """Stop mode, at each optimizer step's end: no collective, no host sync."""
        self._ends.append(len(self._flags))
        if len(self._flags) >= self.FOLD_AT:
            self._fold()

    def step_not_finite(self) -> torch.Tensor:
        """Skip mode: whether any micro-batch of this optimizer step was not finite."""
        flags, self._flags = self._flags, []
        ok = flags[0] if len(flags) == 1 else torch.stack(flags).all()
        return ~ok

    def applied(self, ok: bool) -> bool:
        """Skip mode: the agreed decision for this step's update; a dropped one is counted."""
        self.in_a_row = 0 if ok else self.in_a_row + 1
        if not ok:
            self.skipped += 1
            if self.skipped <= 10 or self.skipped % 100 == 0:
                log.warning(
                    f"loss not finite: update dropped (trainer.on_nan=skip), "
                    f"{self.skipped} dropped so far"
                )
        return ok

    def _fold(self) -> None:
        """Stop mode, at a step boundary: the flags since the last fold into
        ``_all_ok`` and ``_ok_steps`` (good steps before the first bad one), on the
        device (no host sync)."""
        if not self._ends:
            return
        done = self._ends[-1]  # micro-batches of ended steps (a later one may be partial)
        flags = torch.stack(self._flags[:done])
        micro = torch.arange(done, device=flags.device)
        first_bad = torch.where(flags, done, micro).min()  # done: none was bad
        ends = torch.tensor(self._ends, device=flags.device)
        good_steps = torch.searchsorted(ends, first_bad, right=True)  # steps ended before it
        self._ok_steps += torch.where(self._all_ok, good_steps, 0)
        self._all_ok &= flags.all()
        self._flags, self._ends = self._flags[done:], []

    def local_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a loss was not finite since the last check, good steps before it), this rank's."""
        self._fold()
        return ~self._all_ok, self._ok_steps

    def check_budget(self, step: int) -> None:
        """Skip mode, at each step boundary (the count is the ranks' agreed one): more
        than ``skip_budget`` updates dropped in a row stop the run, naming them."""
        if self.mode != "skip" or self.skip_budget is None or self.in_a_row <= self.skip_budget:
            return
        first = step - self.in_a_row + 1
        raise NonFiniteLoss(
            f"the training loss was not finite (NaN/inf) at steps {first}..{step}: "
            f"{self.in_a_row} updates in a row were dropped, more than "
            f"trainer.skip_budget={self.skip_budget} allows ({self.skipped} dropped in all); "
            f"stopping. The newest checkpoint holds the last applied update. {self.advice()}"
        )

    def advice(self) -> str:
        clip = "" if self.clipping else ", enable trainer.grad_clip_norm"
        return f"Lower optimizer.lr{clip}, or look for the NaN's origin with debug=anomaly."

    def check(self, step: int, bad: torch.Tensor, ok_steps: torch.Tensor) -> None:
        """With the agreed ``bad`` and ``ok_steps`` (agreement.py): raise NonFiniteLoss
        naming the first bad step (stop mode); one host sync."""
        if self.mode == "stop" and bool(bad):
            first_bad = self._checked_step + int(ok_steps) + 1
            raise NonFiniteLoss(
                f"the training loss was not finite (NaN/inf) at step {first_bad}; stopping "
                "(trainer.on_nan=stop). The newest checkpoint is from before that step. "
                f"{self.advice()} Or set trainer.on_nan=skip."
            )
        self._checked_step = step
        self._ok_steps.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped_nan_steps": self.skipped,
            "checked_step": self._checked_step,
            "in_a_row": self.in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = int(state["skipped_nan_steps"])
        self._checked_step = int(state["checked_step"])
        self.in_a_row = int(state.get("in_a_row", 0))  # older checkpoints: none kept
