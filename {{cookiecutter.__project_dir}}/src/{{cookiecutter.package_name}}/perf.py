"""Throughput for the log lines: samples/s, tokens/s and MFU.

MFU (model FLOPs utilization) = achieved training FLOPs/s / the devices' peak.
The model declares its cost: ``flops_per_token()`` (sequence models, e.g.
``gpt.GPT``) or ``flops_per_sample()``; models that declare neither get no MFU.
The peak is ``trainer.peak_tflops`` per device when set, else the dense peak of
a known GPU for the run's precision (``flops.py``), else unknown (CPUs): no MFU.
"""

from typing import Any

import torch

from .flops import peak_flops


class Throughput:
    """Turns the steps/s of a log window into samples/s, tokens/s and MFU,
    counted over all processes. Build it from the model before
    ``accelerator.prepare`` wraps it (the wrapper hides the model's attributes)."""

    def __init__(
        self,
        model: Any,
        accelerator: Any,
        mixed_precision: str | bool = "no",
        peak_tflops: float | None = None,
    ) -> None:
        self.flops_per_token = _declared(model, "flops_per_token")
        self.flops_per_sample = _declared(model, "flops_per_sample")
        self.processes = accelerator.num_processes
        peak = peak_flops(accelerator.device, mixed_precision, peak_tflops)[0]
        self.peak_flops = peak * self.processes if peak else None

    def metrics(self, steps_per_sec: float, targets: torch.Tensor, micro_batches: int) -> dict:
        """``targets``: one micro-batch's targets; (batch,) for classes, (batch,
        positions) for tokens, where every position is one prediction."""
        batches_per_sec = steps_per_sec * micro_batches * self.processes
        out = {"perf/samples_per_sec": batches_per_sec * len(targets)}
        flops = None
        if targets.dim() > 1:
            out["perf/tokens_per_sec"] = batches_per_sec * targets.numel()
            if self.flops_per_token:
                flops = out["perf/tokens_per_sec"] * self.flops_per_token
        if flops is None and self.flops_per_sample:
            flops = out["perf/samples_per_sec"] * self.flops_per_sample
        if flops is not None and self.peak_flops:
            out["perf/mfu"] = flops / self.peak_flops
        return out


def _declared(model: Any, name: str) -> float | None:
    """``model.<name>()`` if the model declares it, else None."""
    method = getattr(model, name, None)
    return float(method()) if callable(method) else None
