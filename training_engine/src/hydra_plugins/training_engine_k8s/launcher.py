"""A Hydra launcher that writes each job as a Kubeflow Trainer v2 TrainJob.

``python train.py hydra/launcher=k8s parallel=fsdp parallel.num_nodes=2 ...``
(configs/hydra/launcher/k8s.yaml; ``-m`` works the same, and a sweep gives one
TrainJob per job): composes each job's config, checks it as its pods will see it
(the ``PET_*`` variables of the torch runtime adopted, exactly as in a pod), and
writes ``trainjob.yaml`` into the job's directory under ``hydra.sweep.dir``.
Nothing is submitted unless ``hydra.launcher.apply=true`` (``kubectl apply -f``).

Every pod runs ``torchrun train.py <the job's overrides> run_name=NAME
runs_root=<the PVC's mount>``: torchrun takes its nodes, node rank and rendezvous
from the ``PET_*`` variables, and every node names the same run directory on the
shared volume (``NAME``: the job's name unless ``run_name`` was given), so a
restarted pod resumes the run. The jobs run in the cluster: their results are not
reported back here (the sweep summary lists them as unfinished).
"""

import copy
import logging
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobRuntime, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from . import manifest

log = logging.getLogger(__name__)

MANIFEST = "trainjob.yaml"
# Set in every pod's command by this launcher: any given by the job is replaced.
POD_KEYS = ("run_name", "runs_root")
RUN_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$"


class KubernetesLauncher(Launcher):
    def __init__(self, **options: Any) -> None:
        self.options = options
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        from training_engine.config import ConfigError

        assert self.config is not None
        # From the full config: interpolations in the options resolve as anywhere else
        options = OmegaConf.to_container(self.config.hydra.launcher, resolve=True)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        try:
            problems = manifest.option_problems(options)
            if options.get("apply") and shutil.which("kubectl") is None:
                problems.append("hydra.launcher.apply=true needs kubectl on PATH")
            if problems:
                raise ConfigError("; ".join(problems))
            many = len(job_overrides) > 1 or initial_job_idx > 0
            jobs = [
                self._plan(list(overrides), initial_job_idx + i, options, many=many)
                for i, overrides in enumerate(job_overrides)
            ]
        except ConfigError as err:  # before anything is written (Hydra made the sweep dir)
            _remove_if_only_multirun_yaml(sweep_dir, stop=Path(self.config.runs_root))
            log.error(str(err))
            sys.exit(err.exit_code)
        returns = [self._write(job, options) for job in jobs]
        if not options["apply"]:
            files = " ".join(str(job["dir"] / MANIFEST) for job in jobs)
            log.info(f"submit with: kubectl apply -f {files}")
        return returns

    def _plan(
        self, overrides: list[str], num: int, options: dict[str, Any], *, many: bool
    ) -> dict[str, Any]:
        """One job: its config composed and checked as its pods will see it, its
        TrainJob's name and command, its manifests. Raises ConfigError."""
        from training_engine.config import ConfigError, check_config, resolve_config
        from training_engine.launch import adopt_pet_env
        from training_engine.run_dir import launch_stamp

        assert self.hydra_context is not None and self.config is not None
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = f"k8s_{num}"
            sweep_config.hydra.job.num = num
        HydraConfig.instance().set_config(sweep_config)
        with read_write(sweep_config), open_dict(sweep_config):
            task_cfg = copy.deepcopy(sweep_config)
            del task_cfg["hydra"]
        cfg = resolve_config(task_cfg)

        name = job_name(options["job_name"], cfg.project, launch_stamp(), num, many=many)
        if _default_run_name(task_cfg):
            run_name = name
        elif many:
            raise ConfigError(
                f"run_name={cfg.run_name!r} names one run, but this command makes a TrainJob per "
                "job of the sweep: leave run_name out (each job's run is named after its job)"
            )
        else:
            run_name = str(cfg.run_name)
            if not re.match(RUN_NAME, run_name):
                raise ConfigError(
                    f"run_name={run_name!r} is not allowed with hydra/launcher=k8s: expected "
                    "letters, digits, '.', '_', '-' (and '/' between parts)"
                )
        nodes, procs = nodes_and_procs(cfg.parallel, gpus=options["gpus_per_node"])
        # The config as every pod sees it: the runtime's PET_* adopted (train.py does
        # the same there), checked with the project's own rules.
        adopt_pet_env(
            cfg.parallel, env=manifest.pod_env(name, num_nodes=nodes, procs_per_node=procs)
        )
        check_config(cfg)

        command = ["torchrun", "train.py", *pod_overrides(overrides)]
        command += [f"run_name={run_name}", f"runs_root={options['runs_mount']}"]
        docs = [
            manifest.training_runtime(name, options, num_nodes=nodes),
            manifest.train_job(
                name, options, command=command, num_nodes=nodes, procs_per_node=procs
            ),
        ]
        output_dir = Path(sweep_config.hydra.sweep.dir) / str(sweep_config.hydra.sweep.subdir)
        return {
            "num": num,
            "name": name,
            "overrides": overrides,
            "sweep_config": sweep_config,
            "task_cfg": task_cfg,
            "dir": output_dir,
            "docs": docs,
            "summary": f"{nodes} node(s) x {procs} process(es), run dir "
            f"{options['runs_mount']}/{run_name} on PVC {options['runs_claim']}",
        }

    def _write(self, job: dict[str, Any], options: dict[str, Any]) -> JobReturn:
        from training_engine.files import write_atomic
        from training_engine.run_dir import save_hydra_files

        HydraConfig.instance().set_config(job["sweep_config"])
        path = job["dir"] / MANIFEST
        # .hydra/ as for any job: the sweep summary lists it (its results are in the cluster)
        save_hydra_files(job["dir"], job["task_cfg"])
        write_atomic(path, manifest.render(job["docs"]))
        shown = " ".join(filter_overrides(job["overrides"]))
        log.info(f"#{job['num']} : {shown} -> TrainJob {job['name']}: {job['summary']}: {path}")
        status, value = JobStatus.COMPLETED, str(path)
        if options["apply"]:
            proc = subprocess.run(kubectl_apply(path), capture_output=True, text=True, check=False)
            if proc.returncode == 0:
                log.info(proc.stdout.strip())
            else:
                status = JobStatus.FAILED
                value = RuntimeError(
                    f"kubectl apply -f {path} exited {proc.returncode}: {proc.stderr.strip()}"
                )
        return JobReturn(
            overrides=job["overrides"],
            cfg=job["task_cfg"],
            hydra_cfg=job["sweep_config"],
            working_dir=str(job["dir"]),
            task_name=JobRuntime.instance().get("name"),
            status=status,
            _return_value=value,
        )


