"""Sharded checkpoints and elastic resume: real 2-process FSDP/DDP runs on CPU
(gloo) saving and resuming on other world sizes and parallel modes, the files
scanned for pickles, a forged pickle and a flipped byte refused, export; and
the pure position/accumulation logic in-process."""

import csv
import json
import os
import pickle
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from digit_trainer.data.digits import digits
from safetensors import safe_open
from safetensors.torch import load_file

from training_engine.checkpoint import elastic, folder
from training_engine.checkpoint import format as fmt
from training_engine.checkpoint.__main__ import main as checkpoint_cli
from training_engine.config import allowed_config_changes, config_differences

from .conftest import ENV, ONE_PROCESS, PROJECT_ROOT
from .faults import sample_hash

# 1472 training samples (val_fraction 0.1809 of 1797): 23 global batches of
# 2 x 32, so every world size here sees whole batches (no padding repeats).
DATA = ["data.batch_size=32", "data.val_fraction=0.1809"]
COMMON = [*DATA, "tracker=csv", "preflight=off", "trainer.log_every_n_steps=2", "model.dropout=0.0"]
FSDP = ["parallel=fsdp", "parallel.auto_wrap_min_params=1000"]  # FSDP units of this small MLP


def train(run_dir: Path, *overrides: str, check: bool = True, **env: str):
    cmd = [sys.executable, str(PROJECT_ROOT / "train.py"), f"hydra.run.dir={run_dir}", ONE_PROCESS]
    proc = subprocess.run(
        [*cmd, *overrides],
        cwd=PROJECT_ROOT,
        env={**ENV, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    if check:
        assert proc.returncode == 0, out[-5000:]
    return proc.returncode, out


def train_losses(run_dir: Path) -> list[float]:
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return [float(r["value"]) for r in rows if r["name"] == "train/loss"]


# --- pure logic (in-process) ------------------------------------------------------------


def test_position_and_accumulation_on_another_world_size():
    mid = {"batch": 10, "batches_per_epoch": 12, "samples_in_epoch": 10 * 2 * 32}
    same = elastic.resume_batch(mid, saved_world=2, world=2, batch_size=32, batches_per_epoch=12)
    assert same == (10, None)
    assert elastic.resume_batch(
        mid, saved_world=2, world=1, batch_size=32, batches_per_epoch=23
    ) == (20, None)
    # 3 processes: 640 samples = 6 x 96 + 64: continue after 576, 64 samples again, said so
    done, warning = elastic.resume_batch(
        mid, saved_world=2, world=3, batch_size=32, batches_per_epoch=8
    )
    assert done == 6 and "576" in warning and "64 samples" in warning
    # a finished epoch stays finished; an old checkpoint without samples_in_epoch
    end = {"batch": 12, "batches_per_epoch": 12}
    assert (
        elastic.resume_batch(end, saved_world=2, world=1, batch_size=32, batches_per_epoch=23)[0]
        == 23
    )
    old = {"batch": 4, "batches_per_epoch": 12}
    assert elastic.resume_batch(
        old, saved_world=2, world=1, batch_size=32, batches_per_epoch=23
    ) == (8, None)
    assert elastic.grad_accum_for(2, 1, 1, configured=1) == (2, None)
    assert elastic.grad_accum_for(1, 2, 2, configured=2) == (1, None)
    assert elastic.grad_accum_for(4, 3, 2, configured=3) == (6, None)
    accum, warning = elastic.grad_accum_for(1, 1, 2, configured=1)
    assert accum == 1 and "1 is not divisible by 2" in warning and "2 x 1" in warning


def test_process_count_and_parallel_mode_may_change_nothing_else(compose_cfg):
    from omegaconf import OmegaConf

    def resolved(*overrides):
        return OmegaConf.to_container(compose_cfg(*overrides), resolve=True)

    ddp = resolved("parallel=ddp")
    allowed = allowed_config_changes(ddp)
    for other in (
        ["parallel=none"],
        ["parallel=fsdp"],
        ["parallel=ddp", "parallel.num_processes=4"],
    ):
        assert config_differences(ddp, resolved(*other), allowed) == [], other
    refused = config_differences(
        ddp, resolved("parallel=none", "trainer.grad_accum_steps=2"), allowed
    )
    assert refused == ["trainer.grad_accum_steps: 1 -> 2"]
    assert config_differences(ddp, resolved("parallel=fsdp", "optimizer.lr=0.1"), allowed)


# --- real runs --------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_one_epoch_across_world_sizes_and_modes_sees_every_sample_once(tmp_path):
    """One epoch in five parts: 1 process (sharded) -> FSDP on 2 -> 1 process
    (sharded in, full out) -> DDP on 2 -> 1 process to the end. The global batch
    (64) is kept by the accumulation; every training sample is trained exactly
    once across the parts; the loss falls."""
    run_dir, log_dir = tmp_path / "run", tmp_path / "samples"
    log_dir.mkdir()
    common = [*COMMON, "model._target_=engine_tests.faults.RecordsSamples", "trainer.max_epochs=1"]
    common += ["trainer.grad_accum_steps=2", "checkpoint.keep_last=10"]
    parts = [
        ["parallel=none", "checkpoint.format=sharded", "trainer.max_steps=4"],
        [*FSDP, "trainer.max_steps=8"],
        ["parallel=none", "checkpoint.format=full", "trainer.max_steps=12"],
        ["parallel=ddp", "trainer.max_steps=16"],
        ["parallel=none", "trainer.max_steps=null"],
    ]
    outputs = [train(run_dir, *common, *part, SAMPLE_LOG=str(log_dir))[1] for part in parts]
    layouts = {
        step: json.loads(
            (run_dir / "checkpoints" / folder.checkpoint_name(step) / fmt.MANIFEST).read_text()
        )
        for step in (4, 8, 12, 16, 23)
    }
    assert [(m["layout"], m["world_size"], m["grad_accum_steps"]) for m in layouts.values()] == [
        ("sharded", 1, 2),
        ("sharded", 2, 1),
        ("full", 1, 2),
        ("full", 2, 1),
        ("full", 1, 2),
    ]
    assert "gradient accumulation 1 (trainer.grad_accum_steps=2) keeps" in outputs[1]
    assert "resumed from" in outputs[
        4
    ] and "samples of this epoch are trained a second" not in "".join(outputs)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 23 and summary["world_size"] == 1

    seen = Counter(line for f in log_dir.iterdir() for line in f.read_text().split())
    train_set = digits(batch_size=32, seed=42, val_fraction=0.1809).train.dataset.tensors[0]
    expected = Counter(sample_hash(row) for row in train_set)
    assert sum(expected.values()) == 1472
    assert seen == expected  # every sample once: none skipped, none repeated
    losses = train_losses(run_dir)
    assert len(losses) >= 10 and losses[-1] < losses[0] - 0.3, losses


def forge(ckpt: Path, name: str, data: bytes) -> None:
    """Put ``data`` at ``name`` in a checkpoint and a matching entry in its manifest."""
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / fmt.MANIFEST).read_text())
    manifest["files"][name] = fmt.file_entry(data)  # a forged entry that matches
    (ckpt / fmt.MANIFEST).write_text(json.dumps(manifest))


