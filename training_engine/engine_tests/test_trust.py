"""The trust boundary (docs/trust.md): a hostile or malformed run dir can make the
project run no code, read nothing outside the run dir and crash nowhere. Each case
is a real run whose newest checkpoint an attacker rewrote, manifest entries forged
to match, against resume, eval.py, predict.py, load_model and the checkpoint CLI."""

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file, save

from training_engine import trust
from training_engine.checkpoint.__main__ import main as checkpoint_cli
from training_engine.config import ConfigError
from training_engine.inference import load_checkpoint, load_model
from training_engine.predictor import load_predictor

from .conftest import ENV, FAST, ONE_PROCESS, PROJECT_ROOT, run_train
from .test_lifecycle import run_script

# 30 steps, a checkpoint (and an evaluation) every 10: step_10, step_20, step_30.
BASE = [*FAST, "checkpoint.every_n_steps=10"]
NEWEST, PREVIOUS = "step_0000030", "step_0000020"
MIB = 2**20


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return run_train(tmp_path_factory.mktemp("trust") / "run", *BASE).run_dir


def forge(ckpt: Path, name: str, data: bytes | None = None) -> None:
    """Rewrite a file (None: keep it) and give the manifest a matching entry, as an
    attacker who can write files can: checksums alone prove nothing about intent."""
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    path = ckpt / name
    if data is not None:
        path.unlink(missing_ok=True)
        path.write_bytes(data)
    content = path.read_bytes() if path.is_file() else b""
    manifest["files"][name] = {"xxh3_128": xxhash.xxh3_128_hexdigest(content), "size": len(content)}
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))


def config_with_payload(ckpt: Path, marker: Path) -> None:
    """config.json's model: a call that writes ``marker`` when built (Hydra's own
    blocklist stops os.system, not pathlib)."""
    config = json.loads((ckpt / "config.json").read_text())
    config["model"] = {
        "_target_": "pathlib.Path.write_text",
        "self": {"_target_": "pathlib.Path", "_args_": [str(marker)]},
        "data": "owned",
    }
    forge(ckpt, "config.json", json.dumps(config).encode())


def symlink_inside(ckpt: Path, _: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    os.symlink("optimizer.pt", ckpt / "model.safetensors")
    forge(ckpt, "model.safetensors")


def symlink_outside(ckpt: Path, marker: Path) -> None:
    """A FIFO outside the run: anything that opened it to read would hang here."""
    fifo = marker.with_name("outside.fifo")
    os.mkfifo(fifo)
    (ckpt / "model.safetensors").unlink()
    os.symlink(fifo, ckpt / "model.safetensors")
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    manifest["files"]["model.safetensors"] = {"xxh3_128": xxhash.xxh3_128_hexdigest(b""), "size": 0}
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))


def names_outside(ckpt: Path, _: Path) -> None:
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    entry = manifest["files"]["config.json"]
    manifest["files"]["../../config.json"] = entry
    manifest["files"]["/etc/passwd"] = entry
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))


def deep_manifest(ckpt: Path, _: Path) -> None:
    (ckpt / "MANIFEST.json").write_text("[" * 200_000 + "]" * 200_000)


def deep_trainer_state(ckpt: Path, _: Path) -> None:
    forge(ckpt, "trainer_state.json", b'{"a":' * 200_000 + b"1" + b"}" * 200_000)


def trainer_state_without_keys(ckpt: Path, _: Path) -> None:
    forge(ckpt, "trainer_state.json", json.dumps({"step": 30}).encode())


def absurd_step(ckpt: Path, _: Path) -> None:
    state = json.loads((ckpt / "trainer_state.json").read_text())
    forge(ckpt, "trainer_state.json", json.dumps({**state, "step": 10**18}).encode())


def step_not_the_manifests(ckpt: Path, _: Path) -> None:
    state = json.loads((ckpt / "trainer_state.json").read_text())
    forge(ckpt, "trainer_state.json", json.dumps({**state, "step": 29}).encode())


def huge_safetensors_header(ckpt: Path, _: Path) -> None:
    forge(ckpt, "model.safetensors", (2**62).to_bytes(8, "little") + b"{}" + b" " * 62)


def position(ckpt: Path, **fields: int) -> None:
    """trainer_state.json and the manifest given the same forged position, every
    checksum rewritten: only what they hold, judged against the run, can refuse it."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    forge(ckpt, "trainer_state.json", json.dumps({**state, **fields}).encode())
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    (ckpt / "MANIFEST.json").write_text(json.dumps({**manifest, **fields}))


def torch_file(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def oversized_rng_tensor(ckpt: Path, _: Path) -> None:
    """8 MiB on disk where the CPU generator's state is 5 kB."""
    rng = torch.load(ckpt / "rng_rank0.pt", weights_only=True)
    forge(
        ckpt, "rng_rank0.pt", torch_file({**rng, "torch": torch.zeros(8 * MIB, dtype=torch.uint8)})
    )


