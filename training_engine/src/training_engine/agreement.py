"""What the ranks agree on as they train, in one all-reduce: whether a training loss
was not finite (and the first step it was not, ``trainer.on_nan``), and whether a
stop signal reached any rank (preemption.py). LossGuard and StopSignals keep what
their own rank saw; this module owns the collective that joins them.

When the ranks agree (a collective each time: every rank calls the verb at the same
place, and the verbs are no-ops when nothing is due):

- ``on_update`` (inside the optimizer step): with ``on_nan=skip``, every optimizer
  step, before the update: a non-finite loss on any rank drops the update on all of
  them, and the stop signal rides along. With ``on_nan=stop``: no collective, no
  host sync.
- ``at_step`` (at each step boundary, before a checkpoint save, and after the loop):
  with ``on_nan=stop``, every ``every_n_steps`` steps (the log steps), before a
  save and at the end: a non-finite loss stops the run naming its first step; the
  stop signal rides along. Agreed at most once per step.

So a stop signal takes effect at most ``every_n_steps - 1`` steps after it arrives
(``on_nan=skip``: at the next step), and no checkpoint is written after a
non-finite loss. One process: nothing to agree on, the same answers, no collective.
"""

from __future__ import annotations

from typing import Any

import torch

from .nonfinite import LossGuard
from .preemption import StopSignals


class StepAgreement:
    def __init__(
        self, *, accelerator: Any, guard: LossGuard, signals: StopSignals, every_n_steps: int
    ) -> None:
        self.accelerator = accelerator
        self.guard, self.signals = guard, signals
        self.every_n_steps = every_n_steps
        self._pending = False  # on_update agreed for the step now ending (on_nan=skip)
        self._agreed_step: int | None = None  # the step of the last agreement
        self._peer_signal = 0  # the largest signal of any rank at the last agreement
        self.carried: torch.Tensor | None = None  # at_step's carry, averaged over the ranks

    def on_update(self) -> bool:
        """At each optimizer step, before the update, on every rank: True when the
        update may be applied (False: a non-finite loss, ``on_nan=skip``)."""
        if self.guard.mode != "skip":
            self.guard.end_step()
            return True
        bad = self.guard.step_not_finite()  # a 0-d bool tensor on the device
        if self.accelerator.num_processes > 1:
            flags = torch.stack([bad.to(torch.int64), self._signal()])
            bad, self._peer_signal = self.accelerator.reduce(flags, "max").tolist()
            self._pending = True
        return self.guard.applied(not bool(bad))

    def at_step(
        self,
        step: int,
        *,
        saving: bool = False,
        final: bool = False,
        carry: torch.Tensor | None = None,
    ) -> bool:
        """At a step boundary (``saving``: before a checkpoint save; ``final``: after
        the loop, where every rank must agree on how it ended), on every rank: raises
        NonFiniteLoss (``on_nan=stop``, naming the first step whose loss was not
        finite); returns True once the ranks have agreed that a stop signal came.

        ``carry``: values to average over the ranks in the same collective (the log
        window's sums), left in ``carried``; None there when no collective was due."""
        self.carried = None
        due = final or saving or step % self.every_n_steps == 0
        self.guard.check_budget(step)  # on_nan=skip: the agreed count, the same on every rank
        if self.accelerator.num_processes == 1:
            if due:
                self.carried = carry
                self.guard.check(step, *self.guard.local_state())
            return self.signals.seen
        if self._pending:  # this step's update was agreed on (on_nan=skip)
            self._pending, self._agreed_step = False, step
        if self._agreed_step == step and not final:
            return self._stop()
        if not due:
            return False  # agreed only when due: the same answer on every rank
        bad, ok_steps = self.guard.local_state()
        # max of -(good steps) over the ranks that saw a bad one: its first bad step
        first = torch.where(bad, -ok_steps, torch.full_like(ok_steps, -(2**62)))
        flags = torch.stack([bad.to(torch.int64), first, self._signal()])
        if carry is None:
            any_bad, first_neg, self._peer_signal = self.accelerator.reduce(flags, "max").tolist()
        else:
            any_bad, first_neg, self._peer_signal = self._with_carry(flags, carry)
        self._agreed_step = step
        self.guard.check(step, torch.tensor(bool(any_bad)), torch.tensor(-first_neg))
        return self._stop()

    def _with_carry(self, flags: torch.Tensor, carry: torch.Tensor) -> list[int]:
        """One all-gather for the flags (max over the ranks) and ``carry`` (mean): at a
        log step on 2 busy CPU cores each small gloo collective cost ~2 ms of a ~100 ms
        log window, two of them ~4 % of a DDP run's steps/s (bench/README.md). float64
        holds the flags exactly (counts and steps below 2**53; -(2**62) is a power of 2)."""
        row = torch.cat([flags.to(torch.float64), carry.to(torch.float64).reshape(-1)])
        rows = self.accelerator.gather(row.reshape(1, -1))
        self.carried = rows[:, 3:].mean(dim=0).to(carry.dtype)
        return [int(v) for v in rows[:, :3].max(dim=0).values.tolist()]

    def _signal(self) -> torch.Tensor:
        return torch.tensor(self.signals.signum or 0, dtype=torch.int64).to(self.accelerator.device)

    def _stop(self) -> bool:
        """The agreed answer (a signal that reached another rank counts here too)."""
        if self._peer_signal and not self.signals.seen:
            self.signals.signum = self._peer_signal
        return bool(self._peer_signal)
