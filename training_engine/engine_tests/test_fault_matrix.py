"""The fault matrix (issue 38, docs/recovery.md): a fault at every moment of a run's life,
with real processes and real signals; after each, the same command must finish the run
bit-exactly with every artefact, or report it finished with every artefact.

Rows: the moments of ``training_engine.moments.LIFE`` (the code that walks through them
calls ``moments.reached``; a moment added there has no cell here, and
``test_every_moment_has_a_cell`` fails). Columns: SIGKILL of the launcher, SIGTERM of the
launcher, SIGKILL of one worker. Setups: the MLP on 1 and 2 processes (DDP), and the end
of a run on ``model=gpt`` under FSDP (2 processes: the final weights are gathered).

One chain per (setup, fault) shares its runs: one run dir, one launch per moment, each
paused there (engine_tests/train_with_faults.py) and hit by the fault; the next launch
is the same command, which must get past what the fault left to the next moment; the
last one finishes. After every fault: each committed checkpoint verifies, and a run dir
that says finished has every artefact. After the last: the final weights, the summary,
metrics.csv and the last checkpoint equal an uninterrupted run's, byte for byte, and
nothing stray is left. The moments of a save (moments.SAVE) are test_checkpoint's
SIGKILL trials; here the "save" row pauses at one of them (before_rename).
"""

import ast
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from training_engine import moments, watchdog
from training_engine.checkpoint import committed_checkpoints, final_weights_problem
from training_engine.checkpoint.format import verify_checkpoint
from training_engine.files import locked

from .conftest import ENV, ONE_PROCESS, PROJECT_ROOT, TRAIN_WITH_FAULTS, run_train
from .test_checkpoint import SIGKILL_TRIALS

pytestmark = pytest.mark.multiprocess

# 16 steps: checkpoints at 3, 6, ..., evaluations at 4, 8, ..., the end at 16.
MLP = [
    "trainer.max_steps=16",
    "trainer.log_every_n_steps=2",
    "trainer.eval_every_n_steps=4",
    "checkpoint.every_n_steps=3",
    "tracker=csv",
    "preflight=off",
    "data.num_workers=0",
]
TOKENS = ["data=tokens", "data.seq_len=16", "data.vocab_size=32", "data.num_train=128"]
GPT = ["model=gpt", "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.dropout=0.0"]
GPT += [*TOKENS, "data.num_val=32", "data.batch_size=8", "trainer.max_steps=6"]
GPT += ["trainer.log_every_n_steps=2", "trainer.eval_every_n_steps=3", "tracker=csv"]
GPT += ["preflight=off", "checkpoint.every_n_steps=3"]
SETUPS = {
    "mlp1": [ONE_PROCESS, *MLP],
    "mlp2": ["parallel=ddp", "parallel.max_restarts=0", *MLP],
    "gpt_fsdp": ["parallel=fsdp", "parallel.max_restarts=0", *GPT],
}
LAST_STEP = {"mlp1": 16, "mlp2": 16, "gpt_fsdp": 6}
FAULTS = ("kill_launcher", "term_launcher", "kill_worker")
END = moments.LIFE[moments.LIFE.index("final_checkpoint") :]

# Where each moment pauses (CKPT_TEST_PAUSE_AT, without the rank): the first time the
# launch reaches it, after where the run stands (a stop signal saved a step later)
PAUSE = {
    "claim": "claim",
    "preflight": "preflight",  # with preflight on, in that launch only
    "first_step": "first_step",
    "step": "step",  # the launch's second step
    "eval": "eval",
    "save": "before_rename",  # one moment of a save; all of them: SIGKILL_TRIALS
    "final_checkpoint": "final_checkpoint@{last}",
    "final_weights": "final_weights",
    "trackers": "trackers",
    "summary": "summary",
    "exit": "exit",
}
# Reached on the main process only, or where only its moment matters (the summary is
# the main process's: another rank's exit comes before it): a worker fault kills rank 0
MAIN_ONLY = {"claim", "save", "final_weights", "trackers", "summary", "exit"}
# The cells no chain runs, and why
NOT_RUN = {
    **{("mlp1", "kill_worker", m): "one process: the launcher is the worker" for m in PAUSE},
    ("mlp2", "kill_worker", "claim"): "no worker yet: the launcher claims the run dir",
    **{
        ("gpt_fsdp", f, m): "the loop's moments: the MLP's cells"
        for f in FAULTS
        for m in moments.LIFE
        if m not in END
    },
}
CHAINS = {
    (setup, fault): [m for m in moments.LIFE if (setup, fault, m) not in NOT_RUN]
    for setup in SETUPS
    for fault in FAULTS
    if any((setup, fault, m) not in NOT_RUN for m in moments.LIFE)
}
# CI runs three chains (about 300 CPU-seconds: one process's two, and the end under FSDP
# with the SIGTERM of the report); `pytest -m slow` runs all nine
IN_CI = {("mlp1", "kill_launcher"), ("mlp1", "term_launcher"), ("gpt_fsdp", "term_launcher")}


