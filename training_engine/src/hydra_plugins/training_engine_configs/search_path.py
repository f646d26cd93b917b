"""The engine's config groups (training_engine/configs/: parallel, tracker, checkpoint,
seeding, trainer, preflight, debug, hydra/callbacks, hydra/sweeper) on Hydra's search
path. A plugin, not ``hydra.searchpath`` in the project's configs: only a primary config
may set that, and eval.yaml composes train.yaml."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class TrainingEngineSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="training-engine", path="pkg://training_engine.configs")
