"""One seed, one initial model, in every parallel mode: one step at a learning rate of
1e-20 (an update below fp32's resolution for every weight but those initialised to 0)
under 1 process, DDP, FSDP and DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3, for model=gpt and for a
transformers GPT-2 built with from_config (tied embeddings), compared with the
1-process weights. ZeRO-3 builds the model whole from the seed and then partitions it
(``parallel.zero3_init: false``); with deepspeed.zero.Init transformers initialised
it from other draws (a relative difference of 1.41)."""

from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import run_train

pytestmark = pytest.mark.multiprocess

ONE_STEP = [
    "trainer.max_steps=1",
    "optimizer.lr=1e-20",
    "tracker=none",
    "preflight=off",
    "checkpoint=none",
]
MODELS = {
    "gpt": ["model=gpt", "data=tokens", "model.n_layer=1", "model.d_model=32", "model.n_head=2"],
    "hf": [
        "model=hf",
        "data=text",
        "model.config.n_layer=1",
        "model.config.n_head=2",
        "model.config.n_embd=32",
        "data.seq_len=32",
        "data.batch_size=4",
    ],
}
TWO = ["parallel.cpu_processes=2", "parallel.num_processes=2"]
MODES = {
    "ddp": ["parallel=ddp", *TWO],
    "fsdp": ["parallel=fsdp", *TWO],
    "zero1": ["parallel=deepspeed", *TWO, "parallel.zero_stage=1"],
    "zero2": ["parallel=deepspeed", *TWO, "parallel.zero_stage=2"],
    "zero3": ["parallel=deepspeed", *TWO, "parallel.zero_stage=3"],
}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "model.safetensors")


@pytest.mark.parametrize("model", MODELS)
def test_every_parallel_mode_starts_from_the_same_model(model, tmp_path):
    if model == "hf":
        pytest.importorskip("transformers", reason="the hf extra")
    args = [*MODELS[model], *ONE_STEP]
    if model == "hf":
        args.append(f"data.cache_dir={tmp_path / 'cache'}")
    one = final_weights(run_train(tmp_path / "one", *args, "parallel=none").run_dir)
    differences = {}
    for mode, extra in MODES.items():
        if mode.startswith("zero") and find_spec("deepspeed") is None:
            continue  # the deepspeed extra: CI installs it
        weights = final_weights(run_train(tmp_path / mode, *args, *extra).run_dir)
        assert weights.keys() == one.keys(), mode
        differences[mode] = max(
            (weights[k].float() - one[k].float()).abs().max().item() for k in one
        )
    # the same initial weights: what differs is the step's own update (about the
    # learning rate: zero-initialised biases move by 1e-20 in the direction of each
    # mode's gradient), never a different draw (which differs by the weights' size)
    assert differences and all(d < 1e-18 for d in differences.values()), differences
