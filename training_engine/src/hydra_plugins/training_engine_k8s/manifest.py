"""The Kubeflow Trainer v2 manifests of one run: a ``TrainJob`` and the namespaced
``TrainingRuntime`` it runs on (API ``trainer.kubeflow.org/v1alpha1``, Trainer v2.3).

Why a runtime of our own: the restart limit (JobSet's ``failurePolicy.maxRestarts``)
exists only on a (Cluster)TrainingRuntime, never on the TrainJob. So each job gets a
runtime shaped like Trainer's ``torch-distributed`` (a replicated job ``node`` whose
container ``node`` the torch plugin gives the ``PET_*`` variables), plus what this
project needs in every pod: the runs volume (a PVC), shared memory, the image's
non-root user, a grace period to save on SIGTERM, and ``backoffLimit: 0`` so that
a failed pod fails its Job and JobSet restarts every pod together (counted against
``maxRestarts``) instead of the Job re-creating one pod behind the others' backs.

Pure functions of plain values; ``launcher.py`` feeds them the run's config.
"""

import re
from collections.abc import Mapping
from typing import Any

import yaml

API_VERSION = "trainer.kubeflow.org/v1alpha1"
API_GROUP = "trainer.kubeflow.org"
# The torch runtime's rendezvous: node 0's pod (JobSet's hostname for job `node`,
# index 0, pod 0, under the headless service named like the job) on this port
# (Trainer's pkg/constants: ContainerTrainerPort).
MASTER_PORT = 29400
# The Dockerfile's user (useradd --uid): the pods run as it, the volume is its group's.
IMAGE_USER_ID = 10001
# What the torch runtime sets itself; a TrainJob that sets one is refused.
RESERVED_ENV = (
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
)
# torchrun's agent gives its workers this long to stop after passing SIGTERM on
# (default 30 s): the pod's grace period less a margin for the agent's own exit.
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
SHUTDOWN_MARGIN_S = 10

