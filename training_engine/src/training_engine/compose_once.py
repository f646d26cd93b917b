"""A run's config composed once, not twice.

Before a run, Hydra 1.3 composes the whole config once only to read ``hydra.mode``
(``Hydra.get_mode``, in MULTIRUN mode, the result thrown away) and then again to run
(hydra-ecosystem/hydra#3440, open; about 0.3 s of a start on these 2 cores). Here the
first composition is made the way the run makes it (RUN mode, sweep overrides
checked) and kept for the run when its ``hydra.mode`` is RUN or unset. Anything else
goes Hydra's own way, unchanged: a command line with a flag (``-m``, ``--cfg``, ...),
a config whose ``hydra.mode`` is MULTIRUN (``hydra/launcher=k8s``), a composition that
fails (Hydra then composes again and reports the error itself). The run's config and
``.hydra/`` files are Hydra's own but for the ``hydra.mode=RUN`` that Hydra lists among
the overrides although nobody gave it (compared in the engine's tests).

Hand-written because no released Hydra has the fix; the proposed one
(hydra-ecosystem/hydra#3441) reads the mode from the primary config file only, which
misses this template's ``hydra.mode`` that a launcher option sets.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def composed_once(argv: list[str]) -> Iterator[None]:
    """Within it, a ``@hydra.main`` run composes its config once (module docstring)."""
    if any(arg.startswith("-") for arg in argv):  # -m, --cfg, --info, ...: Hydra's way
        yield
        return
    from hydra._internal.hydra import Hydra
    from hydra.types import RunMode

    hydras_get_mode = Hydra.get_mode

    def get_mode(self: Any, config_name: str | None, overrides: list[str]) -> Any:
        loader = self.config_loader
        try:
            cfg = loader.load_configuration(
                config_name=config_name, overrides=overrides, run_mode=RunMode.RUN
            )
            mode = cfg.hydra.mode
        except Exception:  # a sweep, a bad override, ...: Hydra's way, its own message
            return hydras_get_mode(self, config_name, overrides)
        if mode not in (None, RunMode.RUN):  # MULTIRUN, set by the config
            return mode
        _keep_for_the_run(loader, cfg, config_name, list(overrides))
        # RUN, not None: for None Hydra would add hydra.mode=RUN to the overrides (its
        # run then sets the unset mode to RUN all the same)
        return RunMode.RUN

    Hydra.get_mode = get_mode
    try:
        yield
    finally:
        Hydra.get_mode = hydras_get_mode


def _keep_for_the_run(loader: Any, cfg: Any, config_name: str | None, overrides: list) -> None:
    """The loader's next ``load_configuration`` of the same run returns ``cfg``; any
    other call (a sweep's jobs, another config) composes as before."""
    load = loader.load_configuration

    def load_configuration(**kwargs: Any) -> Any:
        from hydra.types import RunMode

        del loader.load_configuration  # once: the class's method again
        same = (
            kwargs.get("config_name") == config_name
            and list(kwargs.get("overrides", [])) == overrides
            and kwargs.get("run_mode") == RunMode.RUN
        )
        return cfg if same else load(**kwargs)

    loader.load_configuration = load_configuration