def kubectl_apply(path: Path) -> list[str]:
    return ["kubectl", "apply", "-f", str(path)]


def job_name(given: str | None, project: str, stamp: str, num: int, *, many: bool) -> str:
    """The TrainJob's (and by default the run's) name: ``hydra.launcher.job_name``,
    else the project and the launch stamp (the sweep dir's); ``-<job number>``
    when the command makes several."""
    if given is None:
        prefix = "".join(c if c.isalnum() else "-" for c in project.lower())[:24].strip("-")
        day, time_id = stamp.split("/")  # YYYY-MM-DD/HH-MM-SS-<id>
        hh, mm, ss, ident = time_id.split("-")
        given = f"{prefix or 'run'}-{day.replace('-', '')}-{hh}{mm}{ss}-{ident}"
        if not given[0].isalpha():
            given = f"run-{given}"
    return f"{given}-{num}" if many else given


def nodes_and_procs(parallel: DictConfig, *, gpus: int) -> tuple[int, int]:
    """numNodes and numProcPerNode: ``parallel.num_nodes``, and
    ``parallel.num_processes`` with ``auto`` = the pod's GPUs
    (``parallel.cpu_processes`` without); one process per GPU at most."""
    from training_engine.config import ConfigError

    nodes = parallel.num_nodes
    if parallel.mode == "none":
        if nodes != 1:
            raise ConfigError(
                f"parallel.num_nodes={nodes!r} is not allowed with parallel=none: expected 1"
            )
        return 1, 1
    procs = parallel.num_processes
    if procs == "auto":
        procs = gpus or parallel.cpu_processes
    for key, value in (("parallel.num_nodes", nodes), ("parallel.num_processes", procs)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key}={value!r} is not allowed: expected an integer >= 1")
    if gpus and procs > gpus:
        raise ConfigError(
            f"parallel.num_processes={procs} is not allowed with hydra.launcher.gpus_per_node="
            f"{gpus}: expected at most one process per GPU (or auto)"
        )
    return nodes, procs


def pod_overrides(overrides: list[str]) -> list[str]:
    """The job's overrides for the pods' command, less those the launcher sets."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [
        text for text, o in zip(overrides, parsed, strict=True) if o.key_or_group not in POD_KEYS
    ]


def _default_run_name(task_cfg: DictConfig) -> bool:
    return OmegaConf.to_container(task_cfg, resolve=False).get("run_name") == "${default_run_name:}"


def _remove_if_only_multirun_yaml(sweep_dir: Path, *, stop: Path) -> None:
    """Hydra's sweeper wrote multirun.yaml into a new sweep dir before the launcher
    ran; a command refused here leaves nothing behind: the folders made for it (the
    runs root too, NoteExistingFolders), or, not noted, the empty ones below ``stop``."""
    from training_engine.run_dir import made_by_this_launch

    if not sweep_dir.is_dir() or {p.name for p in sweep_dir.iterdir()} - {"multirun.yaml"}:
        return
    shutil.rmtree(sweep_dir)
    if made_by_this_launch(sweep_dir.parent, remove=True):  # runs_root too, if made now
        return
    for parent in sweep_dir.parents:
        if parent == stop or not parent.is_dir() or any(parent.iterdir()):
            break
        parent.rmdir()
