"""Pins of what training_engine/upstream.py relies on in accelerate, torch, transformers and
Hydra beyond their promises: an upgrade that changes one fails here, by name, rather
than in a run. In-process, except the accelerate state switch (its state is a
process-wide singleton: a child process keeps it away from the other tests)."""

import subprocess
import sys
import textwrap
from importlib.util import find_spec

import pytest
import torch
from torch import nn

from training_engine import upstream

from .conftest import ENV, PROJECT_ROOT


def test_accelerate_takes_the_fsdp_state_switch_and_an_already_sharded_model():
    """accel.py's one-process/CPU FSDP: after the switch accelerate reports FSDP2 and
    prepare() returns a model fully_shard already sharded as it is (fsdp.py shards it)."""
    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from training_engine import upstream

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="no_wrap")
        acc = Accelerator(cpu=True, fsdp_plugin=plugin)
        upstream.switch_accelerate_to_fsdp(plugin)
        assert acc.distributed_type == DistributedType.FSDP and acc.is_fsdp2
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model)
        prepared, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert prepared is model and isinstance(prepared, FSDPModule)
        print("PINNED")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=PROJECT_ROOT, env=ENV, capture_output=True,
        text=True, timeout=180,
    )  # fmt: skip
    assert "PINNED" in proc.stdout, proc.stderr[-3000:]


def test_accelerates_per_step_package_check_is_cached_once():
    import accelerate.optimizer

    upstream.cache_lomo_check()
    check = accelerate.optimizer.is_lomo_available
    assert hasattr(check, "cache_info") and check() == check.__wrapped__()
    upstream.cache_lomo_check()  # idempotent: the same cached function
    assert accelerate.optimizer.is_lomo_available is check


def test_accelerates_optimizer_wrapper_zero_grad_only_zeroes_the_inner_one():
    from accelerate import Accelerator

    model = nn.Linear(3, 1)
    wrapped = Accelerator(cpu=True).prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    assert upstream.is_plain_accelerated_optimizer(wrapped)
    model(torch.ones(2, 3)).sum().backward()
    wrapped.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    assert not upstream.is_plain_accelerated_optimizer(torch.optim.SGD(model.parameters(), 0.1))


def test_torchs_checkpoint_wrapper_keeps_the_forward_and_its_name_prefix():
    """fsdp.py wraps blocks; checkpoint/ties.py strips this prefix from names."""
    from training_engine.checkpoint import ties

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    wrapped = upstream.checkpoint_wrapper(block)
    x = torch.randn(2, 4)
    torch.manual_seed(1)
    expected = block(x)
    torch.manual_seed(1)
    assert torch.equal(wrapped(x), expected)
    outer = nn.Sequential(wrapped)  # a model holding a wrapped block names its prefix
    assert all(ties.AC_PREFIX in name for name, _ in outer.named_parameters())


def test_dcps_safetensors_consolidation_writes_one_file_of_every_tensor(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    shards = tmp_path / "shards"
    dcp.save(
        {k: v.clone() for k, v in state.items()},
        storage_writer=HuggingFaceStorageWriter(str(shards), save_distributed=True),
    )
    out = tmp_path / "out"
    out.mkdir()
    name = upstream.consolidate_safetensors(str(shards), str(out), sorted(state))
    loaded = load_file(out / name)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


@pytest.mark.skipif(find_spec("transformers") is None, reason="the hf extra")
def test_transformers_names_its_decoder_layers():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16))
    assert upstream.no_split_modules(model) == {"GPT2Block"}
    assert upstream.no_split_modules(nn.Linear(2, 2)) == set()


def test_torch_compile_keeps_the_original_module():
    model = nn.Linear(2, 2)
    assert upstream.compiled_original(torch.compile(model)) is model  # not compiled until run
    assert upstream.compiled_original(model) is None


def test_hydra_job_returns_give_a_failed_jobs_exception():
    from hydra.core.utils import JobReturn, JobStatus

    ret = JobReturn()
    ret.status, ret._return_value = JobStatus.FAILED, ValueError("boom")
    assert isinstance(upstream.job_result(ret), ValueError)
    with pytest.raises(ValueError, match="boom"):
        ret.return_value  # noqa: B018 (the public property raises instead)


def test_accelerates_prepared_loader_says_how_much_of_its_last_batch_is_real():
    """batch_means.py drops the samples a distributed sampler repeats with these."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    loader = Accelerator(cpu=True).prepare(DataLoader(TensorDataset(torch.arange(7)), batch_size=2))
    seen = [(len(b[0]), loader.end_of_dataloader, loader.remainder) for b in loader]
    assert seen[-1] == (1, True, 1) and not any(end for _, end, _ in seen[:-1])


def test_accelerate_starts_the_tracker_objects_it_was_given_as_they_are_then():
    """tracking.start_trackers sets where a resumed run continues on the objects of
    ``log_with`` (upstream.tracker_objects), then ``init_trackers`` starts those objects."""
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker

    class Probe(GeneralTracker):
        name, requires_logging_directory, main_process_only = "probe", False, True

        def __init__(self) -> None:
            super().__init__()
            self.resumed_at, self.started_with = None, None

        @property
        def tracker(self) -> None:
            return None

        def start(self) -> None:
            self.started_with = self.resumed_at

        def store_init_configuration(self, values: dict) -> None:
            pass

    probe = Probe()
    accelerator = Accelerator(cpu=True, log_with=[probe])
    [found] = upstream.tracker_objects(accelerator)
    assert found is probe
    found.resumed_at = 7
    accelerator.init_trackers("pin")
    assert accelerator.trackers == [probe] and probe.started_with == 7
