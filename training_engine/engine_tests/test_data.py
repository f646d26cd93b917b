"""The data options on data the tests write: token files (memory-mapped, a stream),
Hugging Face datasets from local files, and a stream resumed after kill -9,
checked by the samples each part trained on."""

import itertools
import json
import math
import os
import re
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.data_loader import prepare_data_loader
from digit_trainer.data.digits import load_digits
from digit_trainer.data.hf import hf
from digit_trainer.data.tokens import copy_task_sequences, markov_language
from torch.utils.data import (
    DistributedSampler,
    RandomSampler,
    Sampler,
    TensorDataset,
    WeightedRandomSampler,
    default_collate,
)

from training_engine.batch_means import _head, _length, average_over_batches
from training_engine.checkpoint.elastic import per_process_batch
from training_engine.config import ConfigError
from training_engine.debug import first_batches
from training_engine.loaders import (
    continue_epoch,
    in_dataset_order,
    make_loaders,
    run_length,
)
from training_engine.token_file import TokenStream, token_file, write_tokens

from .conftest import ENV, FAST, PROJECT_ROOT, fingerprints, run_train
from .faults import sample_hash
from .test_checkpoint import ckpt_dir, kill_when_paused

# A GPT small enough for a few dozen CPU steps in seconds.
TINY_GPT = [
    "model=gpt",
    "model.d_model=32",
    "model.n_layer=1",
    "model.n_head=2",
    "data.seq_len=16",
    "data.batch_size=8",
    "optimizer.lr=3e-3",
]


def needs_datasets() -> None:
    """data=hf needs the hf extra; a skip only where it is missing on purpose."""
    if find_spec("datasets") is None and os.environ.get("TESTS_SKIP_MISSING_EXTRAS") == "1":
        pytest.skip("not installed here: datasets (the hf extra)")


def rss_bytes(kind: str = "VmRSS") -> int:
    """This process's resident memory (VmRSS: all; RssFile: pages of mapped files)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split(f"{kind}:")[1].split()[0]) * 1024


# --- pure logic, in-process ---------------------------------------------------------------


def test_run_length_and_a_stream_without_max_steps():
    def length(**kwargs):  # (steps per epoch, total steps, epochs)
        plan = run_length(**kwargs)
        return plan.steps_per_epoch, plan.total_steps, plan.max_epochs

    assert length(max_steps=None, max_epochs=3, batches=10, grad_accum=3) == (4, 12, 3)
    assert length(max_steps=5, max_epochs=3, batches=10, grad_accum=1) == (10, 5, 1)
    assert length(max_steps=7, max_epochs=3, batches=None, grad_accum=2) == (None, 7, 7)
    plan = run_length(max_steps=25, max_epochs=3, batches=10, grad_accum=1)
    assert plan.eval_every == 10 and plan.evaluations(0) == {10, 20, 25}  # each epoch, the end
    assert plan.evaluations(20) == {25} and plan.evaluations(25) == set()
    stream = run_length(max_steps=7, max_epochs=3, batches=None, grad_accum=1)
    assert stream.evaluations(0) == {7}  # a stream: at the end
    with pytest.raises(ConfigError, match=r"trainer.max_steps=None is not allowed .* no length"):
        run_length(max_steps=None, max_epochs=3, batches=None, grad_accum=1)


def test_hf_refuses_a_hub_name_and_says_how_to_use_it_offline(tmp_path):
    with pytest.raises(ConfigError, match=r"data.format='user/corpus' is not allowed") as err:
        hf(batch_size=8, seed=0, format="user/corpus", train_files="x", inputs="a", targets="b")
    assert "save_to_disk(DIR), then data.format=disk" in str(err.value)


class Buckets(Sampler):
    """A bucketing batch sampler (tests the engine's rules on one of the data's own):
    samples of similar length batched together, ``size`` at most, the last of each
    bucket smaller; the batches' order and contents from its ``generator``."""

    def __init__(self, lengths: torch.Tensor, size: int, generator: torch.Generator | None = None):
        self.lengths, self.size, self.generator = lengths, size, generator

    def _buckets(self) -> list[torch.Tensor]:
        return list(torch.argsort(self.lengths, stable=True).split(3 * self.size))

    def __len__(self) -> int:
        return sum(math.ceil(len(b) / self.size) for b in self._buckets())

    def __iter__(self):
        shuffled = [b[torch.randperm(len(b), generator=self.generator)] for b in self._buckets()]
        batches = [part.tolist() for b in shuffled for part in b.split(self.size)]
        yield from (batches[i] for i in torch.randperm(len(batches), generator=self.generator))


