"""A Hydra callback for multiruns (``-m``): a ranked summary of the sweep.

After every job and at the end of the sweep it rewrites ``summary.csv`` and
``summary.md`` at the sweep root: one row per job (its overrides, status, best
value of the monitored metric, final metrics), completed jobs ranked by the
monitored metric, then the Optuna trials that the pruner stopped ("pruned"),
failed and unfinished jobs. Rewriting after
every job keeps the summary right even when the sweep stops early (Hydra skips
``on_multirun_end`` when a job failed) and when the jobs run elsewhere (SLURM
arrays, submitit): each job's process updates it under a file lock.

It lives in the installed package (not beside ``train.py``) because launchers
that run jobs in other processes must import it there.
"""

import csv
import io
import logging
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from . import trust, upstream
from .files import locked, write_atomic, write_json_atomic
from .launch import global_rank
from .pruning import is_pruned
from .run_dir import RunDirError, save_hydra_files

log = logging.getLogger(__name__)

STATUS_FILE = "job_status.json"  # in each job's run dir, written when the job ends


class SweepSummary(Callback):
    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        # Every SLURM task of a job calls this; rank 0 speaks for the job.
        if config.hydra.mode != RunMode.MULTIRUN or global_rank() != 0:
            return
        run_dir = Path(config.hydra.runtime.output_dir)
        if isinstance(upstream.job_result(job_return), RunDirError):
            return  # another run's directory: not this job's to write into
        if not (run_dir / ".hydra" / "overrides.yaml").exists():  # failed before its claim
            run_dir.mkdir(parents=True, exist_ok=True)
            task_cfg = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
            save_hydra_files(run_dir, task_cfg)
        failed = job_return.status == JobStatus.FAILED
        error = " ".join(str(upstream.job_result(job_return)).split()) if failed else ""
        outcome = "completed"
        if failed:
            outcome = "pruned" if is_pruned(upstream.job_result(job_return)) else "failed"
        status = {"status": outcome, "error": error[:300]}
        write_json_atomic(run_dir / STATUS_FILE, status)
        write_sweep_summary(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        path = write_sweep_summary(Path(config.hydra.sweep.dir))
        log.info(f"sweep summary: {path}")


def job_row(job_dir: Path, sweep_dir: Path) -> dict[str, Any]:
    """What one job's run dir says about it."""
    overrides = list(OmegaConf.load(job_dir / ".hydra" / "overrides.yaml"))
    row: dict[str, Any] = {"job": str(job_dir.relative_to(sweep_dir)), "overrides": overrides}
    status = _read_json(job_dir / STATUS_FILE) or {}
    summary = _read_json(job_dir / "summary.json")
    if summary and not isinstance(summary.get("best"), dict):
        summary = None  # a failed run's history (in-job restarts used up): no result
    config = _read_json(job_dir / "config.json") or {}
    # No status file: the job is still running, or was killed before it could say.
    row["status"] = status.get("status") or ("completed" if summary else "unfinished")
    row["error"] = status.get("error", "")
    row["mode"] = config.get("trainer", {}).get("monitor_mode", "max")
    if summary:
        row["monitor"] = summary["best"]["name"]
        row["best"] = summary["best"]["value"]
        row["best_step"] = summary["best"]["step"]
        row["metrics"] = summary["metrics"]
    return row


def rank_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Completed jobs best first (by their monitor mode), then pruned, failed and
    unfinished ones, each in job order."""
    done = [r for r in rows if r["status"] == "completed" and r.get("best") is not None]
    rest = [r for r in rows if r not in done]
    done.sort(key=lambda r: r["best"], reverse=bool(done) and done[0]["mode"] == "max")
    order = {"pruned": 0, "failed": 1}
    return done + sorted(
        rest,
        key=lambda r: [
            order.get(r["status"], 2),
            *(int(p) if p.isdigit() else p for p in r["job"].split("/")),
        ],
    )


def write_sweep_summary(sweep_dir: Path) -> Path:
    """(Re)write ``summary.csv`` and ``summary.md`` from every job dir; returns the .md."""
    with locked(sweep_dir / ".summary.lock"):
        jobs = sorted(p.parent.parent for p in sweep_dir.glob("**/.hydra/overrides.yaml"))
        rows = rank_rows([job_row(job, sweep_dir) for job in jobs])
        varying = _varying_overrides(rows)
        # The final validation metrics and training loss; throughput is in each summary.json.
        metrics = sorted(
            {
                m
                for r in rows
                for m in r.get("metrics", {})
                if m.startswith("val/") or m == "train/loss"
            }
        )
        header = ["rank", "job", "status", "overrides", "monitor", "best", "best_step", *metrics]
        header.append("error")
        table = []
        for rank, row in enumerate(rows, start=1):
            ranked = row["status"] == "completed" and "best" in row
            values = {
                "rank": rank if ranked else "",
                "job": row["job"],
                "status": row["status"],
                "monitor": row.get("monitor", ""),
                "best": row.get("best", ""),
                "best_step": row.get("best_step", ""),
                **{m: row.get("metrics", {}).get(m, "") for m in metrics},
                "overrides": " ".join(o for o in row["overrides"] if o in varying),
                "error": row["error"],
            }
            table.append([values[h] for h in header])
        out = io.StringIO()
        csv.writer(out).writerows([header, *table])
        write_atomic(sweep_dir / "summary.csv", out.getvalue())
        md = sweep_dir / "summary.md"
        write_atomic(md, _markdown(sweep_dir, rows, header, table))
    return md


def _markdown(sweep_dir: Path, rows: list[dict], header: list[str], table: list[list]) -> str:
    states = ("completed", "pruned", "failed", "unfinished")
    counts = {s: sum(r["status"] == s for r in rows) for s in states}
    monitor = next((r["monitor"] for r in rows if r.get("monitor")), "the monitored metric")
    mode = rows[0]["mode"] if rows else "max"
    lines = [
        f"# Sweep summary: {sweep_dir}",
        "",
        f"{len(rows)} jobs: {counts['completed']} completed, "
        + (f"{counts['pruned']} pruned, " if counts["pruned"] else "")
        + f"{counts['failed']} failed, {counts['unfinished']} unfinished. "
        f"Ranked by the best {monitor} ({mode}).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for cells in table:
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def _varying_overrides(rows: list[dict[str, Any]]) -> set[str]:
    """Overrides that differ between jobs: the ones that tell the rows apart."""
    if len(rows) < 2:
        return {o for r in rows for o in r["overrides"]}
    common = set.intersection(*(set(r["overrides"]) for r in rows))
    return {o for r in rows for o in r["overrides"]} - common


def _read_json(path: Path) -> dict | None:
    try:
        found = trust.read_json(path)
    except trust.Malformed:
        return None
    return found if isinstance(found, dict) else None
