"""Throughput: samples/s, tokens/s and MFU, one code path for the log lines,
preflight's estimate and summary.json's ``rates``; and the one table of devices'
peak FLOPs (docs/preflight.md, MFU).

MFU = training FLOPs/s achieved / the devices' peak. A model declares its cost:
``flops_per_token()`` (sequence models) or ``flops_per_sample()`` (forward +
backward, ~3 x the forward pass); the peak is ``trainer.peak_tflops`` or the
table below (NVIDIA's dense figures); otherwise there is no MFU, with the reason.
The counts of a batch (samples, tokens) come from ``task.py``.
"""

import re
from typing import Any

import torch

# (device name pattern, TFLOPS per precision), from the vendors' data sheets, dense.
# The first match wins: specific names come before the general ones.
# tf32 is what fp32 matmuls reach when TF32 is allowed (torch.set_float32_matmul_precision).
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0}),
    (r"GH200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"MI300X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),  # AMD, ROCm
    (r"H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.1, "fp32": 91.6}),
    (r"L40\b", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"A40\b", {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"V100", {"fp16": 125.0, "fp32": 15.7}),  # no bf16, no tf32
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
]


def compute_precision(mixed_precision: str | bool) -> str:
    """The precision the matmuls run in: bf16/fp16 under mixed precision; for
    full precision tf32 when torch allows it for fp32 matmuls, else fp32."""
    if mixed_precision in ("bf16", "fp16"):
        return mixed_precision
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_flops(
    device: torch.device, mixed_precision: str | bool, peak_tflops: float | None = None
) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, its description), or (None, why there is none).
    ``peak_tflops`` (``trainer.peak_tflops``) overrides the table."""
    if peak_tflops:
        return peak_tflops * 1e12, f"trainer.peak_tflops {peak_tflops:g} TFLOPS"
    if device.type != "cuda":
        return None, f"no peak-FLOPs figure for {device.type.upper()} devices"
    return peak_for_name(torch.cuda.get_device_name(device), compute_precision(mixed_precision))


def peak_for_name(name: str, precision: str) -> tuple[float | None, str]:
    """The table lookup for a device name as CUDA reports it, e.g. "NVIDIA H200"."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name):
            if precision not in peaks:
                return None, f"{name} has no {precision} peak in the table"
            return peaks[precision] * 1e12, f"{name} {precision} peak {peaks[precision]:g} TFLOPS"
    return None, f"no peak-FLOPs figure for {name}: add it to PEAK_TFLOPS in throughput.py"


class Throughput:
    """Samples/s, tokens/s and MFU from a rate of optimizer steps, counted over
    all processes. Build it from the model before ``accelerator.prepare`` wraps it
    (the wrapper hides the model's attributes)."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        processes: int,
        mixed_precision: str | bool = "no",
        peak_tflops: float | None = None,
    ) -> None:
        self.flops_per_token = _declared(model, "flops_per_token")
        self.flops_per_sample = _declared(model, "flops_per_sample")
        self.processes = processes
        self.peak, self.peak_note = peak_flops(device, mixed_precision, peak_tflops)

    def reason_missing(self, tokens: bool = False) -> str | None:
        """Why there is no MFU (None: there is one)."""
        if self.flops_per_sample is None and not (tokens and self.flops_per_token):
            return "the model declares no flops_per_sample()"
        if self.peak is None:
            return self.peak_note
        return None

    def metrics(
        self, steps_per_sec: float, *, samples: int, tokens: int | None = None
    ) -> dict[str, float]:
        """``samples`` and ``tokens`` of one optimizer step on one process (all its
        micro-batches; ``task.batch_size`` counts them)."""
        scale = steps_per_sec * self.processes
        out = {"perf/samples_per_sec": scale * samples}
        flops = None
        if tokens is not None:
            out["perf/tokens_per_sec"] = scale * tokens
            if self.flops_per_token:
                flops = out["perf/tokens_per_sec"] * self.flops_per_token
        if flops is None and self.flops_per_sample:
            flops = out["perf/samples_per_sec"] * self.flops_per_sample
        if flops is not None and self.peak:
            out["perf/mfu"] = flops / (self.peak * self.processes)
        return out

    def summary(
        self,
        steps: int,
        wall_s: float,
        excluded_s: dict[str, float],
        samples: int,
        tokens: int | None,
        accumulated: int = 1,
    ) -> dict[str, Any]:
        """summary.json's ``rates``: the run's rates over its whole wall time
        (``whole_run``) and over training time only (``training_only``: without
        the seconds in ``excluded_s``, e.g. evaluation and blocking saves, which
        are listed too). ``samples``/``tokens``: of one micro-batch on one process."""
        training_s = wall_s - sum(excluded_s.values())

        def rates(seconds: float) -> dict[str, float]:
            per_sec = steps / seconds if seconds > 0 else 0.0
            counted = self.metrics(
                per_sec,
                samples=samples * accumulated,
                tokens=None if tokens is None else tokens * accumulated,
            )
            out = {"seconds": round(seconds, 3), "steps_per_sec": round(per_sec, 3)}
            digits = {"perf/mfu": 6}  # a fraction; the others are counts per second
            return out | {k[5:]: round(v, digits.get(k, 1)) for k, v in counted.items()}

        excluded = {f"{kind}_s": round(value, 3) for kind, value in excluded_s.items()}
        return {"whole_run": rates(wall_s), "training_only": rates(training_s), **excluded}


def _declared(model: Any, name: str) -> float | None:
    """``model.<name>()`` if the model declares it, else None."""
    method = getattr(model, name, None)
    return float(method()) if callable(method) else None
