"""Hugging Face models and text, in and out (docs/hf.md, docs/text.md): a transformers
GPT-2 (from_config, tied embeddings) trained on real text (the Python standard
library's own source), exported to the Hugging Face format and read back with
from_pretrained, generating text; data=text's tokenizer and cache; bad input."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from training_engine.param_groups import decay_groups
from training_engine.tokenizer import bytes_tokenizer, load_tokenizer

from .conftest import ENV, PROJECT_ROOT, fingerprints, run_train
from .test_lifecycle import run_script

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# The json package's source: ~90 kB of real Python, 257 byte ids.
TEXT = [f"data.files={STDLIB / 'json' / '*.py'}", "data.seq_len=64", "data.batch_size=16"]
TINY_HF = [
    "model=hf",
    "data=text",
    "model.config.n_layer=2",
    "model.config.n_head=2",
    "model.config.n_embd=64",
]
RUN = [
    *TINY_HF,
    *TEXT,
    "trainer.max_steps=80",
    "trainer.log_every_n_steps=10",
    "trainer.eval_every_n_steps=40",
    "tracker=csv",
    "preflight=off",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    return run_train(root / "run", *RUN, f"data.cache_dir={root / 'cache'}")


def test_a_transformers_model_learns_real_text_and_round_trips_to_the_hf_format(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training_engine.inference import load_model

    assert trained.summary["metrics"]["val/loss"] < 3.2  # from ln(257) = 5.55 at the start
    assert "train/acc" in trained.summary["metrics"]  # task.loss's logs, averaged per window
    out = tmp_path / "hf"
    cli = [sys.executable, "-m", "training_engine.checkpoint", "export"]
    proc = subprocess.run(
        [*cli, str(trained.run_dir), "--format", "hf", "-o", str(out)],
        cwd=PROJECT_ROOT, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    ours = load_model(trained.run_dir)  # the transformers model itself, not a wrapper
    assert type(ours) is type(theirs)
    assert theirs.lm_head.weight is theirs.transformer.wte.weight  # the tie survived
    tokens = AutoTokenizer.from_pretrained(out)
    text = (STDLIB / "json" / "decoder.py").read_text()[:60]  # n_positions = data.seq_len = 64
    batch = torch.tensor([tokens.encode(text)])
    assert batch[0].tolist() == list(text.encode())  # the run's byte ids, through transformers
    with torch.no_grad():
        assert torch.equal(theirs(batch).logits, ours(batch).logits)
    # the end-of-document id is eos (and bos, pad) for transformers too; the context
    # length is the tokenizer's limit (not transformers' 1e30 default)
    eos = 256  # bytes: ids 0-255, then <|endoftext|>
    exported = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    for meta in (exported, generation):
        assert (meta["eos_token_id"], meta["bos_token_id"], meta["pad_token_id"]) == (eos,) * 3
    assert tokens.model_max_length == 64 and tokens.eos_token_id == eos
    # transformers' generate stops at that eos, as generate.py does (stop_at_eos): a
    # model made to prefer it (the final norm outputs eos's embedding, scaled up)
    with torch.no_grad():
        theirs.transformer.ln_f.weight.zero_()
        theirs.transformer.wte.weight[eos] *= 10
        theirs.transformer.ln_f.bias.copy_(theirs.transformer.wte.weight[eos])
        made = theirs.generate(batch[:, :8], max_new_tokens=5, do_sample=False)
    assert made[0, 8:].tolist() == [eos]  # one token, eos, then it stopped


def test_generate_continues_a_prompt_the_same_way_twice(trained, tmp_path):
    texts = []
    for name in ("a", "b"):
        proc = run_script(
            "generate.py",
            tmp_path / name,
            f"ckpt={trained.run_dir}",
            'prompt="import json\\ndef "',
            "max_new_tokens=24",
            "temperature=0.8",
            "top_k=20",
        )
        result = json.loads((tmp_path / name / "generation.json").read_text())
        assert result["continuation"] in proc.stdout and len(result["ids"]) >= 1
        texts.append(result["continuation"])
    assert texts[0] == texts[1]
    # another seed, and a prompt longer than the model's 64 positions: said, not silent
    long_prompt = "import json " * 8  # 96 bytes, 96 byte ids
    other = run_script(
        "generate.py", tmp_path / "c", f"ckpt={trained.run_dir}", f'prompt="{long_prompt}"',
        "max_new_tokens=24", "temperature=0.8", "top_k=20", "seed=7",
    )  # fmt: skip
    assert json.loads((tmp_path / "c" / "generation.json").read_text())["seed"] == 7
    assert other.returncode == 0
    said = other.stdout + other.stderr
    assert "the prompt is 96 tokens and the model takes 64 positions" in said
    assert "cropped to its last 64 tokens (32 dropped)" in said


def test_text_is_tokenized_once_and_cached(trained, tmp_path):
    cache = Path(json.loads((trained.run_dir / "config.json").read_text())["data"]["cache_dir"])
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    source = json.loads((folder / "source.json").read_text())
    assert source["documents"]["train"] >= 4 and source["documents"]["val"] >= 1
    assert all(Path(f["path"]).parent == STDLIB / "json" for f in source["files"])
    assert {(f["format"], f["compression"], f["invalid_bytes"]) for f in source["files"]} == {
        ("text", "none", 0)
    }
    stamp = (folder / "train.bin").stat().st_mtime_ns
    again = run_train(
        tmp_path / "again", *RUN, f"data.cache_dir={cache}", "trainer.max_steps=1",
        "trainer.eval_every_n_steps=1",
    )  # fmt: skip
    assert again.summary["step"] == 1
    assert (folder / "train.bin").stat().st_mtime_ns == stamp  # read, not written again
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1


@pytest.mark.multiprocess
def test_a_transformers_model_under_ddp_resumes_bit_exactly_after_kill_9(tmp_path):
    from .test_checkpoint import kill_when_paused

    ddp = [
        *TINY_HF, *TEXT, "parallel=ddp", "trainer.max_steps=20", "trainer.log_every_n_steps=5",
        "trainer.eval_every_n_steps=10", "checkpoint.every_n_steps=5", "tracker=csv",
        "preflight=off", f"data.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    straight = run_train(tmp_path / "straight", *ddp)
    run_dir = tmp_path / "killed"
    kill_when_paused(run_dir, "before_pointers", 10, *ddp)
    resumed = run_train(run_dir, *ddp)
    assert resumed.summary["resumed_from"]
    assert fingerprints(resumed.run_dir)["train.log"] == fingerprints(straight.run_dir)["train.log"]


BAD = {
    "tokenizer": (["data.tokenizer=/no/such/tokenizer.json"], "data.tokenizer='/no/such/"),
    "glob": (["data.files=/no/such/dir/*.txt"], "data.files='/no/such/dir/*.txt' is not allowed"),
    # a binary under a text name (the engine's own interpreter): refused, named, before any work
    "binary": ([f"data.files={sys.executable}"], "holds NUL bytes"),
    # a whole new model config given as a dict: what to write instead
    "config dict": (
        ["model.config={model_type:llama,hidden_size:32}"],
        "a dict merges into model.config, and model.config has no key 'hidden_size'. "
        "A whole new model.config: model.config=null",
    ),
    "positions": (
        ["model.config.n_positions=32"],
        "data.seq_len=64 is not allowed with this model: it takes at most 32 positions",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_text_input_exits_2_with_one_message(tmp_path, case):
    overrides, expected = BAD[case]
    run = run_train(
        tmp_path / "run", *RUN, f"data.cache_dir={tmp_path / 'cache'}", *overrides, check=False
    )
    assert run.proc.returncode == 2 and expected in run.output and "Traceback" not in run.output
    assert not run.run_dir.exists()


def test_bytes_ids_are_the_exported_tokenizers_ids_and_decay_skips_norms_and_embeddings():
    text = "def f(x):\n    return x ** 2  # ünïcode ✓\n"
    ours = load_tokenizer(None)
    assert ours.encode_batch([text])[0] == list(text.encode()) and ours.vocab_size == 257
    exported = bytes_tokenizer()
    assert exported.encode(text).ids == list(text.encode())
    assert exported.decode(list(text.encode())) == text == ours.decode(list(text.encode()))
    assert exported.token_to_id("<|endoftext|>") == ours.eos_id == 256

    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64))
    decayed, exempt = decay_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}  # the tie: listed once
    assert exempt["weight_decay"] == 0.0 and "weight_decay" not in decayed
    assert {names[id(p)] for p in decayed["params"]} == {
        n for n, p in model.named_parameters() if n.endswith(("c_attn.weight", "c_proj.weight",
                                                             "c_fc.weight"))
    }  # fmt: skip
    assert len(decayed["params"]) + len(exempt["params"]) == len(list(model.parameters()))
    assert id(model.transformer.wte.weight) in {id(p) for p in exempt["params"]}


def test_a_hf_model_directory_loads_as_model_pretrained(tmp_path):
    """model.pretrained: a local save_pretrained directory, never the Hub."""
    from digit_trainer.models.hf import causal_lm
    from transformers import GPT2Config, GPT2LMHeadModel

    saved = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=257)).save_pretrained(
        saved
    )
    model = causal_lm(pretrained=str(saved))
    assert model.config.n_embd == 16
    from training_engine.config import ConfigError

    with pytest.raises(ConfigError, match="Hub names are not downloaded"):
        causal_lm(pretrained="gpt2")
    with pytest.raises(ConfigError, match="exactly one of them"):
        causal_lm(config={"model_type": "gpt2"}, pretrained=str(saved))


def test_a_tokenizer_file_is_bounded_and_its_errors_name_data_tokenizer_and_the_file(tmp_path):
    from training_engine.config import ConfigError
    from training_engine.tokenizer import MAX_TOKENIZER_BYTES

    cases = {
        "not.json": (b"not json", "is not a tokenizer.json that tokenizers reads"),
        "deep.json": (b"[" * 100_000, "is not a tokenizer.json that tokenizers reads"),
    }
    for name, (content, _) in cases.items():
        (tmp_path / name).write_bytes(content)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:  # sparse: no disk, and never read
        f.truncate(MAX_TOKENIZER_BYTES + 1)
    cases["huge.json"] = (None, f"more than the {MAX_TOKENIZER_BYTES} a tokenizer.json holds")
    for name, (_, expected) in cases.items():
        with pytest.raises(ConfigError) as err:
            load_tokenizer(str(tmp_path / name))
        assert str(err.value).startswith(f"data.tokenizer='{tmp_path / name}'"), err.value
        assert expected in str(err.value)