def inflating_rng_tensor(ckpt: Path, _: Path) -> None:
    """A few hundred kB on disk that torch.load would inflate to 256 MiB: the record of
    a 256 MiB tensor, deflated (torch.save writes none so; a zip may)."""
    small = zipfile.ZipFile(io.BytesIO(torch_file({"torch": torch.zeros(8, dtype=torch.uint8)})))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as forged:
        for info in small.infolist():
            data = small.read(info.filename)
            if info.filename.endswith("data.pkl"):  # the storage's and the tensor's size: 256 MiB
                data = data.replace(b"K\x08", b"J" + (256 * MIB).to_bytes(4, "little"))
            if info.filename.endswith("/data/0"):
                record = zipfile.ZipInfo(info.filename)
                record.compress_type = zipfile.ZIP_DEFLATED
                with forged.open(record, "w", force_zip64=True) as f:
                    for _ in range(256):
                        f.write(bytes(MIB))
                continue
            forged.writestr(info.filename, data)
    forge(ckpt, "rng_rank0.pt", out.getvalue())


def optimizer_of_other_shapes(ckpt: Path, _: Path) -> None:
    """AdamW's moments of the first matrix one row longer: load_state_dict takes them;
    the first step after the resume would fail on them."""
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    moments = next(m for m in state["state"].values() if m["exp_avg"].ndim == 2)
    rows, cols = moments["exp_avg"].shape
    moments["exp_avg"] = torch.zeros(rows + 1, cols)
    moments["exp_avg_sq"] = torch.zeros(rows + 1, cols)
    forge(ckpt, "optimizer.pt", torch_file(state))


def model_with_an_extra_key(ckpt: Path, _: Path) -> None:
    weights = load_file(ckpt / "model.safetensors")
    forge(ckpt, "model.safetensors", save({**weights, "extra.weight": torch.zeros(2)}))


def model_without_a_key(ckpt: Path, _: Path) -> None:
    weights = load_file(ckpt / "model.safetensors")
    forge(ckpt, "model.safetensors", save(dict(list(weights.items())[1:])))


# case -> (how the newest checkpoint is rewritten, what the readers say of it)
CASES = {
    "config target": (config_with_payload, "does not trust"),
    "symlink inside": (symlink_inside, "a symlink"),
    "symlink outside": (symlink_outside, "a symlink"),
    "names outside": (names_outside, "bad file name"),
    "deep manifest": (deep_manifest, "nested more than 64 deep"),
    "deep trainer_state": (deep_trainer_state, "nested more than 64 deep"),
    "trainer_state without keys": (trainer_state_without_keys, "epoch is not an integer"),
    "huge safetensors header": (huge_safetensors_header, "not a safetensors file"),
    "absurd step": (absurd_step, "step is not an integer in [0, 2**53)"),
    "step not the manifest's": (step_not_the_manifests, "its step 29 is not the manifest's 30"),
    # the forged position in the manifest too (issue 38): judged against the run
    "absurd epoch": (lambda c, _: position(c, epoch=10**6), "its epoch 1000000 is past its run's"),
    "negative epoch": (lambda c, _: position(c, epoch=-1), "epoch is not an integer in [0"),
    "absurd batch": (lambda c, _: position(c, batch=10**6), "its batch 1000000 is past its epoch"),
    "step past the run": (
        lambda c, _: position(c, step=10**6),
        "its step 1000000 is past its run's length (trainer.max_steps=30)",
    ),
    "oversized rng tensor": (oversized_rng_tensor, "more than a checkpoint of this model can hold"),
    "inflating rng tensor": (inflating_rng_tensor, "is compressed or larger than the file"),
    "optimizer of other shapes": (optimizer_of_other_shapes, "the shape of no parameter of it"),
    "model with an extra key": (model_with_an_extra_key, "has extra.weight, which this model does"),
    "model without a key": (model_without_a_key, "its weights do not fit this model: lacks "),
}
# What a reader may take beyond the baseline's peak memory: the newest checkpoint's real
# size and this (the forged files are read, if at all, as their size on disk allows)
RSS_SLACK = 64 * MIB
FORGED_CONTENT = list(CASES)[list(CASES).index("absurd epoch") :]


