"""Adapters through peft (``model.peft``, docs/finetune.md), on real transformers models
built with from_config: LoRA on a GPT-2 with tied embeddings loaded from a local
pretrained directory, fine-tuned on the project's chat data; and on a Llama-style
model built from a config, under 2-process FSDP with activation checkpointing.

Checkpoints hold the trainable weights alone and a reference to the frozen base
(checkpoint/base.py): far smaller than a full fine-tune's, resumed after kill -9 bit
for bit, and refused (exit 2, before any work, naming the tensors) on another base.
Both exports, merged and peft's adapter directory, give load_model's logits; preflight
counts the trainable parameters and what the frozen ones save."""

import csv
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import ENV, PROJECT_ROOT, run_train
from .test_checkpoint import kill_when_paused

pytest.importorskip("peft", reason="the hf extra: pip install -e '.[hf]'")

STDLIB_JSON = Path(sysconfig.get_paths()["stdlib"]) / "json"  # real text: its Python source
SEQ = 128  # data=chat rows; the GPT-2 base takes as many positions
# the project's own conversations, named from its root (train_with_faults.py's own root
# is not the project's)
CONVERSATIONS = f"{PROJECT_ROOT}/src/*/data/assets/chat_arithmetic.jsonl"
CHAT = ["data=chat", f"data.files={CONVERSATIONS}", f"data.seq_len={SEQ}", "data.batch_size=8"]
SHORT = ["trainer.log_every_n_steps=4", "trainer.eval_every_n_steps=6", "tracker=csv"]


def gpt2_base(folder: Path, seed: int) -> Path:
    """A 'pretrained' GPT-2 with tied embeddings, saved where model.pretrained reads it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=257, n_positions=SEQ, n_layer=2, n_head=2, n_embd=128,
        tie_word_embeddings=True, bos_token_id=256, eos_token_id=256,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def lora(base: Path, *extra: str) -> list[str]:
    return [
        "model=hf", "model.config=null", f"model.pretrained={base}", "model.peft=lora",
        *CHAT, "trainer.max_steps=12", *SHORT, "checkpoint.every_n_steps=4",
        "optimizer.lr=3e-3", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A LoRA fine-tune of the GPT-2 base (preflight on), and a full fine-tune of the
    same base (every weight trains) for the checkpoint sizes."""
    root = tmp_path_factory.mktemp("peft")
    base = gpt2_base(root / "base", seed=1)
    cache = f"data.cache_dir={root / 'cache'}"
    adapted = run_train(root / "lora", *lora(base, cache, "preflight=default"))
    full = run_train(
        root / "full", *lora(base, cache, "model.peft=null", "trainer.max_steps=4", "preflight=off")
    )
    return {"root": root, "base": base, "lora": adapted, "full": full, "cache": cache}


def train_losses(run_dir: Path) -> list[float]:
    """train/loss at each log step, from metrics.csv (time, step, name, value)."""
    with open(run_dir / "metrics.csv") as f:
        return [float(r["value"]) for r in csv.DictReader(f) if r["name"] == "train/loss"]


def checkpoint_bytes(ckpt: Path) -> int:
    return sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())


def test_lora_checkpoints_hold_the_adapter_and_a_reference_to_the_base(runs):
    run, full = runs["lora"], runs["full"]
    ckpt = run.run_dir / "checkpoints" / "step_0000012"
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    assert manifest["weights"] == "trainable" and "base.json" in manifest["files"]
    saved = load_file(ckpt / "model.safetensors")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), sorted(saved)[:4]
    base = json.loads((ckpt / "base.json").read_text())
    assert base["reference"]["model"]["pretrained"] == str(runs["base"])
    assert "base_model.model.transformer.wte.weight" in base["tensors"]  # the tie, once
    assert "base_model.model.lm_head.weight" not in base["tensors"]
    ours = checkpoint_bytes(ckpt)
    theirs = checkpoint_bytes(full.run_dir / "checkpoints" / "step_0000004")
    assert ours < 0.05 * theirs, (ours, theirs)  # measured: 138 kB against 5.4 MB
    # the final weights: the adapter too, its base in the metadata
    final = run.run_dir / "model.safetensors"
    assert set(load_file(final)) == set(saved)
    # preflight: the trainable share, and what the frozen base saves
    counts = json.loads((run.run_dir / "preflight.json").read_text())["estimates"]["parameters"]
    assert counts["trainable"] == sum(v.numel() for v in saved.values())  # c_attn's A and B
    assert counts["trainable"] < 0.03 * counts["total"]
    assert counts["saved_gradient_bytes"] > 4 * 0.97 * counts["total"]  # fp32: 4 bytes each
    assert counts["saved_optimizer_bytes"] > 2 * counts["saved_gradient_bytes"] * 0.99  # AdamW
    assert "trainable" in run.output and "the frozen ones save" in run.output
    # the loss on the assistant's tokens went down
    loss = train_losses(run.run_dir)
    assert loss[-1] < loss[0], loss


