"""The engine's config groups (parallel, tracker, checkpoint, seeding, trainer,
preflight, watchdog, debug, hydra/callbacks, hydra/sweeper), reached by a project
through Hydra's search path (``pkg://training_engine.configs``, which the plugin
hydra_plugins/training_engine_configs adds after the app's own folder). A project
overrides one by a file of the same name in its own configs/. Their files are presets:
each key's type, default and allowed values are declared once, in ../schema/, and a
preset lists its group's ``schema`` first in its defaults."""
