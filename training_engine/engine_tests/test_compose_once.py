"""A run composes its config once (compose_once.py), and gets what Hydra gives it
without that: the same config and the same ``.hydra/`` files; a config whose
``hydra.mode`` is MULTIRUN still sweeps, a sweep without ``-m`` is still refused. In
this process, through ``run_entry_point`` as train.py calls it, on a small config."""

import gc
import sys
import weakref
from pathlib import Path

import hydra
import pytest
import yaml
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from training_engine.entry import run_entry_point

CONFIG = {
    "defaults": ["_self_", {"override hydra/job_logging": "none"}],
    "lr": 0.1,
    "model": {"width": 8, "depth": "${lr}"},
}


def run(monkeypatch, config_dir: Path, out: Path, *argv: str, task=None) -> tuple[list[dict], int]:
    """The configs the task got (or what ``task(cfg)`` returned), and how many times
    Hydra composed one."""
    seen, composed = [], []
    load = ConfigLoaderImpl._load_configuration_impl

    def counted(self, *args, **kwargs):
        composed.append(1)
        return load(self, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "_load_configuration_impl", counted)

    @hydra.main(version_base="1.3", config_path=str(config_dir), config_name="cfg")
    def main(cfg):
        seen.append(task(cfg) if task else OmegaConf.to_container(cfg, resolve=True))

    monkeypatch.setattr(sys, "argv", ["train.py", *argv, f"hydra.run.dir={out}"])
    GlobalHydra.instance().clear()
    try:
        run_entry_point(main, config_dir, "cfg")
    finally:
        GlobalHydra.instance().clear()
        gc.unfreeze()  # run_entry_point froze this pytest process's objects
    return seen, len(composed)


def test_the_imports_are_frozen_and_nothing_the_run_builds_is(monkeypatch, config_dir, tmp_path):
    """entry.freeze_what_is_imported: what is alive at the start (torch, Hydra, the
    engine) is out of the collector's reach; a run's own cyclic garbage is collected."""

    def task(cfg):
        class Node:
            pass

        node = Node()
        node.cycle = node  # only the cycle collector frees it
        dead = weakref.ref(node)
        del node
        gc.collect()
        return {"frozen": gc.get_freeze_count(), "collected": dead() is None}

    gc.unfreeze()
    alive = len(gc.get_objects())
    [seen], _ = run(monkeypatch, config_dir, tmp_path / "run", task=task)
    assert seen["frozen"] > 0.9 * alive > 9_000  # this process's torch, Hydra, pytest
    assert seen["collected"]
    assert gc.get_freeze_count() == 0  # run() thawed them


@pytest.fixture
def config_dir(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "cfg.yaml").write_text(yaml.safe_dump(CONFIG))
    return tmp_path / "configs"


def test_a_run_composes_once_and_gets_hydras_config(monkeypatch, config_dir, tmp_path):
    once, composed = run(monkeypatch, config_dir, tmp_path / "once", "lr=0.5", "model.width=4")
    assert composed == 1
    # --run: a flag, so Hydra's own way (composed twice)
    twice, composed = run(
        monkeypatch, config_dir, tmp_path / "twice", "--run", "lr=0.5", "model.width=4"
    )
    assert composed == 2
    assert once == twice == [{"lr": 0.5, "model": {"width": 4, "depth": 0.5}}]
    for name in ("config.yaml", "overrides.yaml"):
        assert (tmp_path / "once/.hydra" / name).read_text() == (
            tmp_path / "twice/.hydra" / name
        ).read_text()
    hydra_once, hydra_twice = (
        yaml.safe_load((tmp_path / d / ".hydra/hydra.yaml").read_text())["hydra"]
        for d in ("once", "twice")
    )
    # the one difference: Hydra lists hydra.mode=RUN among the overrides, given or not
    given = [
        [o for o in h["overrides"]["hydra"] if not o.startswith("hydra.run.dir=")]
        for h in (hydra_once, hydra_twice)
    ]
    assert given == [[], ["hydra.mode=RUN"]]
    for h in (hydra_once, hydra_twice):
        h["overrides"]["hydra"], h["run"], h["runtime"]["output_dir"] = [], None, None
        h["job"]["name"] = None
    assert hydra_once == hydra_twice
    assert hydra_once["mode"] == "RUN"


def test_a_config_that_sets_multirun_still_sweeps(monkeypatch, config_dir, tmp_path):
    cfg = {**CONFIG, "hydra": {"mode": "MULTIRUN", "sweep": {"dir": str(tmp_path / "sweep")}}}
    (config_dir / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    seen, _ = run(monkeypatch, config_dir, tmp_path / "unused", "lr=0.1,0.2")
    assert [c["lr"] for c in seen] == [0.1, 0.2]
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["0", "1", "multirun.yaml"]
    # no sweep in the overrides: the first composition (RUN) reads MULTIRUN, is not kept
    cfg["hydra"]["sweep"]["dir"] = str(tmp_path / "sweep1")
    (config_dir / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    seen, _ = run(monkeypatch, config_dir, tmp_path / "unused", "lr=0.3")
    assert [c["lr"] for c in seen] == [0.3]
    assert sorted(p.name for p in (tmp_path / "sweep1").iterdir()) == ["0", "multirun.yaml"]
    assert not (tmp_path / "unused").exists()


def test_a_sweep_without_m_is_refused_as_before(monkeypatch, config_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        run(monkeypatch, config_dir, tmp_path / "out", "lr=0.1,0.2")
    assert stopped.value.code == 2
    assert "Ambiguous value for argument 'lr=0.1,0.2'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