def as_dict(samples: list) -> dict:
    """A collate_fn making dict batches, with a plain list (ids) beside the tensors."""
    pixels, labels, index = default_collate(samples)
    return {"pixels": pixels, "label": labels, "id": [f"s{i}" for i in index.tolist()]}


def batch_ids(loader) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]


def epoch(loader, number: int, done: int = 0, processes: int = 1) -> list[list[int]]:
    """The sample ids of each batch of an epoch, as train.py's loop reads them (after
    ``done`` batches already trained: a resumed run)."""
    loader.set_epoch(number)
    return batch_ids(
        continue_epoch(loader, epoch=number, batches_done=done, num_processes=processes)
    )


def test_a_sampler_and_a_batch_sampler_order_by_seed_and_epoch_and_resume_exactly():
    """Whatever the global RNG: epoch e's batches are the same in every build, differ
    across epochs, a resume skips exactly the batches trained, two processes take
    alternate batches of the one order; debug=fast keeps the first batches drawn."""
    ids = TensorDataset(torch.arange(30))
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=3),
    )
    cases = {  # how to make each train loader; every one prepared afresh
        "sampler": lambda: {"sampler": WeightedRandomSampler(torch.linspace(0.1, 1, 30), 32)},
        "batch_sampler": lambda: {"batch_sampler": Buckets(torch.arange(30) % 7, 4)},
    }
    for name, given in cases.items():

        def build(given=given, **prepare):
            loaders = make_loaders(ids, ids, batch_size=4, seed=3, **given())
            if not prepare:
                return accelerator.prepare_data_loader(loaders.train)
            # a rank of two processes: what accelerate prepares on it
            return prepare_data_loader(
                loaders.train, **prepare, use_seedable_sampler=True, data_seed=3
            )

        torch.manual_seed(0)
        run = build()
        first, second = epoch(run, 0), epoch(run, 1)
        torch.manual_seed(1)  # a resumed process: its global RNG is elsewhere
        assert epoch(build(), 1, done=3) == second[3:], name
        assert first != second and sorted(map(sorted, first)) != sorted(map(sorted, second))
        assert epoch(build(), 0) == first
        if name == "batch_sampler":  # every batch of the sampler's own, sizes kept
            assert sorted(i for b in second for i in b) == list(range(30))
            assert sorted(map(len, second)) == [2, *[4] * 7], second
        # two processes: rank r trains batches r, r + 2, ... of the one order (even
        # counts here: 8 batches), also after a resume
        ranks = [build(num_processes=2, process_index=r) for r in range(2)]
        shards = [epoch(rank, 1, processes=2) for rank in ranks]
        # the checkpoint's position unit: samples per batch, or batches of any size
        assert [per_process_batch(r, n) for r, n in [(run, 1), (ranks[0], 2)]] == [
            4 if name == "sampler" else 1
        ] * 2
        assert [b for pair in zip(*shards, strict=True) for b in pair] == second, name
        resumed = build(num_processes=2, process_index=1)
        assert epoch(resumed, 1, done=2, processes=2) == shards[1][2:]

        # debug=fast: the first 2 batches drawn, the same samples every epoch
        raw = make_loaders(ids, ids, batch_size=4, seed=3, **given()).train
        cut = accelerator.prepare_data_loader(first_batches(raw, 2))
        kept = [sorted(i for b in epoch(cut, e) for i in b) for e in (0, 1)]
        assert kept[0] == kept[1] == sorted(first[0] + first[1]), name

    # a RandomSampler given is seeded by the same rule as the default shuffle
    default = accelerator.prepare_data_loader(make_loaders(ids, ids, batch_size=4, seed=3).train)
    given = make_loaders(ids, ids, batch_size=4, seed=3, sampler=RandomSampler(ids)).train
    assert epoch(accelerator.prepare_data_loader(given), 2) == epoch(default, 2)


