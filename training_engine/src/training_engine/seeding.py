"""One seed for python, numpy, torch, every rank and every data-loader worker."""

import contextlib
import os
import random
from collections.abc import Iterator

import numpy as np
import torch
from accelerate.utils import set_seed


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed every global RNG; offset by the process index so ranks differ.

    Call it after the Accelerator exists (it reads the process index). The data
    order does not come from these RNGs: it comes from a dedicated generator
    seeded per epoch (see ``data.py``), so it is the same on every rank and
    reproducible on resume. It also pins the CPU thread count (``pin_cpu_threads``).
    """
    pin_cpu_threads()
    if deterministic:
        # Must be set before the first cuBLAS call; harmless on CPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    set_seed(seed, device_specific=True, deterministic=deterministic)


def pin_cpu_threads(num_threads: int | None = None) -> int:
    """Fix the intra-op thread count for the whole run; return it.

    On a CPU the bits of a matmul or a large sum depend on how many threads
    split it (the MLP's last weight gradient already differs between 1 and 2
    threads). torch turns MKL's dynamic threading off (MKL_DYNAMIC, under which
    MKL may use fewer threads than asked) only when ``torch.set_num_threads``
    is called, and Intel's reproducibility conditions need it off and a fixed
    count. The count itself comes from the CPUs the process may use at start-up
    (``OMP_NUM_THREADS``, taskset, a cgroup or SLURM allocation): same seed +
    same machine + same count = the same bits; another count, other bits.
    """
    count = num_threads or torch.get_num_threads()
    torch.set_num_threads(count)
    return count


def seed_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: derive python/numpy seeds from torch's.

    torch seeds each worker with ``base_seed + worker_id``, where ``base_seed``
    is drawn from the loader's own generator, so workers are reproducible too.
    """
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


@contextlib.contextmanager
def same_on_every_rank(seed: int) -> Iterator[None]:
    """Run the block (model construction) with torch's RNG seeded by ``seed``
    alone, then restore the per-rank RNG. Every rank builds the same initial
    weights, whatever the parallel mode: DDP would broadcast rank 0's anyway,
    but FSDP shards each rank's own copy."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
