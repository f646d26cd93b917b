"""parallel=deepspeed with the defaults on (checkpoints, preflight): real 2-process
runs on CPU (gloo) of model=gpt, DeepSpeed built without ops (docs/deepspeed.md).

One uninterrupted ZeRO-3 run is the reference: ZeRO-2 and ZeRO-3 train the same
fp32 weights bit for bit here (measured), so both stages' killed and resumed runs
must end torch.equal to it."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from training_engine.checkpoint import format as fmt
from training_engine.checkpoint import save as protocol

from .conftest import ENV, PROJECT_ROOT, wait_for
from .test_lifecycle import recorded
from .test_parallel import command, ok

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.multiprocess

GPT = ["model=gpt", "data=tokens", "model.n_layer=1", "model.d_model=32", "model.n_head=2"]
# checkpoints every 3 steps (keep_last 3, best): step 3 and 6 exist when the kill comes
ARGS = ["parallel=deepspeed", "parallel.num_processes=2", *GPT, "tracker=csv"]
ARGS += ["trainer.max_steps=12", "trainer.log_every_n_steps=3", "trainer.eval_every_n_steps=6"]
ARGS += ["checkpoint.every_n_steps=3"]


def launch(args: list[str], run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(*args, *extra, f"hydra.run.dir={run_dir}"),
        cwd=PROJECT_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def train(run_dir: Path, *extra: str) -> str:
    return ok(launch(ARGS, run_dir, *extra))


def killed_at(run_dir: Path, stage: int, checkpoint: str) -> list[Path]:
    """The run, SIGKILLed (the launcher; its workers die with it) once ``checkpoint``
    is committed; its committed checkpoints."""
    launcher = subprocess.Popen(
        command(*ARGS, f"parallel.zero_stage={stage}", f"hydra.run.dir={run_dir}"),
        cwd=PROJECT_ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(run_dir / "checkpoints" / checkpoint, timeout=400)
    finally:
        launcher.send_signal(signal.SIGKILL)
        assert launcher.wait(timeout=120) == -9
    assert not (run_dir / "summary.json").exists()  # killed mid-run
    return sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted ZeRO-3 run (preflight's round trip included)."""
    run_dir = tmp_path_factory.mktemp("deepspeed") / "straight"
    train(run_dir, "parallel.zero_stage=3")
    return run_dir


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path)


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def logs(run_dir: Path) -> str:
    """Every rank's log (a rank reports the files it checks itself)."""
    return "".join(p.read_text() for p in sorted(run_dir.glob("train*.log")))


def forge(ckpt: Path, name: str, data: bytes) -> None:
    """``name`` replaced by ``data`` and its manifest entry forged to match."""
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / fmt.MANIFEST).read_text())
    manifest["files"][name] = fmt.file_entry(data)
    (ckpt / fmt.MANIFEST).write_text(json.dumps(manifest))


class Hostile:
    """Unpickled, it would create a file: the proof that it ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_zero3_trains_checkpoints_evaluates_exports_and_resumes_past_a_hostile_pickle(
    straight, tmp_path
):
    """ZeRO-3: DeepSpeed's own files in each checkpoint beside the gathered
    model; the run's model.safetensors, the last checkpoint's and the export are
    the same full weights; eval.py equals the recorded metrics. Killed, a hostile
    pickle (manifest forged to match) in place of a DeepSpeed file of the newest
    checkpoint: refused unrun, the run resumes from the previous one and ends with
    the uninterrupted run's weights."""
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["step"] == 12 and summary["world_size"] == 2
    assert recorded(straight, "train/loss")[12] < recorded(straight, "train/loss")[3]
    preflight = json.loads((straight / "preflight.json").read_text())
    assert {c["name"]: c["status"] for c in preflight["checks"]}["checkpoint"] == "pass"
    last = straight / "checkpoints" / "step_0000012"
    manifest = json.loads((last / fmt.MANIFEST).read_text())
    assert manifest["layout"] == "deepspeed" and manifest["world_size"] == 2
    own = sorted(n for n in manifest["files"] if n.startswith("deepspeed/"))
    assert own == [
        f"deepspeed/zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
        for r in (0, 1)
        for kind in ("model", "optim")
    ]
    final = weights(straight / "model.safetensors")
    assert_equal(weights(last / "model.safetensors"), final)
    assert all(t.numel() > 0 for t in final.values())  # gathered, not ZeRO-3's empty shards

    exported = tmp_path / "export.safetensors"
    module = "training_engine.checkpoint"
    export = [sys.executable, "-m", module, "export", str(last), "-o", str(exported)]
    ok(subprocess.run(export, cwd=PROJECT_ROOT, env=ENV, capture_output=True, text=True))
    assert_equal(weights(exported), final)

    out = tmp_path / "eval"
    evaluate = [sys.executable, "eval.py", f"hydra.run.dir={out}", f"ckpt={straight}"]
    ok(subprocess.run(evaluate, cwd=PROJECT_ROOT, env=ENV, capture_output=True, text=True))
    report = json.loads((out / "eval.json").read_text())
    assert report["step"] == summary["best"]["step"]
    for name, value in report["metrics"].items():
        assert value == pytest.approx(recorded(straight, name)[report["step"]], abs=1e-6), name

    run_dir = tmp_path / "killed"
    saved = killed_at(run_dir, 3, "step_0000006")
    newest, previous = saved[-1], saved[-2]
    marker = tmp_path / "the-pickle-ran"
    victim = "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    hostile = protocol.torch_bytes({"optimizer_state_dict": Hostile(marker)}).tobytes()
    forge(newest, victim, hostile)
    train(run_dir, "parallel.zero_stage=3")
    assert not marker.exists()
    assert f"skipping checkpoint {newest}: {newest / victim}: refused" in logs(run_dir)
    resumed = json.loads((run_dir / "summary.json").read_text())["resumed_from"]
    assert Path(resumed).name == previous.name
    assert_equal(weights(run_dir / "model.safetensors"), final)


