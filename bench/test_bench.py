"""The bench's own tests: its quick mode on a baked project (every figure printed,
never judged: timings on shared CI machines mean nothing), its turns (real
processes, real pipes), and the logging benchmark. Moved here from the baked
project's tests/test_perf.py and tests/test_tracking.py with the bench."""

import json
import math
import os
import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from bench_turns import run_in_turns

BENCH = Path(__file__).resolve().parent  # bench.py and its scripts
GOAL_LINE = re.compile(r"[<>]= [\d.]+ +(met|NOT MET) ")


@pytest.mark.multiprocess
def test_bench_quick_mode_reports_every_figure(project, tmp_path):
    out = tmp_path / "bench.json"
    args = ["--project", str(project), "--quick", "--json", str(out), "--dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench.py"), *args],
        cwd=tmp_path,  # anywhere: --project says what is measured
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(proc.stdout)  # the figures, for the CI log (timings are not judged)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    figures = report["figures"]
    assert set(figures) == {
        "loop_ratio",
        "ddp_loop_ratio",
        "first_step_ratio",
        "process_ratio",
        "preflight_share",
        "save_ratio",
        "load_ratio",
        "async_block_ratio",
        "log_overhead",
        "step_ratio",
    }
    assert set(report["baselines"]) == set(figures) and all(report["baselines"].values())
    costs = report["details"]["startup_costs_s"]  # --only startup's list of fixed costs
    assert {"import torch", "preflight (example task, defaults)"} <= set(costs)
    assert all(v >= 0 for v in costs.values())
    assert report["details"]["ours_step_ms"] > 0 and report["details"]["bare_step_ms"] > 0
    assert report["details"]["log_calls"] > 0  # log_overhead's side really logged
    assert "thread_pin_cost" in report["details"]  # the third side of the loop's turns
    cpu = report["details"]["ddp_cpu_ms_per_step"]  # each DDP side's CPU, where it goes
    assert set(cpu) == {"ours_main", "ours_other", "bare_main", "bare_other"}
    assert cpu["ours_main"] > 0 and cpu["bare_main"] > 0 and min(cpu.values()) >= 0
    assert all(math.isfinite(v) for v in figures.values())
    assert all(figures[k] > 0 for k in figures if k != "log_overhead")  # ratios of timings
    assert report["settings"]["quick"] is True and "csv" in report["settings"]["trackers"]
    assert report["machine"]["torch"] == torch.__version__
    for name in figures:  # each with its goal, met or NOT MET, and its baseline
        line = next(x for x in proc.stdout.splitlines() if x.startswith(name + " "))
        assert GOAL_LINE.search(line) and report["baselines"][name] in line, line
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # scratch files removed


def test_bench_without_a_project_says_how_to_give_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "BENCH_PROJECT"}
    for args in ([], ["--project", str(tmp_path)]):
        proc = subprocess.run(
            [sys.executable, str(BENCH / "bench.py"), "--quick", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 if not args else proc.returncode == 1, proc.stderr
        expected = "--project DIR" if not args else "is not a baked project"
        assert expected in proc.stderr, proc.stderr


TURN_CHILD = """
import os, sys
sys.path.insert(0, {bench!r})
from bench_turns import Turn
side, folder, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
turn = Turn(folder, side, every=2)
for step in range(steps):
    with open(os.path.join(folder, "order.log"), "a") as log:
        log.write(f"{{side}} {{step}}\\n")
    turn.after_step()
"""


def _turn_commands(tmp_path, steps: dict[str, int]) -> dict[str, list[str]]:
    child = tmp_path / "child.py"
    child.write_text(TURN_CHILD.format(bench=str(BENCH)))
    return {
        side: [sys.executable, str(child), side, str(tmp_path), str(n)] for side, n in steps.items()
    }


@pytest.mark.multiprocess
def test_bench_turns_run_one_side_at_a_time_in_rotating_order(tmp_path):
    """bench.py's loop figures: the sides run at once but train in turns, blocks
    of ``every`` steps, the order rotating (real processes, real pipes)."""
    commands = _turn_commands(tmp_path, {"a": 8, "b": 8, "c": 8})
    seconds = run_in_turns(commands, tmp_path, ranks=1, every=2, blocks=4, untimed=2, cwd=tmp_path)
    assert {side: len(s) for side, s in seconds.items()} == {"a": 2, "b": 2, "c": 2}
    assert all(t > 0 for s in seconds.values() for t in s)
    lines = (tmp_path / "order.log").read_text().split()
    steps = [(lines[i], int(lines[i + 1])) for i in range(0, len(lines), 2)]
    first = steps[:6]  # block 0: all three at once, in any interleaving
    assert sorted(first) == sorted((side, n) for side in "abc" for n in (0, 1))
    rest = [side for side, _ in steps[6:]]
    # blocks 1-3 one side at a time, two steps each: b c a | c a b | a b c
    assert rest == [s for s in "bcacababc" for _ in range(2)]
    assert [n for side, n in steps[6:] if side == "a"] == [2, 3, 4, 5, 6, 7]


@pytest.mark.multiprocess
def test_bench_turns_name_a_side_that_exits_early(tmp_path):
    commands = _turn_commands(tmp_path, {"ours": 8, "bare": 3})
    with pytest.raises(SystemExit, match=r"the bare process exited early \(exit 0\)"):
        run_in_turns(commands, tmp_path, ranks=1, every=2, blocks=4, untimed=1, cwd=tmp_path)


@pytest.mark.slow
def test_benchmark_script_prints_the_ratio(project, tmp_path):
    """bench_tracking.py: steps/s with tracker=none against [csv,tensorboard]."""
    if find_spec("tensorboard") is None and os.environ.get("TESTS_SKIP_MISSING_EXTRAS") == "1":
        pytest.skip("not installed here: tensorboard")
    # No W&B or MLflow settings from the machine, and a fresh HOME (no `wandb login` key).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    (tmp_path / "home").mkdir()
    env["HOME"] = str(tmp_path / "home")
    tiny = ["--steps", "20", "--repeats", "1", "--dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_tracking.py"), "--project", str(project), *tiny],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("ratio")]
    assert float(line.split()[-1]) > 0
    assert [p.name for p in tmp_path.iterdir()] == ["home"]  # its runs are removed