def test_make_loaders_refuses_a_sampler_whose_order_it_cannot_keep(tmp_path):
    ids = TensorDataset(torch.arange(10))

    class GlobalShuffle(Sampler):  # draws from the global RNG: no generator, no set_epoch
        def __len__(self):
            return 10

        def __iter__(self):
            return iter(torch.randperm(10).tolist())

    cases = {
        "make_loaders(sampler=GlobalShuffle) is not allowed: its order would not be a "
        "function of (seed, epoch): a resumed run would not see the same batches": {
            "sampler": GlobalShuffle()
        },
        "make_loaders(sampler=DistributedSampler) is not allowed: accelerate shards": {
            "sampler": DistributedSampler(ids, num_replicas=2, rank=0)
        },
        "make_loaders(batch_sampler=generator) is not allowed: it has no __len__": {
            "batch_sampler": (b for b in [[0, 1]])
        },
        "make_loaders(sampler=..., batch_sampler=...) is not allowed": {
            "sampler": RandomSampler(ids),
            "batch_sampler": Buckets(torch.arange(10), 2),
        },
    }
    for message, given in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            make_loaders(ids, ids, batch_size=2, seed=0, **given)
    path = write_tokens(tmp_path / "ids.bin", np.arange(100), vocab_size=100)
    stream = TokenStream(str(path), 8, "uint16", seed=0, batch_size=2)
    with pytest.raises(ConfigError, match=r"a stream \(an IterableDataset\) has its own order"):
        make_loaders(stream, ids, batch_size=2, seed=0, sampler=RandomSampler(ids))


def test_a_collate_fn_making_dict_batches_trains_and_evaluates_as_tuples_do():
    """The same steps on dict batches (through 2 loader workers) as on the default
    tuples: bit-equal weights and evaluation; predict.py's dataset-order loader and
    evaluation's cut of a batch keep the dict and its ids."""
    images, labels = load_digits()
    data = TensorDataset(images.flatten(1), labels, torch.arange(len(labels)))
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=5),
    )
    outcome = {}
    for name, collate, workers in [("tuple", None, 0), ("dict", as_dict, 2)]:
        loaders = make_loaders(
            data, data, batch_size=64, seed=5, collate_fn=collate, num_workers=workers
        )
        assert loaders.val.collate_fn is loaders.train.collate_fn  # val's default
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model, optimizer, train, val = accelerator.prepare(
            model, optimizer, loaders.train, loaders.val
        )

        def loss(batch, name=name, model=model):
            x, y = (batch["pixels"], batch["label"]) if name == "dict" else batch[:2]
            return torch.nn.functional.cross_entropy(model(x), y)

        train.set_epoch(0)
        for batch in train:
            optimizer.zero_grad()
            accelerator.backward(loss(batch))
            optimizer.step()
        count = (lambda b: len(b["label"])) if name == "dict" else (lambda b: len(b[1]))
        means = average_over_batches(loss, val, accelerator, count)
        outcome[name] = (torch.cat([p.detach().flatten() for p in model.parameters()]), means)
    assert torch.equal(outcome["dict"][0], outcome["tuple"][0])
    assert outcome["dict"][1] == outcome["tuple"][1] and outcome["dict"][1]["loss"] < math.log(10)

    shuffled = make_loaders(data, data, batch_size=64, seed=5, collate_fn=as_dict).train
    ordered = [b["id"] for b in in_dataset_order(shuffled)]
    assert [i for ids in ordered for i in ids] == [f"s{i}" for i in range(len(labels))]
    batch = next(iter(shuffled))
    assert _length(batch) == 64 and _head(batch, 3)["id"] == batch["id"][:3]
    assert torch.equal(_head(batch, 3)["pixels"], batch["pixels"][:3])


