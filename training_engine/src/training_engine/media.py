"""Images, histograms and texts for the run's trackers, apart from the scalars.
``Media(accelerator, run_dir)`` once; then ``image``, ``histogram`` and ``text``
(``name``, value, ``step=``) send one item to every started tracker: TensorBoard's
event files, W&B's run history, MLflow artifacts and, with the csv tracker, files
under ``<run dir>/media/step_<N>/``. Only the main process converts and writes;
other ranks return at once. Media never enter MetricBook or summary.json.
docs/trackers.md, "Media".
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import asdict, dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .files import write_atomic
from .trackers import CSVTracker, MLflowTracker, TensorBoardTracker, WandBTracker

BINS = 64  # a histogram's bins unless the call says (W&B's default too)
MAX_BINS = 512  # W&B's limit
MEDIA_DIR = "media"  # in the run dir (csv) and in MLflow's artifacts
_NAME_PART = re.compile(r"[A-Za-z0-9_.\-]+")


class Media:
    """One call per item, to every tracker of ``accelerator`` started at that
    moment (built before or after ``start_trackers``: they are looked up per call)."""

    def __init__(self, accelerator: Any, run_dir: str | Path) -> None:
        self.accelerator = accelerator
        self.run_dir = Path(run_dir)
        self._cached: tuple[list[Any], list[Any]] = ([], [])  # (trackers, their sinks)

    def image(self, name: str, value: Any, *, step: int) -> None:
        """``value``: a torch tensor (C,H,W or H,W), a numpy array (H,W,C or H,W),
        C in 1, 3, 4, uint8 or float in [0, 1]; or a PIL image. Needs Pillow."""
        if not self.accelerator.is_main_process:
            return
        file = artifact_path(name, step, ".png")
        pixels = as_pixels(name, value)
        for sink in self._sinks():
            sink.image(name, pixels, step, file)

    def histogram(self, name: str, values: Any, *, step: int, bins: int = BINS) -> None:
        """``values``: a tensor, an array or a sequence of numbers (any shape,
        flattened, finite); the same ``bins`` equal-width bins for every tracker."""
        if not self.accelerator.is_main_process:
            return
        file = artifact_path(name, step, ".json")
        hist = Histogram.of(name, values, bins)
        for sink in self._sinks():
            sink.histogram(name, hist, step, file)

    def text(self, name: str, text: str, *, step: int) -> None:
        if not self.accelerator.is_main_process:
            return
        file = artifact_path(name, step, ".txt")
        if not isinstance(text, str):
            raise TypeError(f"media text {name!r}: a str is needed, got {type(text).__name__}")
        for sink in self._sinks():
            sink.text(name, text, step, file)

    def _sinks(self) -> list[Any]:
        """One sink per started tracker that takes media, made again only when the
        trackers change (an MLflow client opens its store)."""
        trackers = list(self.accelerator.trackers)  # empty on other ranks
        if len(trackers) == len(self._cached[0]) and all(
            a is b for a, b in zip(trackers, self._cached[0], strict=True)
        ):
            return self._cached[1]
        sinks: list[Any] = []
        for tracker in trackers:
            if isinstance(tracker, CSVTracker):
                sinks.append(_Files(self.run_dir))
            elif isinstance(tracker, TensorBoardTracker):
                sinks.append(_TensorBoard(tracker.writer))
            elif isinstance(tracker, WandBTracker):
                sinks.append(_WandB(tracker.run))
            elif isinstance(tracker, MLflowTracker):
                sinks.append(_MLflow(tracker.tracking_uri, tracker.run_id))
        self._cached = (trackers, sinks)
        return sinks


# --- the values, checked and converted once for every tracker ---------------------------


def artifact_path(name: str, step: int, suffix: str) -> str:
    """``media/step_0000030/<name><suffix>`` (the checkpoints' step naming); the name
    becomes a path, so it is checked as one: parts of letters, digits, ``_ - .``."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if not all(_NAME_PART.fullmatch(p) and p not in (".", "..") for p in parts):
        raise ValueError(
            f"media name {name!r}: use letters, digits, '_', '-', '.', "
            "with '/' between parts (e.g. 'val/samples')"
        )
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"media {name!r}: step={step!r}, a non-negative int is needed")
    return f"{MEDIA_DIR}/step_{step:07d}/{name}{suffix}"