def test_kill_9_resumes_bit_for_bit_and_another_base_is_refused(runs, tmp_path):
    # the killed run reads its own copy of the base: the refusal below changes it
    base = shutil.copytree(runs["base"], tmp_path / "base")
    overrides = lora(base, runs["cache"], "preflight=off")
    run_dir = tmp_path / "killed"
    kill_when_paused(run_dir, "before_pointers", 8, *overrides)
    resumed = run_train(run_dir, *overrides)
    assert resumed.summary["resumed_from"]
    ours = load_file(run_dir / "model.safetensors")
    straight = load_file(runs["lora"].run_dir / "model.safetensors")
    assert ours.keys() == straight.keys()
    assert all(torch.equal(ours[k], straight[k]) for k in ours)

    # another base under the same directory: exit 2 before any work, naming the tensors
    gpt2_base(base, seed=2)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    refused = run_train(run_dir, *overrides, "trainer.max_steps=16", check=False)
    assert refused.proc.returncode == 2, refused.output[-3000:]
    assert "trained on a frozen base that this run's base is not" in refused.output
    assert "base_model.model.transformer.wte.weight holds other values" in refused.output
    assert "Traceback" not in refused.output
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 12  # unchanged


def export(run_dir: Path, out: Path, *flags: str) -> None:
    cli = [sys.executable, "-m", "training_engine.checkpoint", "export", str(run_dir)]
    proc = subprocess.run(
        [*cli, "--format", "hf", "-o", str(out), *flags],
        cwd=PROJECT_ROOT, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def exports_give_load_models_logits(run_dir: Path, tmp_path: Path, batch: torch.Tensor) -> None:
    """Merged: transformers' model, the adapter merged in (load_model's merged the same
    way, bit for bit; unmerged, within float rounding); adapter: peft's directory on its
    base, load_model's logits bit for bit."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from training_engine.inference import load_model

    export(run_dir, tmp_path / "merged")
    export(run_dir, tmp_path / "adapter", "--adapter")
    ours = load_model(run_dir)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    where = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(where["base_model_name_or_path"])
    adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        reference = ours(batch).logits
        assert torch.equal(adapter(batch).logits, reference)
        assert torch.allclose(merged(batch).logits, reference, rtol=0, atol=1e-5)
        assert torch.equal(merged(batch).logits, ours.merge_and_unload()(batch).logits)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft's read
def test_merged_and_adapter_exports_give_load_models_logits(runs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training_engine.chat import DEFAULT

    run_dir = runs["lora"].run_dir
    exports_give_load_models_logits(run_dir, tmp_path, torch.randint(0, 256, (2, 40)))
    # the export carries the chat template: transformers renders the run's conversations
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert tokenizer.chat_template == DEFAULT
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>\nWhat is 2 + 3?\n<|assistant|>\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    made = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert made.shape[1] > ids.shape[1]  # transformers' generate runs on the export
    # the adapter's base is the run's own pretrained directory, named as it is
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(runs["base"].resolve())
    assert not (tmp_path / "adapter" / "base").exists()


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft's read
def test_a_llama_adapter_trains_under_fsdp_with_activation_checkpointing(tmp_path):
    """From a config (the base is the seed's), 2 processes, FSDP2 per decoder layer,
    activation checkpointing: the loss goes down, the sharded checkpoint holds the
    adapter only and loads back (preflight's round trip), load_model rebuilds the base
    and loads it, both exports agree."""
    llama = (
        "+model.config={model_type:llama,vocab_size:${data.vocab_size},hidden_size:128,"
        "intermediate_size:256,num_hidden_layers:2,num_attention_heads:4,"
        "num_key_value_heads:2,max_position_embeddings:${data.seq_len}}"
    )
    run = run_train(
        tmp_path / "run", "model=hf", "model.config=null", llama, "model.peft=lora",
        "data=text", f"data.files={STDLIB_JSON}/*.py", "data.seq_len=64", "data.batch_size=8",
        "data.packing=documents", f"data.cache_dir={tmp_path / 'cache'}",
        "parallel=fsdp", "parallel.num_processes=2", "parallel.activation_checkpointing=true",
        "trainer.max_steps=12", *SHORT, "checkpoint.every_n_steps=6", "optimizer.lr=1e-2",
        "preflight=default",  # its round trip loads the sharded adapter state back
    )  # fmt: skip
    # the round trip: every tensor back bit for bit through DCP's flattened optimizer
    # state (which failed on decay_groups' empty group: LoRA has no biases or norms)
    checks = json.loads((run.run_dir / "preflight.json").read_text())["checks"]
    assert {c["name"]: c["status"] for c in checks}["checkpoint"] == "pass"
    assert "activation checkpointing on" in run.output and "LlamaDecoderLayer" in run.output
    loss = train_losses(run.run_dir)
    assert loss[-1] < loss[0], loss
    ckpt = run.run_dir / "checkpoints" / "step_0000012"
    assert json.loads((ckpt / "MANIFEST.json").read_text())["layout"] == "sharded"
    base = json.loads((ckpt / "base.json").read_text())
    assert base["reference"]["seed"] == 42 and base["reference"]["model"]["pretrained"] is None
    shards = sum(p.stat().st_size for p in (ckpt / "model").iterdir())
    shards += sum(p.stat().st_size for p in (ckpt / "optimizer").iterdir())
    full = 12 * base["parameters"]  # a full fine-tune's weights and AdamW state, at least
    assert shards < 0.05 * full, (shards, full)  # measured: 2.3 %
    exports_give_load_models_logits(run.run_dir, tmp_path, torch.randint(0, 256, (2, 40)))


def test_bad_adapter_settings_are_one_message_before_any_work(compose_cfg):
    from training_engine.config import ConfigError, check_config, resolve_config

    cases = {
        "model.peft=dora": "model.peft.method='dora': expected one of ('lora',)",
        "model.peft={method:lora,r:0}": "model.peft.r=0: expected an integer >= 1",
        "model.peft={method:lora,rank:8}": "model.peft.rank is not allowed: model.peft has",
        "model.peft={method:lora,target_modules:qkv}": "expected null (the model's default)",
    }
    for override, expected in cases.items():
        cfg = resolve_config(compose_cfg("model=gpt", "data=tokens", override))
        with pytest.raises(ConfigError) as err:
            check_config(cfg)
        assert expected in str(err.value), str(err.value)
    deepspeed = resolve_config(
        compose_cfg("model=gpt", "data=tokens", "model.peft=lora", "parallel=deepspeed")
    )
    with pytest.raises(ConfigError, match="not supported with parallel=deepspeed"):
        check_config(deepspeed)
    ema = resolve_config(
        compose_cfg("model=gpt", "data=tokens", "model.peft=lora", "trainer.ema.enabled=true")
    )
    with pytest.raises(ConfigError, match=r"not supported with trainer\.ema\.enabled=true"):
        check_config(ema)


def test_which_weights_a_checkpoint_holds_and_how_two_bases_differ():
    """checkpoint.weights=auto: trainable-only when frozen parameters are most of the
    model; the differences between two bases name each tensor."""
    from training_engine.checkpoint import base

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    assert base.resolve("auto", model) == "full" and base.fingerprint(model) is None
    model[0].requires_grad_(False)  # 72 of 90 parameters frozen
    assert base.resolve("auto", model) == "trainable" and base.resolve("full", model) == "full"
    assert set(base.trainable_state(model.state_dict(), model)) == {"1.weight", "1.bias"}
    ours = base.fingerprint(model, {"seed": 1})
    assert set(ours.tensors) == {"0.weight", "0.bias"} and ours.parameters == 72
    theirs = json.loads(ours.to_bytes())
    assert base.differences(ours, theirs) == []
    with torch.no_grad():
        model[0].bias.add_(1)
    changed = base.fingerprint(model)
    assert base.differences(changed, theirs) == ["0.bias holds other values"]
    from training_engine.config import ConfigError

    with pytest.raises(ConfigError, match=r"1 of its tensors differ: 0.bias holds other values"):
        base.check(changed, theirs, "step_0000004")
