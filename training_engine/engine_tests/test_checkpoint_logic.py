"""The checkpoints' pure logic, in-process (milliseconds): manifest and
verification, path resolution, pruning rules, the config compatibility check,
the planned saves preflight counts, and the stop decision. The real-process
tests (signals, SIGKILL, disks, DDP) are in test_checkpoint.py."""

import io
import json
from pathlib import Path

import pytest
import torch
import xxhash
from accelerate import Accelerator
from safetensors.torch import save

from training_engine.agreement import StepAgreement
from training_engine.checkpoint import CheckpointManager, folder, plan_resume
from training_engine.checkpoint import format as fmt
from training_engine.checkpoint import save as protocol
from training_engine.config import (
    ALLOWED_CONFIG_CHANGES,
    allowed_config_changes,
    config_differences,
)
from training_engine.metrics import MetricBook, WindowMeans
from training_engine.nonfinite import LossGuard, NonFiniteLoss
from training_engine.preemption import StopSignals, TrainingInterrupted
from training_engine.state import TrainState, rng_state


def torch_file(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def adamw(values: torch.Tensor) -> torch.optim.AdamW:
    """An AdamW over one weight of ``values``, one step taken (its state filled)."""
    weight = torch.nn.Parameter(values)
    optimizer = torch.optim.AdamW([weight])
    weight.grad = torch.ones_like(values)
    optimizer.step()
    return optimizer


def contents(step: int) -> dict[str, bytes]:
    """Files every reader takes as valid (format.check_content, checkpoint/judge.py):
    JSON that holds what it must, a safetensors file, and torch files of the states a
    run writes (an optimizer's of the one weight, a scheduler's, an RNG state)."""
    optimizer = adamw(torch.full((2,), float(step)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    files = {
        "optimizer.pt": torch_file(optimizer.state_dict()),
        "scheduler.pt": torch_file(scheduler.state_dict()),
        fmt.rng_file(0): torch_file(rng_state()),
    }
    state = {"step": step, "epoch": 0, "batch": step, "stateful": {}}
    files["trainer_state.json"] = json.dumps(state).encode()
    files["config.json"] = json.dumps({"seed": step}).encode()
    files["model.safetensors"] = save({"w": torch.full((2,), float(step))})
    return files


def fake_checkpoint(root: Path, step: int, files: dict[str, bytes] | None = None) -> Path:
    """A committed checkpoint folder with a valid manifest over ``files``."""
    files = files or contents(step)
    tmp = root / f"{folder.checkpoint_name(step)}.tmp"
    tmp.mkdir(parents=True)
    entries = {}
    for name, data in files.items():
        (tmp / name).write_bytes(data)
        entries[name] = {"sha256": fmt.sha256(data), "size": len(data)}
    final = root / folder.checkpoint_name(step)
    protocol.commit(tmp, final, {"step": step, "epoch": 0}, entries)
    return final


def test_manifest_commit_and_verify(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 7)
    assert not (tmp_path / "step_0000007.tmp").exists()
    manifest = fmt.read_manifest(ckpt)
    assert manifest["step"] == 7 and set(manifest["files"]) == set(fmt.REQUIRED_FILES)
    assert fmt.verify_checkpoint(ckpt) is None
    (ckpt / "optimizer.pt").write_bytes(b"short")
    assert "optimizer.pt: 5 bytes, the manifest says" in fmt.verify_checkpoint(ckpt)
    (ckpt / "extra.bin").write_bytes(b"")
    assert "files not in the manifest: extra.bin" in fmt.verify_checkpoint(ckpt)
    other = fake_checkpoint(tmp_path, 8)
    data = bytearray((other / "scheduler.pt").read_bytes())
    data[0] ^= 1
    (other / "scheduler.pt").write_bytes(bytes(data))
    assert "sha256 does not match" in fmt.verify_checkpoint(other)
    (other / fmt.MANIFEST).unlink()
    assert "missing (an incomplete checkpoint)" in fmt.verify_checkpoint(other)


def test_xxh3_manifests_verify_catch_a_flipped_byte_and_sha256_ones_still_load(tmp_path):
    weight = torch.arange(1000, dtype=torch.float32)
    state = adamw(weight).state_dict()
    files = contents(3)
    files["model.safetensors"] = save({"w": weight})  # the state's shapes are the model's
    files["optimizer.pt"] = bytes(protocol.torch_bytes(state))
    new = fake_checkpoint(tmp_path / "new", 3, files)
    entries = {n: fmt.file_entry(d) for n, d in files.items()}  # the current hash
    manifest = json.loads((new / fmt.MANIFEST).read_text())
    (new / fmt.MANIFEST).write_text(json.dumps({**manifest, "files": entries}))
    assert entries["optimizer.pt"] == {
        "xxh3_128": xxhash.xxh3_128(files["optimizer.pt"]).hexdigest(),
        "size": len(files["optimizer.pt"]),
    }
    old = fake_checkpoint(tmp_path / "old", 3, files)  # sha256 entries, as before issue 18
    assert "sha256" in fmt.read_manifest(old)["files"]["optimizer.pt"]
    for ckpt in (new, old):  # read once, hashed and parsed from the same bytes
        assert fmt.verify_checkpoint(ckpt) is None
        loaded = fmt.verify_files(ckpt, ["optimizer.pt", "trainer_state.json"], fmt.parse_file)
        saved, read = state["state"][0], loaded["optimizer.pt"]["state"][0]
        assert torch.equal(read["exp_avg"], saved["exp_avg"])
        assert loaded["trainer_state.json"] == json.loads(files["trainer_state.json"])
    for ckpt, algorithm in ((new, "xxh3_128"), (old, "sha256")):
        data = bytearray((ckpt / "optimizer.pt").read_bytes())
        data[len(data) // 2] ^= 0x04  # one bit of one tensor value
        (ckpt / "optimizer.pt").write_bytes(bytes(data))
        message = f"{ckpt / 'optimizer.pt'}: {algorithm} does not match the manifest"
        assert message in fmt.verify_checkpoint(ckpt)
        with pytest.raises(fmt.CheckpointError, match=algorithm):
            fmt.verify_files(ckpt, ["optimizer.pt"], fmt.parse_file)
    entries["scheduler.pt"] = {"md5": "00", "size": 1}
    (new / fmt.MANIFEST).write_text(json.dumps({**manifest, "files": entries}))
    with pytest.raises(fmt.CheckpointError, match="one checksum of xxh3_128, sha256"):
        fmt.read_manifest(new)


def test_find_checkpoints_names_one_or_all(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    ckpts = [fake_checkpoint(root, s) for s in (14, 7)]
    (root / "step_0000021.tmp").mkdir()  # an interrupted save: never a candidate
    assert folder.find_checkpoints(tmp_path / "run") == [ckpts[1], ckpts[0]]
    assert folder.find_checkpoints(root) == [ckpts[1], ckpts[0]]
    assert folder.find_checkpoints(ckpts[0]) == [ckpts[0]]
    with pytest.raises(fmt.CheckpointError, match="no such file or directory"):
        folder.find_checkpoints(tmp_path / "nowhere")
    with pytest.raises(fmt.CheckpointError, match="an unfinished save"):
        folder.find_checkpoints(root / "step_0000021.tmp")


def test_pruning_keeps_the_newest_and_the_best(tmp_path):
    ckpts = [tmp_path / folder.checkpoint_name(s) for s in (7, 10, 14, 20, 21)]
    names = lambda paths: [p.name for p in paths]  # noqa: E731
    assert names(folder.to_prune(ckpts, 3, None)) == ["step_0000007", "step_0000010"]
    assert names(folder.to_prune(ckpts, 3, 10)) == ["step_0000007"]
    assert names(folder.to_prune(ckpts, 1, None)) == names(ckpts[:3])  # never below 2
    assert folder.to_prune(ckpts[:1], 1, None) == []  # never the newest
    root = tmp_path / "real"
    for step in (7, 10, 14):
        fake_checkpoint(root, step)
    protocol.prune(root, 14, keep_last=2, best_step=None)
    protocol.threads("io").submit(lambda: None).result()  # deletions run in the io pool
    assert names(folder.committed_checkpoints(root)) == ["step_0000010", "step_0000014"]


def test_config_differences_allow_only_the_listed_keys():
    saved = {"seed": 1, "model": {"width": 8}, "trainer": {"max_steps": 10}, "tracker": {}}
    current = {
        "seed": 2,
        "model": {"width": 8},
        "trainer": {"max_steps": 20},
        "tracker": {"csv": {}},
    }
    assert config_differences(saved, current) == ["seed: 1 -> 2"]
    assert config_differences(saved, {**current, "seed": 1}) == []
    assert config_differences({"a": 1}, {}) == ["a: 1 -> '<absent>'"]
    # a key declared null since (model.peft) is no change; set to a value, it is one
    assert config_differences({"model": {}}, {"model": {"peft": None}}) == []
    assert config_differences({"model": {}}, {"model": {"peft": "lora"}}) == [
        "model.peft: '<absent>' -> 'lora'"
    ]
    # The example data declares its harmless arguments; the infrastructure names none.
    assert not any(key.startswith(("data.", "model.")) for key in ALLOWED_CONFIG_CHANGES)
    config = {"data": {"_target_": "digit_trainer.data.digits.digits"}}
    allowed = allowed_config_changes(config)
    assert {"data.num_workers", "data.pin_memory", "data.val_batch_size"} <= set(allowed)
    old = {"data": {"num_workers": 0, "batch_size": 32}}
    new = {"data": {"num_workers": 2, "batch_size": 64}}
    assert config_differences(old, new, allowed) == ["data.batch_size: 32 -> 64"]


def manager(tmp_path: Path, batches: int = 10, **checkpoint) -> CheckpointManager:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = TrainState(model, optimizer, scheduler, train_loader=[None] * batches, val_loader=[])
    return CheckpointManager(
        # the keys not given are the schema's defaults; no best rule unless given
        checkpoint={"enabled": True, "save_best": {"enabled": False}, **checkpoint},
        config={"seed": 0},
        run_dir=tmp_path,
        accelerator=Accelerator(cpu=True),
        state=state,
        book=MetricBook("val/acc", "max"),
    )


def test_explicit_path_without_a_valid_checkpoint_fails(tmp_path):
    """(Was a train.py run: exit code 1 comes from CheckpointError.exit_code, and
    train.py turns every CheckpointError into it without a traceback, as the
    resume=never case of test_checkpoint.py shows with a real process.)"""
    empty = tmp_path / "empty"
    empty.mkdir()
    run = tmp_path / "run"
    with pytest.raises(fmt.CheckpointError) as err:
        plan_resume(
            {"enabled": True, "resume": str(empty)},
            config={"seed": 0},
            run_dir=run,
            accelerator=Accelerator(cpu=True),
            configured=1,
        )
    assert err.value.exit_code == 1
    assert f"checkpoint.resume={empty}: no valid checkpoint" in str(err.value)
    assert "not starting over silently" in str(err.value)
    assert not (run / "checkpoints").exists()


def test_one_resume_plan_names_the_checkpoint_accumulation_and_run_ids(tmp_path):
    """The plan takes the newest checkpoint that verifies (a damaged newer one is
    skipped, named), keeps its global batch by the accumulation, and carries its
    trainer state; the manager restores exactly that one."""
    saver = manager(tmp_path, every_n_steps=None)
    for step in (2, 4, 6):
        saver.state.advance(epoch=0, batch=step)
        saver.save(step, 0, step, ["test"])
    ckpts = tmp_path / "checkpoints"
    newest = ckpts / "step_0000006"
    (newest / "model.safetensors").write_bytes(b"damaged")
    manifest = json.loads((ckpts / "step_0000004" / fmt.MANIFEST).read_text())
    manifest |= {"world_size": 4, "grad_accum_steps": 2}  # saved by 4 processes x 2
    (ckpts / "step_0000004" / fmt.MANIFEST).write_text(json.dumps(manifest))
    accelerator = Accelerator(cpu=True)

    enabled = {"enabled": True}
    plan = plan_resume(
        enabled, config={"seed": 0}, run_dir=tmp_path, accelerator=accelerator, configured=1
    )
    assert plan.checkpoint == ckpts / "step_0000004" and plan.step == 4
    assert plan.grad_accum == 8 == accelerator.gradient_accumulation_steps  # 4 x 2 on 1
    assert len(plan.skipped) == 1 and "model.safetensors" in plan.skipped[0]
    assert plan.tracker_run_ids == {} and plan.trainer["batch"] == 4
    restorer = manager(tmp_path / "again", every_n_steps=None)
    assert restorer.restore(plan).step == 4 and restorer.state.position.step == 4
    assert restorer.resumed_from == str(plan.checkpoint)

    fresh = plan_resume(
        {"enabled": True, "resume": "never"},
        config={"seed": 0},
        run_dir=tmp_path / "new",
        accelerator=accelerator,
        configured=3,
    )
    assert fresh.checkpoint is None and fresh.grad_accum == 3 and fresh.step == 0
    with pytest.raises(fmt.CheckpointError, match="already holds checkpoints"):
        plan_resume(
            {"enabled": True, "resume": "never"},
            config={"seed": 0},
            run_dir=tmp_path,
            accelerator=accelerator,
            configured=1,
        )


def test_planned_saves_and_checkpoints_on_disk(tmp_path):
    ckpt = manager(tmp_path, every_n_steps=7, save_best={"enabled": True}, keep_last=1)
    evals = {10, 20, 30}
    assert ckpt.planned_saves(30, 0, steps_per_epoch=10, evaluations=evals) == {
        7,
        14,
        21,
        28,
        10,
        20,
        30,
    }
    assert ckpt.planned_saves(30, 14, steps_per_epoch=10, evaluations={20, 30}) == {21, 28, 20, 30}
    assert ckpt.planned_saves(30, 30, steps_per_epoch=10, evaluations=set()) == set()
    assert ckpt.kept_on_disk() == (4, "keep_last 2 + best + 1 in flight")  # keep_last >= 2
    epochs = manager(tmp_path, every_n_steps=None, every_n_epochs=2, save_last=False)
    assert epochs.planned_saves(50, 0, steps_per_epoch=10, evaluations={50}) == {20, 40}
    assert epochs.kept_on_disk() == (4, "keep_last 3 + 1 in flight")


def test_best_rule_asks_the_metric_book(tmp_path):
    ckpt = manager(
        tmp_path,
        every_n_steps=None,
        save_best={"enabled": True, "monitor": "val/acc", "mode": "max"},
    )

    def at(step: int, logged: dict, stop: bool = False):  # the loop: log, then maybe save
        ckpt.state.advance(epoch=0, batch=step)
        ckpt.book.update(logged, step)
        return ckpt.maybe_save(metrics=ckpt.book.last, stop=stop)

    assert at(1, {"train/loss": 1.0}) is None
    saved = at(2, {"val/acc": 0.5})
    assert saved == tmp_path / "checkpoints" / "step_0000002"
    assert json.loads((saved / fmt.MANIFEST).read_text())["reasons"] == ["best"]
    assert at(3, {"val/acc": 0.4}) is None
    assert at(4, {"val/acc": float("nan")}) is None
    stopped = at(5, {}, stop=True)
    assert json.loads((stopped / fmt.MANIFEST).read_text())["reasons"] == ["signal"]
    best = json.loads((tmp_path / "checkpoints" / "best.json").read_text())
    assert best == {"step": 2, "path": "step_0000002", "monitor": "val/acc", "value": 0.5}


def agreement(on_nan: str = "stop", signals: bool = False, every: int = 5) -> StepAgreement:
    """The loop's agreement (agreement.py) on one process: the same answers, no collective."""
    accelerator = Accelerator(cpu=True)
    return StepAgreement(
        accelerator=accelerator,
        guard=LossGuard(on_nan, accelerator),
        signals=StopSignals(enabled=signals),
        every_n_steps=every,
    )


def test_a_stop_signal_is_acted_on_at_the_next_step_and_by_finish():
    import signal

    agreed = agreement(signals=True, every=1)
    assert agreed.at_step(1) is False
    signal.raise_signal(signal.SIGUSR1)
    assert agreed.at_step(2) is True and agreed.signals.seen
    with pytest.raises(TrainingInterrupted) as err:
        agreed.signals.finish(stopped=True, saved=Path("/x/step_0000002"))
    assert err.value.exit_code == 138 and "checkpoint saved at /x/step_0000002" in str(err.value)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the old handler is back
    assert agreement(signals=False, every=1).at_step(1) is False


def test_the_log_windows_sums_ride_in_the_agreement_only_when_it_is_due():
    """At a log step the window's sums go in the agreement's collective (one, not two);
    between log steps nothing is carried, so WindowMeans reduces on its own."""
    agreed, sums = agreement(every=5), torch.tensor([2.0, 4.0])
    assert agreed.at_step(4, carry=sums) is False and agreed.carried is None
    assert agreed.at_step(5, carry=sums) is False
    assert torch.equal(agreed.carried, sums)
    agreed.at_step(6)
    assert agreed.carried is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_the_log_window_sums_each_value_cast_to_float32_in_order(dtype):
    """WindowMeans adds each micro-batch's loss and logs (tensors of any shape of one
    value, Python numbers) in place: its sums are, bit for bit, those of casting each
    value to float32 and adding them in order, so a resumed window (its sums from the
    checkpoint) logs what an uninterrupted one does; its means are over the count."""
    accelerator = Accelerator(cpu=True)
    window, generator = WindowMeans(accelerator), torch.Generator().manual_seed(0)
    expected = torch.zeros(4)
    for i in range(500):
        loss = (torch.rand((), generator=generator) * 10).to(dtype)
        logs = {"acc": torch.rand((1,), generator=generator).to(dtype), "n": 7, "f": 0.1 * i}
        window.add(loss, logs)
        row = [loss, logs["acc"].reshape(()), torch.tensor(7.0), torch.tensor(0.1 * i)]
        expected += torch.stack([v.float() for v in row])
    assert torch.equal(window.sums, expected)
    state = window.state_dict()
    resumed = WindowMeans(accelerator)
    resumed.load_state_dict(state)
    for w in (window, resumed):
        w.add(torch.tensor(1.0), {"acc": 1.0, "n": 1, "f": 1.0})
    assert torch.equal(window.sums, resumed.sums)
    means = window.means()
    assert means["train/n"] == (500 * 7 + 1) / 501 and window.sums is None
    with pytest.raises(ValueError, match="the task's logs changed"):
        window.add(torch.tensor(1.0), {"acc": 1.0})


@pytest.mark.parametrize("fold_at", [1024, 4, 1])
@pytest.mark.parametrize(("accum", "bad_micro"), [(1, 6), (3, 6), (3, 14), (2, 19), (2, None)])
def test_loss_guard_names_the_first_bad_step(accum, bad_micro, fold_at):
    """on_nan=stop, as the loop drives it: agreed at steps 5 and 10 (log steps),
    folded every `fold_at` micro-batches: the error names the optimizer step of
    the first non-finite micro-batch loss, at the first check after it."""
    agreed = agreement("stop")
    agreed.guard.FOLD_AT = fold_at
    expected = None if bad_micro is None else bad_micro // accum + 1
    micro, raised_at = 0, None
    for step in range(1, 11):
        for _ in range(accum):
            agreed.guard.observe(torch.tensor(float("nan") if micro == bad_micro else 0.5))
            micro += 1
        assert agreed.on_update()  # stop mode never drops an update
        try:
            agreed.at_step(step)  # a check only at the log steps (every 5)
        except NonFiniteLoss as err:
            assert f"not finite (NaN/inf) at step {expected};" in str(err)
            raised_at = step
            break
    assert raised_at == (None if expected is None else 5 * -(-expected // 5))


def test_loss_guard_skip_mode_drops_exactly_the_bad_steps():
    agreed = agreement("skip")
    decisions = []
    for micro_losses in ([1.0, 1.0], [1.0, float("inf")], [float("nan"), 1.0], [2.0, 2.0]):
        for loss in micro_losses:
            agreed.guard.observe(torch.tensor(loss))
        decisions.append(agreed.on_update())
    assert decisions == [True, False, False, True] and agreed.guard.skipped == 2
    agreed.at_step(4, final=True)  # skip mode: a check never raises


def test_streamed_safetensors_read_back_by_safetensors_bit_for_bit(tmp_path):
    """The model file's own writer (no in-memory copy of the file) against the
    safetensors reader: every dtype the table names, a 0-d, an empty and a tied
    tensor, the metadata, and the bytes of safetensors' own writer's tensors."""
    from safetensors import safe_open
    from safetensors.torch import load as load_bytes
    from safetensors.torch import save as save_bytes

    weight = torch.randn(3, 5)
    state = {f"t_{str(d)[6:]}": (torch.randn(4, 3) * 50).to(d) for d in protocol.SAFETENSORS_DTYPES}
    state |= {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 7), "w": weight, "tied": weight}
    path = tmp_path / "model.safetensors"
    with path.open("wb") as out:
        protocol.write_safetensors(out, protocol.unshared(state), {"step": "7"})
    back = load_bytes(path.read_bytes())
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"step": "7"}
    theirs = load_bytes(save_bytes(protocol.unshared(state)))
    assert all(torch.equal(theirs[k], back[k]) for k in state)
    with pytest.raises(fmt.CheckpointError, match="complex64"):
        protocol.write_safetensors(tmp_path / "x", {"c": torch.zeros(2, dtype=torch.complex64)}, {})


def test_checkpoint_differences_name_the_step_and_file_whose_content_differs(tmp_path):
    from training_engine.testing import checkpoint_differences

    def run(root: Path, weight: float, seconds: float) -> Path:
        for step in ("step_0000010", "step_0000020"):
            ckpt = root / "checkpoints" / step
            ckpt.mkdir(parents=True)
            w = torch.full((3,), weight if step == "step_0000020" else 1.0)
            (ckpt / "model.safetensors").write_bytes(save({"w": w}))
            (ckpt / "optimizer.pt").write_bytes(torch_file({"state": {0: {"m": w * 0}}}))
            state = {"step": int(step[5:]), "timers": {"train_s": seconds}, "perf/x": seconds}
            (ckpt / "trainer_state.json").write_text(json.dumps(state))
            (ckpt / "MANIFEST.json").write_text(json.dumps({"created": str(seconds)}))
        return root

    a, b = run(tmp_path / "a", 2.0, 1.0), run(tmp_path / "b", 2.0, 9.0)  # times only
    assert checkpoint_differences(a, b) == "step_0000010: the same; step_0000020: the same"
    c = run(tmp_path / "c", 2.0 + 2**-20, 1.0)  # one weight, one bit apart
    assert checkpoint_differences(a, c) == (
        "step_0000010: the same; step_0000020: differs in model.safetensors"
    )