# Kubernetes' own formats (apimachinery validation; resource.Quantity).
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # RFC 1035: TrainJob names
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
RESOURCE_NAME = re.compile(
    r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
# The pod names JobSet derives (<job>-node-<i>-<j>, at most 63 characters) must fit.
MAX_NAME = 50


def _quantity(v: Any) -> bool:
    return (
        isinstance(v, str | int | float)
        and not isinstance(v, bool)
        and bool(QUANTITY.match(str(v)))
    )


def _int_at_least(low: int) -> Any:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _env(v: Any) -> bool:
    return isinstance(v, Mapping) and all(
        isinstance(k, str) and ENV_NAME.match(k) and k not in RESERVED_ENV for k in v
    )


# An image reference as the OCI distribution spec writes it: [host[:port]/]path[:tag][@digest]
# (lowercase path components; a tag of at most 128 characters; nothing else: no spaces,
# no newlines).
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = rf"{_LABEL}(?:\.{_LABEL})*"
IMAGE = re.compile(
    rf"(?:{_HOST}(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,})?"
)


def image_reference(v: Any) -> bool:
    return isinstance(v, str) and IMAGE.fullmatch(v) is not None


# hydra.launcher.<key>: the check, and what is allowed (configs/hydra/launcher/k8s.yaml).
RULES = {
    "image": (image_reference, "an image reference, e.g. registry.example.com/team/trainer:1.0"),
    "namespace": (
        lambda v: v is None or (isinstance(v, str) and len(v) <= 63 and DNS_LABEL.match(v)),
        "null (kubectl's current namespace) or a namespace name",
    ),
    "job_name": (
        lambda v: v is None or (isinstance(v, str) and len(v) <= MAX_NAME and DNS_LABEL.match(v)),
        f"null or a DNS label of at most {MAX_NAME} characters (a-z, 0-9, -; a letter first)",
    ),
    "gpus_per_node": (_int_at_least(0), "an integer >= 0"),
    "gpu_resource": (
        lambda v: isinstance(v, str) and RESOURCE_NAME.match(v),
        "an extended resource name such as nvidia.com/gpu",
    ),
    "cpus_per_node": (lambda v: v is None or _quantity(v), "null or a CPU quantity (8, 7500m)"),
    "memory_per_node": (lambda v: v is None or _quantity(v), "null or a memory quantity (64Gi)"),
    "shm_size": (lambda v: v is None or _quantity(v), "null or a memory quantity (16Gi)"),
    "runs_claim": (
        lambda v: isinstance(v, str) and len(v) <= 253 and DNS_SUBDOMAIN.match(v),
        "the name of a PersistentVolumeClaim (a-z, 0-9, -, .)",
    ),
    "runs_mount": (
        lambda v: (
            isinstance(v, str) and v.startswith("/") and v.rstrip("/") not in ("", "/dev/shm")
        ),
        "an absolute path other than / and /dev/shm",
    ),
    "env": (_env, f"a mapping of variable names (none of {', '.join(RESERVED_ENV)}) to values"),
    "max_restarts": (_int_at_least(0), "an integer >= 0"),
    "stop_grace_s": (
        _int_at_least(30),
        f"an integer >= 30 (seconds; the workers get {SHUTDOWN_MARGIN_S} s less to save)",
    ),
    "apply": (lambda v: isinstance(v, bool), "true or false"),
}


def option_problems(options: Mapping[str, Any]) -> list[str]:
    """``hydra.launcher.KEY=VALUE is not allowed: expected ...`` for each bad option."""
    problems = []
    for key, (ok, allowed) in RULES.items():
        value = options.get(key)
        if not ok(value):
            problems.append(f"hydra.launcher.{key}={value!r} is not allowed: expected {allowed}")
    return problems


def master_addr(name: str) -> str:
    """PET_MASTER_ADDR in the pods of TrainJob ``name`` (Trainer's torch plugin)."""
    return f"{name}-node-0-0.{name}"


def pod_env(
    name: str, *, num_nodes: int, procs_per_node: int, node_rank: int = 0
) -> dict[str, str]:
    """The PET_* variables the torch runtime gives node ``node_rank`` of this job."""
    return {
        "PET_NNODES": str(num_nodes),
        "PET_NPROC_PER_NODE": str(procs_per_node),
        "PET_NODE_RANK": str(node_rank),
        "PET_MASTER_ADDR": master_addr(name),
        "PET_MASTER_PORT": str(MASTER_PORT),
    }


def env_list(options: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The container's environment: ours, then hydra.launcher.env (which wins).
    A value that is a mapping is a ``valueFrom`` (e.g. ``{secretKeyRef: {name, key}}``)."""
    grace = options["stop_grace_s"]
    merged: dict[str, Any] = {SHUTDOWN_TIMEOUT_ENV: str(grace - SHUTDOWN_MARGIN_S)}
    merged.update(options["env"])
    return [
        {"name": k, "valueFrom": dict(v)}
        if isinstance(v, Mapping)
        else {"name": k, "value": _text(v)}
        for k, v in merged.items()
    ]


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def resources(options: Mapping[str, Any]) -> dict[str, Any]:
    """resourcesPerNode: GPUs as a limit (extended resources), memory requested and
    capped (it includes /dev/shm), CPUs requested."""
    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    if options["gpus_per_node"]:
        limits[options["gpu_resource"]] = options["gpus_per_node"]
    if options["memory_per_node"] is not None:
        limits["memory"] = requests["memory"] = str(options["memory_per_node"])
    if options["cpus_per_node"] is not None:
        requests["cpu"] = str(options["cpus_per_node"])
    return {k: v for k, v in (("limits", limits), ("requests", requests)) if v}


def _metadata(name: str, options: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if options["namespace"]:
        meta["namespace"] = options["namespace"]
    return {**meta, **extra}


def training_runtime(name: str, options: Mapping[str, Any], *, num_nodes: int) -> dict[str, Any]:
    """The TrainingRuntime of job ``name``: Trainer's torch-distributed shape, plus
    the restart limit, the volumes and the pod's user and grace period."""
    volumes: list[dict[str, Any]] = [
        {"name": "runs", "persistentVolumeClaim": {"claimName": options["runs_claim"]}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "runs", "mountPath": options["runs_mount"]}]
    if options["shm_size"] is not None:  # the default /dev/shm (64 MB) starves DataLoader workers
        volumes.append(
            {
                "name": "dshm",
                "emptyDir": {"medium": "Memory", "sizeLimit": str(options["shm_size"])},
            }
        )
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    pod = {
        "terminationGracePeriodSeconds": options["stop_grace_s"],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": IMAGE_USER_ID,
            "runAsGroup": IMAGE_USER_ID,
            "fsGroup": IMAGE_USER_ID,  # the runs volume becomes writable by the image's user
        },
        "containers": [{"name": "node", "image": options["image"], "volumeMounts": mounts}],
        "volumes": volumes,
    }
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainingRuntime",
        "metadata": _metadata(name, options, labels={f"{API_GROUP}/framework": "torch"}),
        "spec": {
            "mlPolicy": {"numNodes": num_nodes, "torch": {}},
            "template": {
                "spec": {
                    "failurePolicy": {"maxRestarts": options["max_restarts"]},
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "template": {
                                "metadata": {
                                    "labels": {f"{API_GROUP}/trainjob-ancestor-step": "trainer"}
                                },
                                "spec": {"backoffLimit": 0, "template": {"spec": pod}},
                            },
                        }
                    ],
                }
            },
        },
    }


def train_job(
    name: str,
    options: Mapping[str, Any],
    *,
    command: list[str],
    num_nodes: int,
    procs_per_node: int,
) -> dict[str, Any]:
    """The TrainJob ``name`` on the runtime of the same name."""
    trainer: dict[str, Any] = {
        "image": options["image"],
        "command": command,
        "env": env_list(options),
        "numNodes": num_nodes,
        "numProcPerNode": procs_per_node,
    }
    if resources(options):
        trainer["resourcesPerNode"] = resources(options)
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": _metadata(name, options),
        "spec": {
            "runtimeRef": {"name": name, "apiGroup": API_GROUP, "kind": "TrainingRuntime"},
            "trainer": trainer,
        },
    }


def render(docs: list[dict[str, Any]]) -> str:
    """One YAML file for ``kubectl apply -f``: the documents in order."""
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)