class Payload:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.multiprocess
def test_sharded_fsdp_checkpoints_hold_no_pickle_export_and_refuse_tampering(tmp_path):
    run_dir = tmp_path / "run"
    args = [*COMMON, "trainer.max_steps=15", "checkpoint.every_n_steps=5"]
    train(run_dir, *args, *FSDP, "checkpoint.async_save=true", "checkpoint.keep_last=3")
    ckpts = folder.committed_checkpoints(run_dir / "checkpoints")
    assert [c.name for c in ckpts] == ["step_0000005", "step_0000010", "step_0000015"]

    # No pickle: safetensors (JSON headers), JSON, and weights-only torch zips only.
    for ckpt in ckpts:
        manifest = json.loads((ckpt / fmt.MANIFEST).read_text())
        assert manifest["layout"] == "sharded" and manifest["world_size"] == 2
        shards = sorted(n for n in manifest["files"] if "/" in n)
        assert shards == [
            f"{d}/shard-0000{r}-model-00001-of-00001.safetensors"
            for d in ("model", "optimizer")
            for r in (1, 2)
        ]
        for path in ckpt.rglob("*"):
            if path.is_dir():
                continue
            assert path.name != ".metadata" and path.read_bytes()[:1] != b"\x80", path
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as f:
                    assert f.keys()
            elif path.suffix == ".json":
                json.loads(path.read_text())
            else:
                assert path.suffix == ".pt" and zipfile.is_zipfile(path), path
                torch.load(path, weights_only=True)

    # verify and export understand sharded checkpoints; the export is the full model
    assert checkpoint_cli(["verify", str(run_dir)]) == 0
    out = tmp_path / "export.safetensors"
    assert checkpoint_cli(["export", str(run_dir), "-o", str(out)]) == 0
    exported, final = load_file(out), load_file(run_dir / "model.safetensors")
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    best = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    assert checkpoint_cli(["export", str(run_dir), "--best", "-o", str(out)]) == 0
    assert best["path"] in {c.name for c in ckpts}

    # A DCP pickle beside the shards, even with a forged manifest entry, is refused.
    copy = tmp_path / "copy" / "step_0000005"
    copy.parent.mkdir()
    subprocess.run(["cp", "-r", str(ckpts[0]), str(copy)], check=True)
    (copy / "model" / ".metadata").write_bytes(pickle.dumps({"x": 1}))
    assert "files not in the manifest: model/.metadata" in fmt.verify_checkpoint(copy)
    forge(copy, "model/.metadata", pickle.dumps({"x": 1}))
    assert "bad file name 'model/.metadata'" in fmt.verify_checkpoint(copy)

    # Newest: one flipped byte in a shard; next: a pickle in a shard's place with
    # a forged manifest entry. Both skipped (named), the oldest resumed, on 1 process.
    shard = ckpts[2] / "model" / "shard-00002-model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "shard-00002-model-00001-of-00001.safetensors: xxh3_128 does not match" in (
        fmt.verify_checkpoint(ckpts[2])
    )
    marker = tmp_path / "payload-ran"
    forge(
        ckpts[1],
        "model/shard-00001-model-00001-of-00001.safetensors",
        pickle.dumps(Payload(marker)),
    )
    _, out = train(run_dir, *args, "parallel=none", "trainer.max_steps=20")
    assert f"skipping checkpoint {ckpts[2]}: {shard}: xxh3_128 does not match" in out
    assert f"skipping checkpoint {ckpts[1]}:" in out and "not a safetensors file" in out
    assert f"resumed from {ckpts[0]}: step 5" in out
    assert not marker.exists()  # nothing was unpickled
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 20
