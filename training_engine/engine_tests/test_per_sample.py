"""Each sample's random draws a function of (seed, epoch, index) (per_sample.py):
augmentation that draws from the global RNGs (kornia's affine and crop from torch's,
pixel noise from numpy's, a brightness from python's) resumes bit-exactly after
kill -9 mid-epoch, on 1 and 2 processes, with 0 and 2 loader workers."""

import logging
import random

import numpy as np
import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from training_engine.debug import first_batches
from training_engine.loaders import continue_epoch, make_loaders
from training_engine.per_sample import exact_loader, sample_seed

from .conftest import ENV, FAST, fingerprints, run_train
from .test_checkpoint import ckpt_dir, kill_when_paused

pytest.importorskip("kornia", reason="the vision extra (kornia) is part of the dev install")

from .user_code import AugmentedDigits


class Tagged(AugmentedDigits):
    """AugmentedDigits whose sample also names its index and the epoch its copy was
    told (a worker's copy included)."""

    def __getitem__(self, index):
        image, label = super().__getitem__(index)
        return image, label, index, -1 if self.epoch is None else self.epoch


def tagged_loaders(workers: int):
    images = torch.rand(40, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(40) % 10
    data = Tagged(images, labels)
    return make_loaders(
        data, TensorDataset(images, labels), batch_size=4, seed=3, num_workers=workers
    )


def drawn(*, workers: int, processes: int, epochs=(0, 1), done: int = 0, cut: bool = False):
    """{(epoch, index): (image, epoch the dataset was told)} over every process's shard;
    the first 5 batches of each epoch after ``done`` skipped ones."""
    seen = {}
    for rank in range(processes):
        loader = tagged_loaders(workers).train
        if cut:  # debug=fast: the first batches, a Subset of the dataset
            loader = first_batches(loader, 3)
        loader = exact_loader(loader, 3, what="train")
        rules = {"use_seedable_sampler": True, "data_seed": 3}
        if processes == 1:
            loader = Accelerator(
                cpu=True, dataloader_config=DataLoaderConfiguration(**rules)
            ).prepare_data_loader(loader)
        else:
            loader = prepare_data_loader(
                loader, num_processes=processes, process_index=rank, put_on_device=False, **rules
            )
        for epoch in epochs:
            loader.set_epoch(epoch)
            batches = continue_epoch(
                loader, epoch=epoch, batches_done=done, num_processes=processes
            )
            for number, (images, _, indices, told) in enumerate(batches):
                if number == 5:
                    break
                for image, index, t in zip(images, indices.tolist(), told.tolist(), strict=True):
                    seen[(epoch, index)] = (image, t)
    return seen


def test_each_sample_draws_the_same_whatever_the_processes_workers_and_resume_point():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    state = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    base = drawn(workers=0, processes=1)
    # the main process's RNGs are the training step's: fetching never moves them
    assert torch.equal(state[0], torch.get_rng_state()) and state[1] == random.getstate()
    assert np.array_equal(state[2], np.random.get_state()[1])
    setups = {
        "2 workers": drawn(workers=2, processes=1),
        "2 processes": drawn(workers=0, processes=2),
        "2 processes, 2 workers": drawn(workers=2, processes=2),
        "resumed after 2 batches": drawn(workers=2, processes=1, done=2),
    }
    for name, samples in setups.items():
        common = set(samples) & set(base)
        assert len(common) >= 8, name
        for key in common:
            assert torch.equal(samples[key][0], base[key][0]), (name, key)
        # the dataset is told the epoch in the process that fetches (a worker's copy)
        assert {told for (epoch, _), (_, told) in samples.items() if epoch == 1} == {1}, name
    # augmentation differs between epochs, and between samples
    both = {i for (e, i) in base if e == 0} & {i for (e, i) in base if e == 1}
    assert both and all(not torch.equal(base[(0, i)][0], base[(1, i)][0]) for i in both)
    # debug=fast's Subset: the epoch still reaches the dataset, also in workers
    cut = drawn(workers=2, processes=1, cut=True)
    assert {told for (e, _), (_, told) in cut.items()} == {0, 1}
    assert len({sample_seed(42, e, i) for e in range(3) for i in range(1000)}) == 3000


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(8)


class Positions(Stream):
    draws_at_random = False  # its samples follow from their position alone


def test_a_stream_is_left_as_it_is_with_one_warning_unless_it_declares_no_draws(caplog):
    for dataset, warned in [(Stream(), True), (Positions(), False)]:
        caplog.clear()
        loader = torch.utils.data.DataLoader(dataset, batch_size=2)
        with caplog.at_level(logging.WARNING, logger="training_engine.per_sample"):
            assert exact_loader(loader, 0, what="train") is loader
        assert ("not made a function of (seed, epoch, index)" in caplog.text) is warned
    # plain tensor rows draw nothing: no per-sample cost
    rows = torch.utils.data.DataLoader(TensorDataset(torch.arange(4)), batch_size=2)
    assert exact_loader(rows, 0, what="train") is rows


class Plain(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.rand(1) + index


def test_a_collate_and_a_dataset_draw_exactly_and_keep_the_dataset_attributes():
    def mixup(samples):  # a batch-level draw from the global RNG
        return torch.stack(samples) * torch.rand(1)

    loader = torch.utils.data.DataLoader(Plain(), batch_size=2, collate_fn=mixup)
    loader.dataset.classes = ["a", "b"]
    exact = exact_loader(loader, 5, what="train")
    assert exact.dataset.classes == ["a", "b"]
    first, again = list(exact), list(exact)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


# --- kill -9 mid-epoch, then resume: bit-exact ----------------------------------------------

AUGMENTED = [
    "data._target_=engine_tests.user_code.augmented_digits",
    *FAST,
    "checkpoint.every_n_steps=10",
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("processes", [1, 2])
def test_augmented_data_resumes_bit_exactly_after_kill_9_with_and_without_workers(
    processes, tmp_path, monkeypatch
):
    """A run killed -9 in the save of step 20 (mid-epoch: 23 batches an epoch on one
    process, 12 on two), then resumed, ends with the weights of an uninterrupted
    run, with 0 and with 2 loader workers; and 2 workers train exactly as 0 do."""
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])  # engine_tests.user_code
    ddp = ["parallel=ddp", "parallel.cpu_processes=2"] if processes == 2 else []
    ref = run_train(tmp_path / "ref", *AUGMENTED, *ddp, "data.num_workers=0")
    for workers in (0, 2):
        run = tmp_path / f"workers{workers}"
        args = [*AUGMENTED, *ddp, f"data.num_workers={workers}"]
        kill_when_paused(run, "before_pointers", 20, *args)
        resumed = run_train(run, *args)
        assert resumed.summary["resumed_from"] == str(ckpt_dir(run, 20))
        assert fingerprints(run) == fingerprints(ref.run_dir), f"{workers} workers"
