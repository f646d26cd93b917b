"""Test-only models that fail on purpose, selected from the command line with
``model._target_=engine_tests.faults.<Name>``: production code carries no test hooks."""

import hashlib
import os
import signal
import time
from pathlib import Path

import torch
from digit_trainer.models.digits import MLP
from digit_trainer.models.gpt import GPT


class FailsOnRank1(MLP):
    """Raises in the 5th forward pass of rank 1; other ranks are healthy."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        FailsOnRank1.calls += 1
        if os.environ.get("RANK") == "1" and FailsOnRank1.calls == 5:
            raise RuntimeError("injected failure on rank 1")
        return super().forward(x)


class KilledOnRank1(MLP):
    """Rank 1 kills itself with SIGKILL in its 5th forward pass, on every attempt: a
    lost process each time (restarted until parallel.max_restarts runs out)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        KilledOnRank1.calls += 1
        if os.environ.get("RANK") == "1" and KilledOnRank1.calls == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


class Slow(MLP):
    """Sleeps 50 ms per forward pass: a run that is still going when killed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return super().forward(x)


class NanOnRank1(MLP):
    """The loss of rank 1 only is NaN in its 3rd and 4th forward passes (steps 3
    and 4); rank 0's stays finite: the ranks must still decide alike."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        NanOnRank1.calls += 1
        out = super().forward(x)
        if os.environ.get("RANK") == "1" and NanOnRank1.calls in (3, 4):
            return out * float("nan")
        return out


class ForgetsWeightsOnLoad(MLP):
    """``load_state_dict`` keeps the current weights: a checkpoint of it saves
    fine but does not restore (preflight's round trip must report it)."""

    def load_state_dict(self, state_dict, strict=True, assign=False):
        return torch.nn.modules.module._IncompatibleKeys([], [])


def data_from_a_missing_file(**kwargs):
    """A data function whose file is missing: the error must name the path."""
    with open("/no/such/file.csv") as f:
        return f.read()


class RecordsSamples(MLP):
    """Appends a hash of every training sample it sees to
    ``$SAMPLE_LOG/<pid>.txt`` (evaluation passes are not recorded): which
    samples a run, or the parts of an interrupted one, trained on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            record_samples(x)
        return super().forward(x)


def record_samples(x: torch.Tensor) -> None:
    """Append a hash of each row of ``x`` to ``$SAMPLE_LOG/<pid>.txt``."""
    lines = "".join(f"{sample_hash(row)}\n" for row in x)
    with open(Path(os.environ["SAMPLE_LOG"]) / f"{os.getpid()}.txt", "a") as f:
        f.write(lines)


def sample_hash(row: torch.Tensor) -> str:
    return hashlib.sha1(row.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class RecordsWindows(GPT):
    """The GPT example recording each training sequence it sees, as RecordsSamples
    does: which windows of a token stream a run, or each part of an interrupted one,
    trained on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            record_samples(x)
        return super().forward(x)
