"""The ``parallel`` group: processes, nodes and devices, and the options of each mode
(configs/parallel/: none, ddp, fsdp, deepspeed; docs/parallel.md). One schema for
every mode: a key of another mode keeps its default and is not read."""

# setting() and section() return dataclasses.field()s: no call shares a default.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import ListConfig

from .fields import BOOL, SECONDS, Check, Section, either, ints, is_int, one_of, setting

PARALLEL_MODES = ("none", "ddp", "fsdp", "deepspeed")


def _class_names(v: Any) -> bool:
    if v is None:
        return True
    listed = isinstance(v, list | tuple | ListConfig) and bool(v)
    return listed and all(isinstance(n, str) and n.isidentifier() for n in v)


@dataclass(repr=False, eq=False)
class Parallel(Section):
    """How many processes train, on how many nodes, and how the model is split."""

    KEY = "parallel"
    mode: str = setting("none", "none | ddp | fsdp | deepspeed", one_of(*PARALLEL_MODES))
    num_processes: int | str = setting(
        1,
        "per node; auto: the visible GPUs, else cpu_processes",
        Check(
            lambda v: v == "auto" or (is_int(v) and v >= 1),
            "auto or an integer >= 1 (processes per node)",
        ),
    )
    cpu_processes: int = setting(
        2, "what auto means on a machine without GPUs", ints(1, "what auto means without GPUs")
    )
    num_nodes: int = setting(1, "multi-node: run the same command on every node ...", ints(1))
    node_rank: int = setting(0, "... with its own node_rank", ints(0, "below parallel.num_nodes"))
    master_addr: str = setting("127.0.0.1", "node 0's address, reachable from every node")
    master_port: int | None = setting(
        None,
        "null: a free port (single node only); set it for multi-node",
        Check(
            lambda v: v is None or (is_int(v) and 1 <= v <= 65535),
            "null or a port number in 1..65535",
        ),
    )
    backend: str = setting(
        "auto", "auto: nccl on GPUs, gloo on CPU", either("auto", "gloo", "nccl")
    )
    timeout_s: float = setting(
        600, "a collective that waits longer fails the run (until the first step)", SECONDS
    )
    max_restarts: int = setting(
        2,
        "in-job restarts of the group after a worker died or hung (docs/recovery.md)",
        ints(0, "in-job restarts"),
    )
    find_unused_parameters: bool = setting(False, "DDP: parameters a step may leave unused", BOOL)
    # fsdp
    wrap_classes: list[str] | None = setting(
        None,
        "fsdp: class names of the blocks, e.g. [Block]; null: found (training_engine/fsdp.py)",
        Check(_class_names, "null or a list of class names, e.g. [Block]"),
    )
    auto_wrap_min_params: int = setting(
        100000, "fsdp, no repeated blocks: submodules of this many parameters become units", ints(1)
    )
    reshard_after_forward: bool = setting(
        True, "fsdp: free gathered parameters after forward (ZeRO-3-like); false: keep them", BOOL
    )
    cpu_offload: bool = setting(
        False, "fsdp: sharded parameters and optimizer state in CPU memory (GPUs)", BOOL
    )
    activation_checkpointing: bool = setting(
        False, "fsdp: recompute each block's forward in backward (less memory)", BOOL
    )
    # deepspeed
    zero_stage: int = setting(
        2,
        "deepspeed: 1 shards optimizer state, 2 + gradients, 3 + parameters",
        one_of(0, 1, 2, 3),
    )
    offload_optimizer: str = setting(
        "none",
        "deepspeed: none | cpu (optimizer state and step in CPU memory)",
        either("none", "cpu"),
    )
    offload_params: str = setting(
        "none",
        "deepspeed: none | cpu (parameters in CPU memory; zero_stage 3)",
        either("none", "cpu"),
    )
    zero3_init: bool = setting(
        False,
        "deepspeed: true builds the model already partitioned (other draws than the seed's model)",
        BOOL,
    )

    @classmethod
    def cross_problems(cls, values: Any) -> list[str]:
        found = []
        node_rank, num_nodes = values.node_rank, values.num_nodes
        if is_int(node_rank) and is_int(num_nodes) and num_nodes >= 1 and node_rank >= num_nodes:
            found.append(
                f"parallel.node_rank={node_rank} is not allowed: expected 0..{num_nodes - 1} "
                f"(parallel.num_nodes={num_nodes})"
            )
        if is_int(num_nodes) and num_nodes > 1 and values.master_port is None:
            found.append(
                f"parallel.master_port=None is not allowed with parallel.num_nodes={num_nodes}: "
                "every node must name the same port (e.g. parallel.master_port=29500)"
            )
        return found
