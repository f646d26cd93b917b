"""FSDP2 on real transformers: per-block units, activation checkpointing, tied
weights in every checkpoint format, FSDP on one process. Real runs (gloo, 2 CPU
processes) of ``model=gpt`` and of a Hugging Face GPT-2 (engine_tests/hf_gpt2.py, tied
embeddings); the wrap policy, the tie map and the error messages in-process."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from digit_trainer.models.digits import MLP
from digit_trainer.models.gpt import GPT
from safetensors import safe_open
from torch import nn

from training_engine import fsdp
from training_engine.checkpoint import folder, save, sharded, ties
from training_engine.checkpoint.__main__ import main as checkpoint_cli
from training_engine.checkpoint.format import CheckpointError
from training_engine.config import ConfigError, check_config, resolve_config

from .conftest import ENV, ONE_PROCESS, PROJECT_ROOT, TRAIN_WITH_FAULTS, fingerprints, run_train
from .hf_gpt2 import gpt2

TOKENS = ["data=tokens", "data.seq_len=16", "data.vocab_size=32", "data.num_train=256"]
TOKENS += ["data.num_val=64", "data.batch_size=8"]
SMALL = ["model.d_model=32", "model.n_head=2", "model.dropout=0.0"]
HF = ["model=gpt", "model._target_=engine_tests.hf_gpt2.gpt2", "model.n_layer=2", *SMALL, *TOKENS]
QUIET = ["tracker=csv", "preflight=off", "trainer.log_every_n_steps=2"]


def needs_transformers() -> None:
    """The Hugging Face tests need ``transformers`` (the ``hf`` extra, in ``dev``).
    Only where TESTS_SKIP_MISSING_EXTRAS=1 says the environment lacks it on
    purpose is it a skip; anywhere else the test fails, naming the extra."""
    if find_spec("transformers") is None:
        if os.environ.get("TESTS_SKIP_MISSING_EXTRAS") == "1":
            pytest.skip("not installed here: transformers")
        pytest.fail("transformers is missing: pip install -e '.[dev]' (the hf extra)")


def train(run_dir: Path, *overrides: str, check: bool = True) -> tuple[int, str]:
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", ONE_PROCESS, *overrides]
    proc = subprocess.run(
        cmd, cwd=PROJECT_ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    if check:
        assert proc.returncode == 0, out[-5000:]
    return proc.returncode, out


def losses(run_dir: Path) -> dict[int, float]:
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return {int(r["step"]): float(r["value"]) for r in rows if r["name"] == "train/loss"}


def shard_keys(ckpt: Path) -> dict[str, dict[str, list[int]]]:
    """Each model shard file's tensors and their shapes (read from the headers)."""
    found = {}
    for shard in sorted((ckpt / sharded.MODEL_DIR).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            found[shard.name] = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    return found


# --- the wrap policy, in-process ----------------------------------------------------------


def test_units_of_the_gpt_example_are_its_blocks():
    model = GPT(vocab_size=32, seq_len=16, n_layer=4, n_head=2, d_model=32)
    plan = fsdp.plan_units(model, wrap_classes=None, min_params=100_000)
    assert plan.units == [f"blocks.{i}" for i in range(4)] and plan.rule == "repeated blocks"
    assert fsdp.describe(model, plan.units) == "4 x Block + root"
    assert not fsdp.has_forward(model.blocks)  # the ModuleList itself is never a unit


def test_units_of_a_hugging_face_gpt2_are_its_layers_and_never_split_the_tie():
    needs_transformers()
    model = gpt2(vocab_size=32, seq_len=16, n_layer=3)
    assert model.lm_head.weight is model.transformer.wte.weight
    plan = fsdp.plan_units(model, wrap_classes=None, min_params=100_000)
    assert plan.units == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert plan.rule == "GPT2LMHeadModel._no_split_modules"
    assert fsdp.describe(model, plan.units) == "3 x GPT2Block + root"
    # Naming the embedding would put one half of the tie in a unit: it stays in the root.
    named = fsdp.plan_units(model, wrap_classes=["GPT2Block", "Embedding"], min_params=1)
    assert named.units == ["transformer.wpe", *plan.units]
    assert named.skipped == ["transformer.wte (tied: transformer.wte.weight = lm_head.weight)"]
    # By size, with every module a candidate, the tie is never cut either.
    by_size = fsdp.plan_units(nn.Sequential(model), wrap_classes=None, min_params=1)
    assert not any(u.endswith(("wte", "lm_head")) for u in by_size.units)


def test_a_model_without_repeated_blocks_falls_back_to_size():
    mlp = MLP(in_features=64, num_classes=10)  # Flatten, Linear, ReLU, Dropout, ...: mixed
    plan = fsdp.plan_units(mlp, wrap_classes=None, min_params=1000)
    assert plan.units == ["net.1", "net.4", "net.7"] and plan.rule.startswith("size")
    assert fsdp.describe(mlp, plan.units) == "3 x Linear + root"
    assert fsdp.plan_units(mlp, wrap_classes=None, min_params=100_000).units == []
    # Bottom-up: a module becomes a unit when what its units leave of it is big enough.
    big_head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    assert fsdp.plan_units(big_head, wrap_classes=None, min_params=4000).units == ["0"]
    assert fsdp.plan_units(big_head, wrap_classes=None, min_params=520).units == ["0", "2"]


def test_nested_sequentials_give_their_outermost_repeated_blocks():
    def stage() -> nn.Sequential:
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(stage(), stage(), stage())
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    net = Net()
    plan = fsdp.plan_units(net, wrap_classes=None, min_params=1)
    assert plan.units == ["body.0", "body.1", "body.2"]  # not the Linears inside them
    assert fsdp.describe(net, plan.units) == "3 x Sequential + root"
    # A list that mixes classes is not one of blocks: size decides, bottom-up (a
    # Linear(8, 8) has 72 parameters, a stage 144).
    mixed = nn.Sequential(stage(), nn.Linear(8, 8))
    assert fsdp.plan_units(mixed, wrap_classes=None, min_params=100).units == ["0"]
    assert fsdp.plan_units(mixed, wrap_classes=None, min_params=72).units == ["0.0", "0.2.0", "1"]


def test_wrap_classes_name_the_units_and_bad_values_are_refused(compose_cfg):
    model = GPT(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=32)
    plan = fsdp.plan_units(model, wrap_classes=["CausalSelfAttention"], min_params=1)
    assert plan.units == ["blocks.0.attn", "blocks.1.attn"]
    assert plan.rule == "parallel.wrap_classes"
    with pytest.raises(ConfigError, match=r"parallel.wrap_classes=\['Blok'\] is not allowed: Blok"):
        fsdp.plan_units(model, wrap_classes=["Blok"], min_params=1)
    with pytest.raises(ConfigError, match=r"ModuleList has no forward .*Block \(2\)"):
        fsdp.plan_units(model, wrap_classes=["ModuleList"], min_params=1)
    for override, expected in {
        "parallel.wrap_classes=Block": "wrap_classes='Block' is not allowed: expected null",
        "parallel.wrap_classes=[]": "parallel.wrap_classes=[] is not allowed",
        "parallel.auto_wrap_min_params=0": "parallel.auto_wrap_min_params=0 is not allowed",
        "parallel.activation_checkpointing=often": "activation_checkpointing='often' is not",
        "parallel.cpu_offload=maybe": "parallel.cpu_offload='maybe' is not allowed",
    }.items():
        with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            check_config(resolve_config(compose_cfg("parallel=fsdp", override)))
    check_config(resolve_config(compose_cfg("parallel=fsdp", "parallel.wrap_classes=[Block]")))


def test_precision_policy_is_low_precision_compute_with_fp32_reduction():
    block, root = fsdp.precision_policies("bf16")
    assert (block.param_dtype, block.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert root.output_dtype == torch.float32  # the loss sees fp32 logits
    assert fsdp.precision_policies("no")[0].param_dtype is None


# --- tied parameters and error messages, in-process ---------------------------------------


def test_ties_are_found_by_identity_stored_once_and_restored(tmp_path):
    needs_transformers()
    model = gpt2(vocab_size=32, seq_len=16)
    tied = ties.find(model)
    assert tied == {"lm_head.weight": "transformer.wte.weight"}
    assert ties.find(GPT(vocab_size=32, seq_len=16, n_layer=1, n_head=2, d_model=32)) == {}
    state = model.state_dict()
    kept = ties.drop_aliases(state, ties.in_state(tied, state))
    assert "lm_head.weight" not in kept and len(kept) == len(state) - 1
    back = ties.restore(kept, tied)
    assert back.keys() == state.keys() and back["lm_head.weight"] is back["transformer.wte.weight"]

    # A weight file: the aliases dropped, the tie in its metadata, put back by load_file.
    from safetensors.torch import save_file

    save_file(kept, tmp_path / "plain.safetensors")
    ties.with_metadata(tmp_path / "plain.safetensors", tmp_path / "w.safetensors", tied)
    loaded = ties.load_file(tmp_path / "w.safetensors")
    fresh = gpt2(vocab_size=32, seq_len=16)
    fresh.load_state_dict(loaded)  # strict: every name is there
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert all(torch.equal(fresh.state_dict()[k], state[k]) for k in state)

    # What a checkpoint says about its ties is checked before use.
    for bad in ('["lm_head.weight"]', '{"a": 1}', "{not json", '{"a": "a"}'):
        with pytest.raises(CheckpointError, match="tie map"):
            ties.of_checkpoint({ties.TIES_FILE: bad}, tmp_path)
    assert ties.of_checkpoint({}, tmp_path) == {}


def test_activation_checkpointing_wrapper_keeps_every_name():
    """Pins torch's private ``checkpoint_wrapper`` (fsdp.py): state_dict keys stay the
    model's own, and ``ties.find`` sees through the wrapper's prefix."""
    needs_transformers()
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = gpt2(vocab_size=32, seq_len=16)
    keys = list(model.state_dict())
    model.transformer.set_submodule("h.0", checkpoint_wrapper(model.transformer.h[0]))
    assert any(ties.AC_PREFIX in n for n, _ in model.named_parameters())
    assert list(model.state_dict()) == keys
    assert ties.find(model) == {"lm_head.weight": "transformer.wte.weight"}


def test_a_save_failing_on_its_tensors_gives_no_disk_advice(tmp_path):
    job = type("Job", (), {"name": "step_0000001", "root": tmp_path})()
    for name in sharded.MODEL_DIR, sharded.OPTIMIZER_DIR:
        (tmp_path / "a" / name).mkdir(parents=True)
    shared = torch.zeros(4, 4)
    with pytest.raises(CheckpointError) as err:  # a real DCP save of memory-sharing tensors
        sharded.write(tmp_path / "a", {"a": shared, "b": shared}, {}, 1)
    message = str(save.write_error(job, err.value))
    assert "Some tensors share memory" in message and "not a disk problem" in message
    assert "free disk space" not in message
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / sharded.MODEL_DIR).write_text("")  # a file in the folder's place
    with pytest.raises(OSError) as err:
        sharded.write(tmp_path / "b", {"a": torch.zeros(2)}, {}, 1)
    assert "free disk space or fix permissions" in str(save.write_error(job, err.value))


def test_the_task_reads_the_logits_of_an_output_object():
    from digit_trainer.tasks.language_model import LanguageModel

    needs_transformers()
    task = LanguageModel()
    model = gpt2(vocab_size=32, seq_len=16)
    batch = (torch.randint(0, 32, (2, 16)), torch.randint(0, 32, (2, 16)))
    loss, logs = task.loss(model=model, batch=batch)
    assert loss.ndim == 0 and logs["acc"].ndim == 0
    predicted = task.predict(model=model, batch=batch)  # an LM's: per sequence
    assert predicted["loss"].shape == predicted["perplexity"].shape == (2,)
    with pytest.raises(TypeError, match=r"returned dict; LanguageModel expects logits"):
        task.logits({"scores": torch.zeros(2)})


# --- real runs ----------------------------------------------------------------------------


def test_multi_node_defaults_train_the_gpt_example(tmp_path, compose_cfg):
    """The multi_node scope's default is parallel=fsdp: with its defaults (2 CPU
    processes here) the GPT example trains, one FSDP unit per block, then the root."""
    fsdp_default = compose_cfg().parallel.mode == "fsdp"
    args = [*([] if fsdp_default else ["parallel=fsdp"]), "model=gpt", *SMALL, *TOKENS, *QUIET]
    run = run_train(tmp_path / "run", *args, "trainer.max_steps=16", as_baked=True)
    log = (tmp_path / "run" / "train.log").read_text()
    assert "FSDP units: 4 x Block + root (repeated blocks" in log
    assert "world size 2 (FSDP)" in log
    steps = losses(run.run_dir)
    assert steps[16] < steps[2] - 0.05, steps
    shards = shard_keys(folder.committed_checkpoints(run.run_dir / "checkpoints")[-1])
    assert len(shards) == 2  # one file per rank, each with its half of every block
    for keys in shards.values():
        assert keys["blocks.3.attn.qkv.weight"] == [48, 32]


@pytest.mark.multiprocess
def test_hugging_face_gpt2_trains_resumes_and_exports_under_fsdp(tmp_path):
    """A tied GPT-2 under 2-process FSDP: per-block units, the loss falls, the tie
    stored once in the sharded checkpoint; kill -9 then resume is bit-exact;
    resuming 2 -> 1 -> 2 processes -> no FSDP works through both formats; each
    export is the gathered state and loads into a fresh model with its tie intact."""
    needs_transformers()
    args = ["parallel=fsdp", *HF, *QUIET, "checkpoint.every_n_steps=4", "trainer.max_steps=12"]
    straight = tmp_path / "straight"
    train(straight, *args)
    log = (straight / "train.log").read_text()
    assert "FSDP units: 2 x GPT2Block + root (GPT2LMHeadModel._no_split_modules" in log
    steps = losses(straight)
    assert steps[12] < steps[2] - 0.05, steps
    expected = fingerprints(straight)
    assert len(set(expected.values())) == 1 and len(expected) == 2

    ckpt = straight / "checkpoints" / "step_0000012"
    assert json.loads((ckpt / ties.TIES_FILE).read_text()) == {
        "lm_head.weight": "transformer.wte.weight"
    }
    shards = shard_keys(ckpt)
    assert len(shards) == 2
    for keys in shards.values():  # each rank's half of every block's tensors, the tie once
        assert keys["transformer.h.0.attn.c_attn.weight"] == [16, 96]
        assert keys["transformer.h.1.mlp.c_fc.weight"] == [16, 128]
        assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys

    # Export: the gathered weights (run_dir/model.safetensors holds them), tie intact.
    assert_export_is_the_final_weights(straight, tmp_path / "straight.safetensors")

    # kill -9 while step 8 is being committed: the same command resumes from step 4.
    killed = tmp_path / "killed"
    output = tmp_path / "killed.out"
    with output.open("w") as sink:
        cmd = [sys.executable, TRAIN_WITH_FAULTS, f"hydra.run.dir={killed}", ONE_PROCESS, *args]
        env = {**ENV, "CKPT_TEST_PAUSE_AT": "before_rename@8"}
        proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=sink, stderr=sink)
    deadline = time.monotonic() + 240
    while b"CKPT_TEST_PAUSED" not in output.read_bytes() and proc.poll() is None:
        assert time.monotonic() < deadline, output.read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -9, output.read_text()[-3000:]
    _, out_text = train(killed, *args)
    assert "resumed from" in out_text and "step_0000004: step 4" in out_text
    assert fingerprints(killed) == expected  # bit-exact

    # 2 -> 1 (FSDP on one process, full checkpoints) from step 8, 1 -> 2 from its step
    # 12 (sharded again), then to one process without FSDP: the tie in every format.
    one = tmp_path / "one"
    resume = f"checkpoint.resume={straight / 'checkpoints' / 'step_0000008'}"
    train(one, *args, "parallel.num_processes=1", "checkpoint.format=full", resume)
    summary = json.loads((one / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["step"] == 12
    assert "world size 1 (FSDP)" in (one / "train.log").read_text()
    assert abs(losses(one)[12] - steps[12]) < 1e-4  # the same batches, another reduction order
    full = one / "checkpoints" / "step_0000012"
    assert ties.TIES_FILE in json.loads((full / "MANIFEST.json").read_text())["files"]
    with safe_open(str(full / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 (not a dict)
    assert_export_is_the_final_weights(one, tmp_path / "one.safetensors")
    two = tmp_path / "two"
    train(two, *args, "trainer.max_steps=16", f"checkpoint.resume={full}")
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == 16
    assert summary["resumed_from"].endswith("step_0000012")
    plain = tmp_path / "plain"
    resume = f"checkpoint.resume={two / 'checkpoints' / 'step_0000016'}"
    train(plain, *args, "parallel=none", "trainer.max_steps=18", resume)
    assert json.loads((plain / "summary.json").read_text())["step"] == 18
    assert_export_is_the_final_weights(plain, tmp_path / "plain.safetensors")


def assert_export_is_the_final_weights(run_dir: Path, out: Path) -> None:
    """The newest checkpoint exported equals the run's gathered final weights, and
    loads strictly into a fresh GPT-2 with its tie intact."""
    assert checkpoint_cli(["export", str(run_dir), "-o", str(out)]) == 0
    with safe_open(str(out), framework="pt") as f:
        assert json.loads(f.metadata()[ties.METADATA_KEY]) == {
            "lm_head.weight": "transformer.wte.weight"
        }
    exported, final = ties.load_file(out), ties.load_file(run_dir / "model.safetensors")
    assert exported.keys() == final.keys() and "lm_head.weight" in exported
    assert all(torch.equal(exported[k], final[k]) for k in final)
    fresh = gpt2(vocab_size=32, seq_len=16)
    fresh.load_state_dict(exported)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(fresh.lm_head.weight, final["transformer.wte.weight"])


@pytest.mark.multiprocess
def test_activation_checkpointing_on_and_off_train_the_same(tmp_path):
    """With dropout: the recompute draws the same masks (the RNG state is kept), so
    the losses match step for step. FSDP on one process, a GPT-2 with its tie."""
    needs_transformers()
    args = ["parallel=fsdp", "parallel.num_processes=1", *HF, "model.dropout=0.1", *QUIET]
    args += ["trainer.max_steps=5", "trainer.log_every_n_steps=1", "checkpoint=none"]
    on, off = tmp_path / "on", tmp_path / "off"
    train(on, *args, "parallel.activation_checkpointing=true")
    train(off, *args, "parallel.activation_checkpointing=false")
    assert "activation checkpointing on" in (on / "train.log").read_text()
    assert "activation checkpointing off" in (off / "train.log").read_text()
    a, b = losses(on), losses(off)
    assert sorted(a) == [1, 2, 3, 4, 5] and a.keys() == b.keys()
    assert all(abs(a[s] - b[s]) < 1e-5 for s in a), (a, b)


@pytest.mark.multiprocess
def test_a_wrap_class_the_model_lacks_is_refused_before_any_work(tmp_path):
    run_dir = tmp_path / "run"
    code, out = train(
        run_dir,
        "parallel=fsdp",
        "parallel.num_processes=1",
        "model=gpt",
        *SMALL,
        *TOKENS,
        "parallel.wrap_classes=[Blocks]",
        check=False,
    )
    assert code == 2, out[-3000:]
    assert "parallel.wrap_classes=['Blocks'] is not allowed: Blocks is not a class of GPT" in out
    assert not run_dir.exists()  # nothing left on disk