def stream_starts(tmp_path: Path, *, num_workers: int, epoch: int, skip: int = 0) -> list[int]:
    """The first token of every training window of a stream over tokens 0..N-1
    (uint32, so a window's first token is its position: a sample id)."""
    path = write_tokens(tmp_path / "ids.bin", np.arange(5000), vocab_size=70_000)
    loaders = token_file(
        batch_size=4,
        seed=1,
        train_path=str(path),
        val_path=str(path),
        vocab_size=70_000,
        dtype="uint32",
        seq_len=8,
        windows="stream",
        num_workers=num_workers,
    )
    dataset = loaders.train.dataset
    dataset.set_epoch(epoch)
    dataset.skip_to(epoch, skip)
    starts = []
    for x, y in loaders.train:
        assert (x[:, 1:] == y[:, :-1]).all() and (y[:, -1] == x[:, -1] + 1).all()
        starts += x[:, 0].tolist()
    return starts


def test_a_token_stream_has_one_order_for_any_workers_and_continues_after_skip(tmp_path):
    epoch0 = stream_starts(tmp_path, num_workers=0, epoch=0)
    assert len(epoch0) == len(set(epoch0)) == (5000 - 8 - 1 - epoch0[0]) // 8 + 1
    assert all(b - a == 8 for a, b in itertools.pairwise(epoch0))  # file order
    assert stream_starts(tmp_path, num_workers=2, epoch=0) == epoch0  # workers share it
    epoch1 = stream_starts(tmp_path, num_workers=0, epoch=1)
    # each epoch its own offset below seq_len, from (seed, epoch): 3, then 4 for seed 1
    assert (epoch0[0], epoch1[0]) == (3, 4)
    # A resume 12 samples into epoch 1 reads the rest of it, from the 13th sample.
    assert stream_starts(tmp_path, num_workers=2, epoch=1, skip=12) == epoch1[12:]
    assert stream_starts(tmp_path, num_workers=0, epoch=0, skip=12) == epoch0[12:]


def test_a_large_token_file_is_read_without_loading_it(tmp_path):
    """~300 MB of uint16 tokens: building the loaders and reading 100 batches of
    random windows raises the process's resident memory by far less."""
    path = tmp_path / "big.bin"
    chunk = (np.arange(1 << 24) % 50_000).astype(np.uint16)  # 32 MiB
    with open(path, "wb") as f:
        for _ in range(9):
            chunk.tofile(f)
    path.with_suffix(".json").write_text(json.dumps({"vocab_size": 50_000, "dtype": "uint16"}))
    size = path.stat().st_size
    del chunk
    before = rss_bytes()
    loaders = token_file(
        batch_size=32, seed=0, train_path=str(path), val_path=str(path), vocab_size=50_000
    )
    read = 0
    for i, (x, _) in enumerate(loaders.train):
        read += x.numel()
        if i == 99:
            break
    grown = rss_bytes() - before
    print(
        f"token file {size / 2**20:.0f} MiB, read {read:,} tokens: RSS +{grown / 2**20:.1f} MiB "
        f"(now {rss_bytes() / 2**20:.0f} MiB, mapped files {rss_bytes('RssFile') / 2**20:.0f})"
    )
    assert len(loaders.train.dataset) == (size // 2 - 128 - 1) // 128 + 1
    assert grown < size / 20, (
        f"RSS grew by {grown / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file"
    )


# --- real runs of train.py ------------------------------------------------------------------


def test_token_file_trains_the_gpt_example(tmp_path):
    language = markov_language(64, 4, 0)
    for name, seed in [("train", 1), ("val", 2)]:
        tokens = copy_task_sequences(64, 65, language, seed).numpy().ravel()
        write_tokens(tmp_path / f"{name}.bin", tokens, vocab_size=64)
    run = run_train(
        tmp_path / "run",
        "data=token_file",
        f"data.train_path={tmp_path / 'train.bin'}",
        f"data.val_path={tmp_path / 'val.bin'}",
        *TINY_GPT,
        *FAST,
    )
    config = json.loads((run.run_dir / "config.json").read_text())
    assert config["data"]["vocab_size"] == config["model"]["vocab_size"] == 64  # from train.json
    assert config["data"]["dtype"] == "uint16"
    metrics = run.summary["metrics"]
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-6)
    assert metrics["val/ppl"] < 64  # better than a uniform guess over the vocabulary
    assert run.summary["best"]["name"] == "val/loss"  # model=gpt monitors the loss (min)
    assert run.summary["best"]["value"] == min(run.summary["best"]["value"], metrics["val/loss"])