def peak_rss(cmd: list[str]) -> tuple[int, str, int]:
    """(exit code, output, peak resident memory in bytes) of a command of the project."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=ENV, stdout=out, stderr=out)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        return proc.returncode, out.read().decode(errors="replace"), usage.ru_maxrss * 1024


def eval_cmd(run: Path, out: Path) -> list[str]:
    command = [sys.executable, "eval.py", f"hydra.run.dir={out}", ONE_PROCESS]
    return [*command, f"ckpt={run}", "ckpt_pick=latest"]


@pytest.fixture(scope="module")
def baseline_rss(base, tmp_path_factory):
    """eval.py's and a resume's peak memory on the untouched run."""
    out = tmp_path_factory.mktemp("baseline")
    code, said, evaluated = peak_rss(eval_cmd(base, out / "eval"))
    assert code == 0, said[-3000:]
    run = out / "run"
    shutil.copytree(base, run)
    code, said, resumed = peak_rss(train_cmd(run, "trainer.max_steps=40"))
    assert code == 0, said[-3000:]
    return {"eval": evaluated, "resume": resumed}


def train_cmd(run: Path, *extra: str) -> list[str]:
    return [sys.executable, "train.py", f"hydra.run.dir={run}", ONE_PROCESS, *BASE, *extra]


def real_size(ckpt: Path) -> int:
    return sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_checkpoint_is_refused_or_skipped_everywhere(
    base, baseline_rss, tmp_path, case, capsys
):
    rewrite, problem = CASES[case]
    marker = tmp_path / "PAYLOAD_RAN"
    run = tmp_path / "run"
    shutil.copytree(base, run)
    rewrite(run / "checkpoints" / NEWEST, marker)
    refused = case == "config target"  # a checkpoint that verifies but names code: exit 2

    # eval.py: the newest checkpoint is refused (exit 2) or skipped for the previous one,
    # in no more memory than the untouched run's and the checkpoint's size on disk
    out = tmp_path / "eval"
    code, said, rss = peak_rss(eval_cmd(run, out))
    assert "Traceback" not in said and problem in said
    if case in FORGED_CONTENT:
        bound = baseline_rss["eval"] + real_size(run / "checkpoints" / NEWEST) + RSS_SLACK
        assert rss <= bound, (rss, baseline_rss["eval"])
    if refused:
        assert code == 2 and "pathlib.Path.write_text" in said
        assert "trusted_targets" in said and not out.exists()
    else:
        assert code == 0, said[-3000:]
        report = json.loads((out / "eval.json").read_text())
        assert Path(report["checkpoint"]).name == PREVIOUS
        assert f"skipping checkpoint {run / 'checkpoints' / NEWEST}" in said

    # load_model: the same, in-process
    if refused:
        with pytest.raises(ConfigError, match="does not trust"):
            load_model(run, pick="latest")
    else:
        model = load_model(run, pick="latest")
        expected = load_file(run / "checkpoints" / PREVIOUS / "model.safetensors")
        assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
        # predict.py's load_predictor and generate.py's load_checkpoint (the model's
        # config given): the same judgement, the previous checkpoint
        assert load_predictor(run, pick="latest").checkpoint.name == PREVIOUS
        config = json.loads((base / "config.json").read_text())
        loaded = load_checkpoint(run, "latest", model_config=config["model"])
        assert loaded.checkpoint.name == PREVIOUS

    # The CLI: verify names the problem (a forged config verifies: it is not code to it)
    code = checkpoint_cli(["verify", str(run / "checkpoints" / NEWEST)])
    printed = capsys.readouterr().out
    assert code == (0 if refused else 1) and (refused or problem in printed)
    assert checkpoint_cli(["list", str(run)]) == 0
    printed = capsys.readouterr().out
    assert (refused or "INVALID" in printed) and PREVIOUS in printed
    exported = tmp_path / "export" / "model.safetensors"
    assert checkpoint_cli(["export", str(run), "-o", str(exported)]) == 0
    source = NEWEST if refused else PREVIOUS
    assert f"{source}/model.safetensors -> {exported}" in capsys.readouterr().out
    assert not marker.exists()  # nothing was run, anywhere


@pytest.mark.parametrize(
    "case",
    ["config target", "deep trainer_state", "huge safetensors header", "absurd step"]
    + [case for case in FORGED_CONTENT if case != "negative epoch"],  # the manifest's: above
)
def test_resume_skips_a_hostile_checkpoint_of_its_own_run(base, baseline_rss, tmp_path, case):
    """Named, skipped for the previous checkpoint, in no more memory than a resume of
    the untouched run and the checkpoint's size on disk allow."""
    rewrite, problem = CASES[case]
    marker = tmp_path / "PAYLOAD_RAN"
    run = tmp_path / "run"
    shutil.copytree(base, run)
    rewrite(run / "checkpoints" / NEWEST, marker)
    size = real_size(run / "checkpoints" / NEWEST)
    code, said, rss = peak_rss(train_cmd(run, "trainer.max_steps=40"))
    assert code == 0 and "Traceback" not in said, said[-3000:]
    assert f"skipping checkpoint {run / 'checkpoints' / NEWEST}" in said
    assert problem in said or case == "config target"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == str(run / "checkpoints" / PREVIOUS)
    assert summary["step"] == 40 and not marker.exists()
    assert rss <= baseline_rss["resume"] + size + RSS_SLACK, (rss, baseline_rss["resume"])