def as_pixels(name: str, value: Any) -> np.ndarray:
    """uint8 pixels, H,W (grey) or H,W,C (C = 3 RGB, 4 RGBA)."""
    if find_spec("PIL") is None:
        raise ModuleNotFoundError(f"media image {name!r} needs Pillow: pip install pillow")
    from PIL import Image

    if isinstance(value, Image.Image):
        if value.mode not in ("L", "RGB", "RGBA"):
            value = value.convert("RGBA" if "A" in value.mode else "RGB")
        return np.asarray(value).copy()
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.float()  # numpy has no bfloat16
        if tensor.ndim == 3:
            tensor = tensor.permute(1, 2, 0)  # C,H,W -> H,W,C
        array, layout = tensor.numpy(), "a tensor is C,H,W or H,W"
    elif isinstance(value, np.ndarray):
        array, layout = value, "an array is H,W,C or H,W"
    else:
        raise TypeError(
            f"media image {name!r}: a torch tensor, numpy array or PIL image is needed, "
            f"got {type(value).__name__}"
        )
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (1, 3, 4))):
        shape = tuple(value.shape)
        raise ValueError(f"media image {name!r}: shape {shape}; {layout}, C in 1, 3, 4")
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"media image {name!r}: dtype {array.dtype}; uint8 or float in [0, 1]")
    if array.size and not (np.isfinite(array).all() and array.min() >= 0 and array.max() <= 1):
        raise ValueError(
            f"media image {name!r}: float values from {array.min()} to {array.max()}; "
            "a float image is in [0, 1] (or pass uint8)"
        )
    return np.round(array * 255).astype(np.uint8)


@dataclass(frozen=True)
class Histogram:
    """Counts of ``bins`` equal-width bins (``edges``: bins + 1) and the summary
    numbers TensorBoard keeps; computed once, so every tracker shows the same."""

    counts: list[int]
    edges: list[float]
    min: float
    max: float
    num: int
    sum: float
    sum_squares: float

    @classmethod
    def of(cls, name: str, values: Any, bins: int) -> Histogram:
        if isinstance(bins, bool) or not isinstance(bins, int) or not 1 <= bins <= MAX_BINS:
            raise ValueError(f"media histogram {name!r}: bins={bins!r}; an int in 1..{MAX_BINS}")
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().double().numpy()
        try:
            data = np.asarray(values, dtype=np.float64).ravel()
        except (TypeError, ValueError) as err:
            raise TypeError(f"media histogram {name!r}: numbers are needed ({err})") from None
        if data.size == 0 or not np.isfinite(data).all():
            problem = "no values" if data.size == 0 else "values that are not finite"
            raise ValueError(f"media histogram {name!r}: {problem}; finite numbers are needed")
        counts, edges = np.histogram(data, bins=bins)
        return cls(
            counts=counts.tolist(),
            edges=edges.tolist(),
            min=float(data.min()),
            max=float(data.max()),
            num=int(data.size),
            sum=float(data.sum()),
            sum_squares=float(data @ data),
        )


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


# --- what each tracker does with them --------------------------------------------------


class _Files:
    """The csv tracker: files in the run dir, ``media/step_<N>/<name>.png|.json|.txt``."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def _write(self, file: str, data: bytes | str) -> None:
        path = self.run_dir / file
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)

    def image(self, name: str, pixels: np.ndarray, step: int, file: str) -> None:
        self._write(file, _png(pixels))

    def histogram(self, name: str, hist: Histogram, step: int, file: str) -> None:
        self._write(file, json.dumps(asdict(hist)) + "\n")

    def text(self, name: str, text: str, step: int, file: str) -> None:
        self._write(file, text)


class _TensorBoard:
    """The run's SummaryWriter: the event files the scalars go to."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def image(self, name: str, pixels: np.ndarray, step: int, file: str) -> None:
        layout = "HW" if pixels.ndim == 2 else "HWC"
        self.writer.add_image(name, pixels, global_step=step, dataformats=layout)

    def histogram(self, name: str, hist: Histogram, step: int, file: str) -> None:
        self.writer.add_histogram_raw(
            name,
            min=hist.min,
            max=hist.max,
            num=hist.num,
            sum=hist.sum,
            sum_squares=hist.sum_squares,
            bucket_limits=hist.edges[1:],  # each bucket's upper edge
            bucket_counts=hist.counts,
            global_step=step,
        )

    def text(self, name: str, text: str, step: int, file: str) -> None:
        self.writer.add_text(name, text, global_step=step)  # rendered as Markdown


class _WandB:
    """The run's history at ``step`` (the files in the run's ``files/media/``)."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def image(self, name: str, pixels: np.ndarray, step: int, file: str) -> None:
        import wandb

        self.run.log({name: wandb.Image(pixels)}, step=step)

    def histogram(self, name: str, hist: Histogram, step: int, file: str) -> None:
        import wandb

        self.run.log({name: wandb.Histogram(np_histogram=(hist.counts, hist.edges))}, step=step)

    def text(self, name: str, text: str, step: int, file: str) -> None:
        import wandb

        self.run.log({name: wandb.Table(columns=["text"], data=[[text]])}, step=step)


class _MLflow:
    """Artifacts of the run, ``media/step_<N>/<name>.png|.json|.txt``."""

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        from mlflow import MlflowClient

        self.client, self.run_id = MlflowClient(tracking_uri), run_id

    def image(self, name: str, pixels: np.ndarray, step: int, file: str) -> None:
        self.client.log_image(self.run_id, pixels, artifact_file=file)

    def histogram(self, name: str, hist: Histogram, step: int, file: str) -> None:
        self.client.log_dict(self.run_id, asdict(hist), file)

    def text(self, name: str, text: str, step: int, file: str) -> None:
        self.client.log_text(self.run_id, text, file)