def test_a_stream_with_preflight_on_trains_the_same_weights(tmp_path):
    """The defaults on (preflight's timed steps and checkpoint round trip, the
    checkpoints): preflight takes nothing from a stream that training then misses."""
    stream = [*TINY_GPT, "data=token_file", "data.windows=stream", "trainer.max_steps=20"]
    off = run_train(tmp_path / "off", *stream, "preflight=off")
    on = run_train(tmp_path / "on", *stream)
    assert (on.run_dir / "preflight.json").is_file()
    assert fingerprints(on.run_dir) == fingerprints(off.run_dir) != {}


def test_hf_trains_from_parquet_and_csv_and_names_the_columns_it_has(tmp_path):
    needs_datasets()
    import datasets

    images, labels = load_digits()
    pixels = images.reshape(len(labels), 64).numpy()
    table = datasets.Dataset.from_dict({"features": pixels.tolist(), "cls": labels.tolist()})
    table.to_parquet(str(tmp_path / "digits.parquet"))
    columns = {f"p{i}": pixels[:, i].tolist() for i in range(64)} | {"cls": labels.tolist()}
    datasets.Dataset.from_dict(columns).to_csv(str(tmp_path / "digits.csv"))
    (tmp_path / "cache").mkdir()  # datasets' cache here, not in ~/.cache
    common = ["data=hf", "data.targets=cls", f"data.cache_dir={tmp_path / 'cache'}", *FAST]

    parquet = run_train(
        tmp_path / "parquet",
        "data.format=parquet",
        f"data.train_files={tmp_path / 'digits.parquet'}",
        "data.inputs=features",
        *common,
    )
    assert parquet.summary["metrics"]["val/acc"] > 0.5  # chance is 0.1
    assert parquet.summary["best"]["name"] == "val/acc"  # classification keeps accuracy
    assert "val/ppl" not in parquet.summary["metrics"]
    # CSV: 64 columns stacked into the inputs; the same split gives the same result.
    csv = run_train(
        tmp_path / "csv",
        "data.format=csv",
        f"data.train_files={tmp_path / 'digits.csv'}",
        f"data.inputs=[{','.join(f'p{i}' for i in range(64))}]",
        *common,
    )
    learned = {k: v for k, v in parquet.summary["metrics"].items() if not k.startswith("perf/")}
    assert {k: csv.summary["metrics"][k] for k in learned} == pytest.approx(learned, abs=1e-6)

    wrong = run_train(
        tmp_path / "wrong",
        "data.format=parquet",
        f"data.train_files={tmp_path / 'digits.parquet'}",
        "data.inputs=pixels",
        *common,
        check=False,
    )
    assert wrong.proc.returncode == 2, wrong.output[-3000:]
    assert "data.inputs='pixels' is not allowed" in wrong.output
    assert "it has: features, cls" in wrong.output
    assert not (tmp_path / "wrong").exists()  # refused before any work, nothing left


