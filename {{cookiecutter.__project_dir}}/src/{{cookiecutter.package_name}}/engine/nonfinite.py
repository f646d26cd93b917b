"""Watch the training loss for NaN/inf (``trainer.on_nan``).

- ``stop`` (default): the run stops with exit code 3 and a message naming the
  first optimizer step whose loss was not finite. No checkpoint is written after
  that step, so the newest checkpoint is the last good one. Detection costs no
  host sync and no collective per step: each rank keeps its flag on the device;
  ``check`` (log steps, before every checkpoint save, the end) reads it, under
  several processes in one all-reduce that also carries the stop signal.
- ``skip``: an optimizer step whose loss was not finite is dropped (its
  gradients are zeroed, the optimizer does not step) and counted. Deciding to
  drop needs the flag on the host, so this mode reads it once per optimizer step
  (not per micro-batch), as a GradScaler does; under several processes that is
  the step's one all-reduce, and the stop signal rides along (preemption.py).

The count of skipped steps is saved in checkpoints (``trainer_state.json``) and
reported in ``summary.json`` as ``skipped_nan_steps``. README: "Checkpoints and resuming".
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
    # Stop mode keeps one flag per micro-batch (``torch.isfinite(loss)``: one op, on
    # the device) and the micro-batch count at each optimizer step's end (host ints);
    # ``_fold`` turns them into the first bad step at a check. Per step that is one
    # op instead of ~6 for a running flag and count (~0.1 ms of a 10 ms CPU step
    # here, a kernel launch each on a GPU). Folded every FOLD_AT micro-batches, so a
    # long log interval keeps a bounded list.
    FOLD_AT = 1024

    def __init__(self, on_nan: str, accelerator: Accelerator) -> None:
        self.mode = on_nan
        self.accelerator = accelerator
        self.skipped = 0
        device = accelerator.device
        self._flags: list[torch.Tensor] = []  # finite? per micro-batch since the last fold
        self._ends: list[int] = []  # len(_flags) at the end of each optimizer step since
        self._all_ok = torch.ones((), dtype=torch.bool, device=device)  # folded: all good
        self._ok_steps = torch.zeros((), dtype=torch.int64, device=device)  # before a bad one
        self._checked_step = 0
        # The stop signal rides along this guard's all-reduces (StopSignals sets
        # ``signal``): ``peer_signal`` is the largest any rank had at ``agreed_step``.
        self.signal: Any = lambda: 0
        self.peer_signal = 0
        self.agreed_step: int | None = None  # the step of the last check's all-reduce

    def observe(self, loss: torch.Tensor) -> None:
        """Every micro-batch; stays on the device."""
        finite = torch.isfinite(loss.detach())
        self._flags.append(finite if finite.dim() == 0 else finite.all())

    def agree_on_update(self) -> bool:
        """At each optimizer step, on every rank: True when the update may be
        applied, False when it must be dropped (skip mode). Skip mode under
        several processes: one all-reduce (the NaN flags and the stop signal), so
        all ranks take the same decision. Stop mode: no collective, no host sync."""
        if self.mode == "skip":
            flags, self._flags = self._flags, []
            ok = flags[0] if len(flags) == 1 else torch.stack(flags).all()
            if self.accelerator.num_processes > 1:
                flags = torch.stack([(~ok).to(torch.int64), self._signal_tensor()])
                bad, self.peer_signal = self.accelerator.reduce(flags, "max").tolist()
                ok = not bad
            if not bool(ok):  # one host sync per optimizer step
                self.skipped += 1
                if self.skipped <= 10 or self.skipped % 100 == 0:
                    log.warning(
                        f"loss not finite: update dropped (trainer.on_nan=skip), "
                        f"{self.skipped} dropped so far"
                    )
                return False
            return True
        self._ends.append(len(self._flags))
        if len(self._flags) >= self.FOLD_AT:
            self._fold()
        return True

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

    def check(self, step: int) -> None:
        """Raise NonFiniteLoss naming the first bad step (stop mode); one host
        sync. Under several processes a collective (every rank calls it at the
        same step): one all-reduce agrees on the first bad step of any rank and
        carries the stop signal (``peer_signal``)."""
        self._fold()
        bad, ok_steps = ~self._all_ok, self._ok_steps
        if self.mode == "stop" and self.accelerator.num_processes > 1:
            # max of -(good steps) over the ranks that saw a bad one: its first bad step
            first = torch.where(bad, -ok_steps, torch.full_like(ok_steps, -(2**62)))
            flags = torch.stack([bad.to(torch.int64), first, self._signal_tensor()])
            any_bad, first_neg, self.peer_signal = self.accelerator.reduce(flags, "max").tolist()
            self.agreed_step = step
            bad, ok_steps = any_bad, -first_neg
        if self.mode == "stop" and bool(bad):
            first_bad = self._checked_step + int(ok_steps) + 1
            raise NonFiniteLoss(
                f"the training loss was not finite (NaN/inf) at step {first_bad}; stopping "
                "(trainer.on_nan=stop). The newest checkpoint is from before that step. "
                "Lower optimizer.lr, enable trainer.grad_clip_norm, or set trainer.on_nan=skip."
            )
        self._checked_step = step
        self._ok_steps.zero_()

    def _signal_tensor(self) -> torch.Tensor:
        return torch.tensor(self.signal(), dtype=torch.int64).to(self.accelerator.device)

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_nan_steps": self.skipped, "checked_step": self._checked_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = int(state["skipped_nan_steps"])
        self._checked_step = int(state["checked_step"])