def test_zero2_killed_and_resumed_past_a_corrupt_checkpoint_is_bit_exact(straight, tmp_path):
    """ZeRO-2 (one mp_rank_00 model file, a partition of the optimizer per rank):
    killed, the newest checkpoint's rank-0 partition damaged; the same command
    falls back to the previous checkpoint and ends with the uninterrupted weights."""
    run_dir = tmp_path / "killed"
    saved = killed_at(run_dir, 2, "step_0000006")
    newest, previous = saved[-1], saved[-2]
    one = [a if a != "parallel.num_processes=2" else "parallel.num_processes=1" for a in ARGS]
    # on another number of processes: refused (exit 2) before any work, naming both
    other = launch(one, run_dir, "parallel.zero_stage=2")
    said = other.stdout + other.stderr
    assert other.returncode == 2, said[-3000:]
    assert "with 2 processes; this run has 1" in said and "Traceback" not in said
    assert sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir()) == saved
    manifest = json.loads((newest / fmt.MANIFEST).read_text())
    assert sorted(n for n in manifest["files"] if n.startswith("deepspeed/")) == [
        "deepspeed/mp_rank_00_model_states.pt",
        "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    damaged = newest / "deepspeed" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    train(run_dir, "parallel.zero_stage=2")
    assert f"skipping checkpoint {newest}: {damaged}: {fmt.HASH} does not match" in logs(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert Path(summary["resumed_from"]).name == previous.name and summary["step"] == 12
    assert_equal(weights(run_dir / "model.safetensors"), weights(straight / "model.safetensors"))


def test_on_a_cpu_deepspeeds_shared_memory_op_is_never_built(compose_cfg):
    """Its JIT build cost the first run on a machine 2.5 minutes, for an op only
    DeepSpeed's inference uses: with the plugin made on a CPU, DeepSpeed's own
    start-up (build_shm_op, run as its backend starts) builds nothing."""
    from deepspeed.comm.torch import build_shm_op

    from training_engine import accel

    assert not torch.cuda.is_available()  # this suite's machines
    accel._deepspeed_plugin(compose_cfg("parallel=deepspeed", *GPT))
    assert build_shm_op() is None


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_offload_trains_and_its_checkpoint_round_trips(stage, tmp_path):
    """offload_optimizer=cpu: DeepSpeed's CPU Adam, which a DeepSpeed built without
    ops compiles on first use (a C++ compiler; measured about 5 minutes on 2 busy
    cores, then cached in ~/.cache/torch_extensions): slow, so not in CI's selection.
    Its numbers differ from torch's AdamW by float rounding, so the test asks that it
    trains, that preflight's round trip (save, load back, every tensor compared)
    passes, and that its checkpoints hold DeepSpeed's files."""
    run_dir = tmp_path / "offload"
    train(run_dir, f"parallel.zero_stage={stage}", "parallel.offload_optimizer=cpu")
    assert recorded(run_dir, "train/loss")[12] < recorded(run_dir, "train/loss")[3]
    preflight = json.loads((run_dir / "preflight.json").read_text())
    assert {c["name"]: c["status"] for c in preflight["checks"]}["checkpoint"] == "pass"
    manifest = json.loads((run_dir / "checkpoints" / "step_0000012" / fmt.MANIFEST).read_text())
    assert manifest["layout"] == "deepspeed"
    assert any(n.endswith("_optim_states.pt") for n in manifest["files"])
