"""Throughput for the log lines: samples/s, tokens/s and MFU.

MFU (model FLOPs utilization) = achieved training FLOPs/s / the devices' peak.
The model declares its cost: ``flops_per_token`` (sequence models, e.g.
``gpt.GPT``) or ``flops_per_sample``; models that declare neither get no MFU.
The peak is ``trainer.peak_tflops`` per device when set, else the dense
bf16/fp16 tensor-core peak of a known GPU (below), else unknown (CPUs): no MFU.
"""

from typing import Any

import torch

# Dense (not sparse) bf16 peak TFLOP/s per device, from the vendors' data sheets.
# More specific names first: "H100 PCIe" before "H100".
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("MI300X", 1307.0),
)


def device_peak_tflops(device: torch.device) -> float | None:
    """The known bf16 peak of ``device``, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


class Throughput:
    """Turns the steps/s of a log window into samples/s, tokens/s and MFU,
    counted over all processes. Build it from the model before
    ``accelerator.prepare`` wraps it (the wrapper hides the model's attributes)."""

    def __init__(self, model: Any, accelerator: Any, peak_tflops: float | None = None) -> None:
        self.flops_per_token = getattr(model, "flops_per_token", None)
        self.flops_per_sample = getattr(model, "flops_per_sample", None)
        self.processes = accelerator.num_processes
        peak = peak_tflops or device_peak_tflops(accelerator.device)
        self.peak_flops = peak * 1e12 * self.processes if peak else None

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