def test_a_stream_refuses_what_needs_an_epoch_length(tmp_path):
    """No trainer.max_steps, or checkpoints every N epochs: exit 2 naming the key."""
    stream = [*TINY_GPT, "data=token_file", "data.windows=stream", *FAST]
    cases = {
        "trainer.max_steps=None is not allowed": ["trainer.max_steps=null"],
        "checkpoint.every_n_epochs=1 is not allowed": [
            "trainer.max_steps=5",
            "checkpoint.every_n_epochs=1",
        ],
    }
    for i, (message, overrides) in enumerate(cases.items()):
        refused = run_train(tmp_path / str(i), *stream, *overrides, check=False)
        assert refused.proc.returncode == 2, refused.output[-3000:]
        assert message in refused.output
        assert not (tmp_path / str(i) / "checkpoints").exists()  # nothing saved


@pytest.mark.multiprocess
@pytest.mark.parametrize("processes", [1, 2])
def test_a_stream_resumed_after_kill_9_trains_on_the_same_samples(processes, tmp_path, monkeypatch):
    """data.windows=stream (an IterableDataset): a run killed -9 in the save of step
    20 trained, in its first 20 steps and its resume together, on exactly the
    windows of the stream's first 30 global batches, each once; one process: the
    final weights equal an uninterrupted run's."""
    batch, seq_len = 8, 16  # per process (TINY_GPT)
    assets = PROJECT_ROOT / "src" / "digit_trainer" / "data" / "assets"
    train_path = assets / "tokens_train.bin"
    args = [
        *TINY_GPT,
        "data=token_file",
        "data.windows=stream",
        # explicit: ${project_root:} is engine_tests/ under engine_tests/train_with_faults.py
        f"data.train_path={train_path}",
        f"data.val_path={assets / 'tokens_val.bin'}",
        "model._target_=engine_tests.faults.RecordsWindows",
        *FAST,
        "trainer.max_steps=30",
        "checkpoint.every_n_steps=10",
        *(["parallel=ddp", "parallel.cpu_processes=2"] if processes == 2 else []),
    ]
    # What an uninterrupted run trains on: the stream's first 30 global batches
    # (every process's micro-batch of a step comes from the one stream, in order).
    stream = TokenStream(str(train_path), seq_len, "uint16", seed=42, batch_size=batch)
    windows = [x for x, _ in itertools.islice(iter(stream), 30 * batch * processes)]
    expected = sorted(sample_hash(x) for x in windows)
    assert len(set(expected)) == len(expected)  # no window twice

    def seen(log_dir: Path, steps: int | None = None) -> list[str]:
        files = sorted(log_dir.glob("*.txt"))
        assert len(files) == processes  # one per training process
        lines = [f.read_text().splitlines() for f in files]
        return [h for part in lines for h in (part if steps is None else part[: steps * batch])]

    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])  # engine_tests.faults in every process
    for part in ("ref", "first", "second"):
        (tmp_path / part).mkdir()
    run = tmp_path / "run"
    monkeypatch.setenv("SAMPLE_LOG", str(tmp_path / "first"))
    kill_when_paused(run, "before_pointers", 20, *args)
    monkeypatch.setenv("SAMPLE_LOG", str(tmp_path / "second"))
    resumed = run_train(run, *args)
    assert resumed.summary["resumed_from"] == str(ckpt_dir(run, 20))
    assert "not made a function" not in resumed.output  # TokenStream: draws_at_random = False
    assert sorted(seen(tmp_path / "first", steps=20) + seen(tmp_path / "second")) == expected
    if processes == 1:  # and bit-exact: the same weights as without the kill
        monkeypatch.setenv("SAMPLE_LOG", str(tmp_path / "ref"))
        ref = run_train(tmp_path / "ref_run", *args)
        assert sorted(seen(tmp_path / "ref")) == expected
        assert fingerprints(run) == fingerprints(ref.run_dir)
