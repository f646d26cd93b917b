"""Model FLOPs utilization (MFU): the training FLOPs a run achieves, as a
fraction of what its devices could do at peak.

    MFU = flops_per_sample x samples/s (all ranks) / (peak FLOPs of one device x world size)

A model declares ``flops_per_sample()``: the FLOPs of one training step per
sample, forward plus backward (about 3 x the forward pass, the usual
convention; see ``model.py``). Peaks are NVIDIA's dense (no sparsity) figures
per device for the precision the run computes in. A device missing from the
table (CPUs, other GPUs) gets no MFU, and the reason is reported instead.
"""

import re

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
    return None, f"no peak-FLOPs figure for {name}: add it to PEAK_TFLOPS in flops.py"


class MFU:
    """``perf/mfu`` from a samples/s figure, when the model declares its FLOPs
    per sample and the device has a peak in the table; otherwise nothing."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        mixed_precision: str | bool,
        peak_tflops: float | None = None,
    ):
        declared = getattr(model, "flops_per_sample", None)
        self.flops_per_sample = float(declared()) if callable(declared) else None
        self.peak, self.peak_note = peak_flops(device, mixed_precision, peak_tflops)

    @property
    def reason_missing(self) -> str | None:
        if self.flops_per_sample is None:
            return "the model declares no flops_per_sample()"
        if self.peak is None:
            return self.peak_note
        return None

    def of(self, samples_per_sec: float, world_size: int) -> float | None:
        """MFU for ``samples_per_sec`` summed over all ``world_size`` devices."""
        if self.reason_missing:
            return None
        return self.flops_per_sample * samples_per_sec / (self.peak * world_size)

    def metrics(self, samples_per_sec: float, world_size: int) -> dict[str, float]:
        value = self.of(samples_per_sec, world_size)
        return {} if value is None else {"perf/mfu": value}