def test_every_moment_has_a_cell():
    """The rows come from the code: every moment the engine reaches is declared, every
    declared one is reached somewhere, the watchdog's phases are among them, and each
    (setup, fault, moment) is a chain's or says why not; every moment of a save is
    among test_checkpoint's SIGKILL trials run in CI."""
    reached = set()  # the names in every moments.reached(...) call of the engine
    for path in Path(moments.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            call = node.func if isinstance(node, ast.Call) else None
            if isinstance(call, ast.Attribute) and call.attr == "reached" and node.args:
                names = ast.walk(node.args[0])
                reached |= {n.value for n in names if isinstance(getattr(n, "value", 0), str)}
    assert reached == set(moments.LIFE) - {"save"} | set(moments.SAVE)
    assert set(watchdog.PHASES) <= set(moments.LIFE)
    assert set(PAUSE) == set(moments.LIFE)
    for setup in SETUPS:
        for fault in FAULTS:
            for moment in moments.LIFE:
                cell = (setup, fault, moment)
                assert cell in NOT_RUN or moment in CHAINS.get((setup, fault), []), cell
    trials = {moment for trial in SIGKILL_TRIALS["every_moment_twice"] for moment, _ in trial}
    assert set(moments.SAVE) <= trials


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted run of each setup, made once per session (xdist's workers
    share one: the first makes it under a lock, the others wait for it)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "fault-matrix-references"
    root.mkdir(exist_ok=True)

    def get(setup: str) -> Path:
        run = root / setup
        with locked(root / f"{setup}.lock"):
            if not (run / "summary.json").is_file():
                shutil.rmtree(run, ignore_errors=True)
                run_train(run, *SETUPS[setup])
        return run

    return get


def pause_spec(setup: str, fault: str, moment: str) -> str:
    spec = PAUSE[moment].format(last=LAST_STEP[setup])
    if setup == "mlp1" or moment == "claim":
        return spec  # one process (or the launcher): no RANK
    return f"{spec}#{0 if moment in MAIN_ONLY else 1}"


def launch(run: Path, setup: str, pause: str | None, *extra: str) -> tuple:
    """Start the setup's command (through train_with_faults.py) with output to RUN.out."""
    out = run.parent / f"{run.name}.out"
    seen = out.stat().st_size if out.exists() else 0
    env = {**ENV, **({"CKPT_TEST_PAUSE_AT": pause} if pause else {})}
    cmd = [sys.executable, TRAIN_WITH_FAULTS, f"hydra.run.dir={run}", *SETUPS[setup], *extra]
    with out.open("ab") as sink:
        proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=sink, stderr=sink)
    return proc, out, seen


def paused_pid(proc: subprocess.Popen, out: Path, seen: int, timeout: float = 300) -> int:
    """The pid that printed CKPT_TEST_PAUSED (after byte ``seen`` of ``out``)."""
    deadline = time.monotonic() + timeout
    while True:
        text = out.read_bytes()[seen:].decode(errors="replace")
        if "CKPT_TEST_PAUSED" in text:
            line = text.split("CKPT_TEST_PAUSED", 1)[1].splitlines()[0]
            return int(line.rsplit("pid ", 1)[1])
        assert proc.poll() is None, f"ended before its pause ({proc.returncode}):\n{text[-4000:]}"
        assert time.monotonic() < deadline, f"no pause:\n{text[-4000:]}"
        time.sleep(0.01)


def metric_rows(run: Path) -> dict[tuple[str, str], str]:
    """metrics.csv's training and evaluation values by (step, name), each once."""
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    keyed = [((r["step"], r["name"]), r["value"]) for r in rows]
    assert len({k for k, _ in keyed}) == len(keyed), "a (step, name) logged twice"
    return {k: v for k, v in keyed if k[1].startswith(("train/", "val/"))}


def finished_has_everything(run: Path, ref: Path) -> bool:
    """Whether the run dir says finished; if it does, every artefact is there."""
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    if "best" not in summary:
        return False  # a failed launch's record: to be continued
    assert final_weights_problem(run, summary.get("final_weights")) is None
    assert metric_rows(run) == metric_rows(ref)
    last = committed_checkpoints(run / "checkpoints")[-1]
    assert last.name == committed_checkpoints(ref / "checkpoints")[-1].name
    return True


