"""What prediction on new inputs reads, in-process: the model's class count against
the data's (classes.py), the run's class names read back as data from a run dir, the
files of ``files=`` (data_files.py), the run's own data option added before Hydra
composes (run_options.py), and the warning at training time naming what evaluation
will refuse to build (trust.py)."""

import json
import logging
import os
from types import SimpleNamespace

import pytest
from torch import nn
from torch.utils.data import DataLoader, Dataset

from training_engine.classes import (
    check_model_fits_classes,
    data_classes,
    model_outputs,
    read_classes,
    run_dir_of,
)
from training_engine.config import ConfigError
from training_engine.data_files import expand, read_files
from training_engine.run_options import with_runs_data_option
from training_engine.trust import warn_what_evaluation_will_refuse


class Folder(Dataset):
    classes = ("cat", "dog", "eel")

    def __len__(self):
        return 3

    def __getitem__(self, i):
        return i


def test_the_models_class_count_is_checked_against_the_datas_class_names():
    loaders = SimpleNamespace(train=DataLoader(Folder()), val=None)
    classes = data_classes(loaders)
    assert classes == ["cat", "dog", "eel"]
    assert data_classes(SimpleNamespace(train=DataLoader(range(3)))) is None  # no names
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    timm_like = nn.Linear(4, 7)
    timm_like.num_classes = 3  # timm's attribute wins over the last layer
    hf_like = nn.Linear(4, 9)
    hf_like.config = SimpleNamespace(num_labels=3)
    for model in (mlp, timm_like, hf_like):
        assert model_outputs(model) == 3
        check_model_fits_classes(model, classes)
    with pytest.raises(ConfigError, match=r"scores 5 classes, but the training data has 3 \(cat"):
        check_model_fits_classes(nn.Linear(4, 5), classes)
    check_model_fits_classes(nn.Linear(4, 5), None)  # data without names: nothing to check
    assert model_outputs(nn.ReLU()) is None


def test_the_runs_class_names_are_read_as_data(tmp_path, caplog):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    assert run_dir_of(run / "checkpoints" / "step_1") == run
    assert read_classes(run) is None  # a run without names
    (run / "classes.json").write_text(json.dumps(["a", "b"]))
    assert read_classes(run) == ["a", "b"]
    with caplog.at_level(logging.WARNING):
        for bad in ({"a": 1}, ["a", 2], "[[[["):
            text = bad if isinstance(bad, str) else json.dumps(bad)
            (run / "classes.json").write_text(text)
            assert read_classes(run) is None
        outside = tmp_path / "elsewhere.json"
        outside.write_text(json.dumps(["x"]))
        (run / "classes.json").unlink()
        os.symlink(outside, run / "classes.json")  # never followed out of the run dir
        assert read_classes(run) is None
    assert caplog.text.count("predicting class indices without names") == 4


class Listed(Dataset):
    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)


def files_data(**keys):
    return None


files_data.files = lambda paths, data: Listed(paths)
no_paths = lambda: None  # noqa: E731  (a data function whose reader lists no paths)
no_paths.files = lambda paths, data: [1, 2]


def test_files_are_paths_folders_globs_or_lists_read_by_the_data_options_reader(tmp_path):
    for name in ("b.png", "a.png", "c.txt"):
        (tmp_path / name).write_text("")
    assert expand(str(tmp_path / "*.png")) == [str(tmp_path / "a.png"), str(tmp_path / "b.png")]
    assert expand([str(tmp_path / "c.txt"), str(tmp_path)]) == [
        str(tmp_path / "c.txt"),
        str(tmp_path),
    ]
    with pytest.raises(ConfigError, match="the glob matches nothing"):
        expand(str(tmp_path / "*.jpg"))
    with pytest.raises(ConfigError, match="expected a path, a glob or a list"):
        expand([3])
    data = {"_target_": f"{__name__}.files_data"}
    from omegaconf import OmegaConf

    listed = read_files(OmegaConf.create(data), str(tmp_path / "*.png"))
    assert listed.paths == [str(tmp_path / "a.png"), str(tmp_path / "b.png")]
    with pytest.raises(ConfigError, match="has no `files` reader"):
        read_files(OmegaConf.create({"_target_": "builtins.print"}), str(tmp_path))
    with pytest.raises(ConfigError, match="without a `paths` list"):
        read_files(OmegaConf.create({"_target_": f"{__name__}.no_paths"}), str(tmp_path))


def test_the_runs_own_data_option_is_added_before_hydra_composes(tmp_path):
    configs = tmp_path / "configs" / "data"
    configs.mkdir(parents=True)
    (configs / "digits.yaml").write_text("_target_: pkg.data.digits.digits\n")
    (configs / "images.yaml").write_text("_target_: pkg.data.images.images\nval_dir: null\n")
    (configs / "broken.yaml").write_text("_target_: [unclosed\n")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_5").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"data": {"_target_": "pkg.data.images.images"}}))
    root = tmp_path / "configs"
    for ckpt in (run, run / "checkpoints", run / "checkpoints" / "step_5"):
        argv = [f"ckpt={ckpt}", "data.val_dir=/new"]
        assert with_runs_data_option(argv, root) == ["data=images", *argv]
    same = [f"ckpt={run}", "data=digits", "data.val_dir=/x"]  # the user's choice wins
    assert with_runs_data_option(same, root) == same
    assert with_runs_data_option([f"ckpt={run}", "split=val"], root) == [f"ckpt={run}", "split=val"]
    (configs / "images_big.yaml").write_text("_target_: pkg.data.images.images\n")
    ambiguous = [f"ckpt={run}", "data.val_dir=/x"]  # two options: Hydra's message decides
    assert with_runs_data_option(ambiguous, root) == ambiguous
    (run / "config.json").write_text("not json")
    assert with_runs_data_option(ambiguous, root) == ambiguous


def test_training_names_what_evaluation_will_refuse_to_build_and_how_to_trust_it():
    config = {
        "model": {"_target_": "timm.create_model", "model_name": "resnet18"},
        "data": {
            "_target_": "training_engine.loaders.make_loaders",
            "augment": [{"_target_": "kornia.augmentation.RandomAffine"}],
        },
        "task": {"_target_": "training_engine.task.TaskDefaults"},
    }
    said = warn_what_evaluation_will_refuse(config, ("task", "model", "data"), trusted=[])
    assert "model._target_=timm.create_model" in said
    assert "data.augment[0]._target_=kornia.augmentation.RandomAffine" in said
    assert "trusted_targets=[kornia.augmentation, timm]" in said
    assert "load_model(..., trusted=['timm'])" in said
    trusted = ["timm", "kornia.augmentation"]
    assert warn_what_evaluation_will_refuse(config, ("task", "model", "data"), trusted) is None
