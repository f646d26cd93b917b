"""The engine's config groups (training_engine/configs/: parallel, tracker, checkpoint,
seeding, trainer, preflight, debug, watchdog, hydra/callbacks, hydra/sweeper) on
Hydra's search path, and their schemas in Hydra's ConfigStore (training_engine/schema/).
A plugin, not ``hydra.searchpath`` in the project's configs: only a primary config may
set that, and eval.yaml composes train.yaml."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class TrainingEngineSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # Hydra asks every search-path plugin before it composes anything, in every app
        # (train.py, eval.py, the compose API, a sweep, a SLURM job): the schemas are
        # stored here, not when a module is imported.
        from training_engine.schema import register

        register()
        search_path.append(provider="training-engine", path="pkg://training_engine.configs")