STRAY = (".tmp", ".part")


def stray(run: Path) -> list[str]:
    """What a killed launch may leave and a finished run must not hold."""
    found = [p for p in run.rglob("*") if p.name.endswith(STRAY)]
    found += [p for p in run.iterdir() if p.name.startswith((".shared-check-", ".preflight"))]
    found += [p for p in run.iterdir() if p.name == ".attempt"]
    found += list(run.glob("hangs/*/beat_rank*.json")) + list(run.glob("hangs/*/step_rank*"))
    found += list((run / "checkpoints").glob("*.superseded-*"))
    return [str(p.relative_to(run)) for p in found]


def hit(proc: subprocess.Popen, fault: str, pid: int) -> None:
    if fault == "kill_launcher":
        proc.send_signal(signal.SIGKILL)
    elif fault == "term_launcher":
        proc.send_signal(signal.SIGTERM)
    else:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setup", "fault"),
    [
        pytest.param(*chain, marks=[pytest.mark.ci] if chain in IN_CI else [], id="-".join(chain))
        for chain in CHAINS
    ],
)
def test_a_fault_at_every_moment_then_the_same_command_finishes_bit_exactly(
    reference, tmp_path, setup, fault
):
    ref = reference(setup)
    run = tmp_path / "run"
    table = []
    chain = CHAINS[(setup, fault)]
    for moment in chain:
        # A fault at the end may leave the run finished (a SIGTERM after the last
        # checkpoint: the run ends as it would have): the next moment of the end is
        # then tried from the run dir as it was before this one, or from none when
        # there was none (gpt_fsdp's chain starts at the end: 2 processes, SIGTERM at
        # the final checkpoint, is finished or not by the race docs/recovery.md names).
        before = tmp_path / "before"
        shutil.rmtree(before, ignore_errors=True)
        existed = run.is_dir()
        if moment in END and moment != chain[-1] and existed:
            shutil.copytree(run, before, symlinks=True)
        extra = ["preflight=default"] if moment == "preflight" else []
        proc, out, seen = launch(run, setup, pause_spec(setup, fault, moment), *extra)
        try:
            pid = paused_pid(proc, out, seen)
            hit(proc, fault, pid)
            code = proc.wait(timeout=120)
        finally:
            proc.kill()
            proc.wait()
        said = out.read_bytes()[seen:].decode(errors="replace")
        assert "Traceback (most recent call last)" not in said.split("CKPT_TEST_PAUSED")[0]
        for ckpt in committed_checkpoints(run / "checkpoints"):
            assert verify_checkpoint(ckpt) is None, (moment, ckpt)
        done = finished_has_everything(run, ref)
        table.append(f"{moment:<17} exit {code:>4}  {'finished' if done else 'to continue'}")
        if done and moment in END and moment != chain[-1]:
            shutil.rmtree(run)
            if existed:
                shutil.copytree(before, run, symlinks=True)
    final = run_train(run, *SETUPS[setup])
    assert "Traceback" not in final.output
    table.append(
        "rerun             exit    0  "
        + ("reported finished" if "is a finished run" in final.output else "finished it")
    )
    print(f"\n{setup} x {fault}:\n  " + "\n  ".join(table))
    # bit-exact, every artefact, nothing stray
    assert (run / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    summary, expected = final.summary, json.loads((ref / "summary.json").read_text())
    for key in ("step", "epoch", "best", "final_weights"):
        assert summary[key] == expected[key], key
    learned = [k for k in expected["metrics"] if k.startswith(("train/", "val/"))]  # not perf/
    assert {k: summary["metrics"][k] for k in learned} == {
        k: expected["metrics"][k] for k in learned
    }
    assert finished_has_everything(run, ref)
    last = committed_checkpoints(run / "checkpoints")[-1]
    theirs = committed_checkpoints(ref / "checkpoints")[-1]
    assert verify_checkpoint(last) is None
    files = json.loads((theirs / "MANIFEST.json").read_text())["files"]
    for name in set(files) - {"trainer_state.json", "config.json"}:  # wall times; its run dir
        if "/" in name:  # a shard: DCP's header metadata differs from save to save
            mine, expected_shard = load_file(last / name), load_file(theirs / name)
            assert mine.keys() == expected_shard.keys(), name
            assert all(torch.equal(mine[k], expected_shard[k]) for k in mine), name
        else:
            assert (last / name).read_bytes() == (theirs / name).read_bytes(), name
    assert stray(run) == []