def weights_that_do_not_fit(ckpt: Path, _: Path) -> None:
    """Valid safetensors with every checksum rewritten, but the first layer's weight
    of another shape (and one tensor more): what a forged checkpoint, or one of a model
    whose code changed since, holds."""
    weights = load_file(ckpt / "model.safetensors")
    first = next(k for k, v in weights.items() if v.ndim == 2)
    weights[first] = torch.zeros(weights[first].shape[0] + 1, weights[first].shape[1])
    weights["extra.weight"] = torch.zeros(2)
    forge(ckpt, "model.safetensors", save(weights))


def test_resume_skips_a_checkpoint_whose_weights_do_not_fit_the_model(base, tmp_path):
    """Judged by what it holds before anything is loaded: named, skipped, and the run
    resumes from the previous checkpoint (not load_state_dict's traceback mid-start)."""
    run = tmp_path / "run"
    shutil.copytree(base, run)
    weights_that_do_not_fit(run / "checkpoints" / NEWEST, tmp_path)
    longer = run_train(run, *BASE, "trainer.max_steps=40")
    assert "its weights do not fit this model" in longer.output
    assert "has extra.weight, which this model does not" in longer.output
    assert "this model's [" in longer.output and "Traceback" not in longer.output
    assert longer.summary["resumed_from"] == str(run / "checkpoints" / PREVIOUS)
    assert longer.summary["step"] == 40


def test_predict_refuses_untrusted_code_and_skips_a_symlink(base, tmp_path):
    for case in ("config target", "symlink outside"):
        run = tmp_path / case.replace(" ", "_")
        shutil.copytree(base, run)
        CASES[case][0](run / "checkpoints" / NEWEST, tmp_path / "PAYLOAD_RAN")
        out = tmp_path / f"predict_{run.name}"
        proc = run_script("predict.py", out, f"ckpt={run}", "ckpt_pick=latest", check=False)
        said = proc.stdout + proc.stderr
        assert "Traceback" not in said
        if case == "config target":
            assert proc.returncode == 2 and "does not trust" in said and not out.exists()
        else:
            assert proc.returncode == 0 and (out / "predictions.csv").is_file()
    assert not (tmp_path / "PAYLOAD_RAN").exists()


def test_a_pointer_never_leads_outside_its_folder(base, tmp_path, capsys):
    """best.json naming a valid checkpoint elsewhere: not followed; the best of the
    run's own valid checkpoints is used instead (eval.py, load_model), and
    ``export --best`` refuses."""
    run = tmp_path / "run"
    shutil.copytree(base, run)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run / "checkpoints" / PREVIOUS, elsewhere / "step_0000099")
    pointer = {"step": 99, "path": "../../elsewhere/step_0000099"}
    (run / "checkpoints" / "best.json").write_text(json.dumps(pointer))
    proc = run_script("eval.py", tmp_path / "eval", f"ckpt={run}", check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "is not the name of an entry of" in said
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert Path(report["checkpoint"]).parent == (run / "checkpoints").resolve()
    assert load_model(run) is not None
    assert checkpoint_cli(["export", str(run), "--best", "-o", str(tmp_path / "x")]) == 1
    assert "--best" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_bounded_json_and_literal_configs():
    """The readers' limits, in-process: depth is counted without recursion, strings
    with ${...} stay text through OmegaConf, targets are checked before import."""
    assert trust._depth(b'{"a": "[[[[", "b": [[1]]}') == 3  # brackets in strings do not count
    assert trust._depth(b"[" * 100_000) > trust.MAX_JSON_DEPTH
    from omegaconf import OmegaConf

    hostile = {"path": "${oc.env:HOME}", "x": "a\\${b}", "plain": "C:\\data"}
    assert OmegaConf.to_container(OmegaConf.create(trust.literal(hostile)), resolve=True) == hostile
    with pytest.raises(ConfigError, match=r"model\.inner\._target_='os\.system'"):
        trust.check_targets(
            {"model": {"inner": {"_target_": "os.system"}}}, trusted=[], where="config.json"
        )
    trust.check_targets({"_target_": "mylib.Net"}, trusted=["mylib"], where="config.json")
    with pytest.raises(trust.Malformed):
        trust.inside("../step_0000001", Path("/tmp/checkpoints"))
