"""The engine's config, typed: one dataclass per group the engine owns (``trainer``,
``parallel``, ``checkpoint``, ``preflight``, ``debug``, ``watchdog``, each tracker's
settings) and for the top-level keys it reads (``Run``). Each key has its type, its
default, a one-line doc and its check in one place (fields.py); the YAML files of
configs/ are presets that set some of them.

Hydra composes each group on its schema (``register``: a preset's defaults list
names ``schema`` first), so a preset or an override can only set a declared key, to
a value of its type. ``complete`` types a group that was composed without it (a
project's own file); ``problems`` checks every value once the config is resolved.
docs/configuration.md's table of keys is ``reference()``'s (a test compares them).
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from .checkpoint import Checkpoint, SaveBest
from .fields import Section, hints, inner_section, problems, refused, unknown
from .parallel import PARALLEL_MODES, Parallel
from .run import REQUIRED, TRACKERS, Debug, Preflight, Profile, Run, Watchdog
from .trainer import MIXED_PRECISION, EarlyStopping, Ema, Trainer

__all__ = [
    "MIXED_PRECISION",
    "PARALLEL_MODES",
    "SCHEMAS",
    "TRACKERS",
    "Checkpoint",
    "Debug",
    "EarlyStopping",
    "Ema",
    "Parallel",
    "Preflight",
    "Profile",
    "Run",
    "SaveBest",
    "Section",
    "Trainer",
    "Watchdog",
    "complete",
    "config_problems",
    "defaults",
    "expected",
    "reference",
    "register",
    "section",
    "values",
]

# The engine's groups, each composed on its schema (``<group>/schema``).
SCHEMAS: dict[str, type] = {
    "trainer": Trainer,
    "parallel": Parallel,
    "checkpoint": Checkpoint,
    "preflight": Preflight,
    "debug": Debug,
    "watchdog": Watchdog,
}
OPTION = "schema"  # the schema's name in its group (entry.py leaves it out of the options)


def register() -> None:
    """Store the schemas in Hydra's ConfigStore: ``<group>/schema`` for each group and
    ``tracker/schema/<name>`` for each tracker. Called by the engine's search-path
    plugin (hydra_plugins/training_engine_configs), which every Hydra app runs before
    it composes: once per process (a process that composes again, e.g. the tests, finds
    them there)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    stored = store.repo.get("tracker", {}).get(OPTION, {})
    if all(f"{name}.yaml" in stored for name in TRACKERS):  # stored last: all are there
        return
    for group, cls in SCHEMAS.items():
        # the debug presets are @package _global_ (they set trainer keys too)
        store.store(group=group, name=OPTION, node=cls, package=group, provider="training-engine")
    for name, cls in TRACKERS.items():
        store.store(group=f"tracker/{OPTION}", name=name, node=cls, provider="training-engine")


def _groups(cfg: Any) -> list[tuple[str, type, Any]]:
    """(key, schema, node) of every engine group in ``cfg`` (trackers included)."""
    found = [(key, cls, cfg.get(key)) for key, cls in SCHEMAS.items()]
    trackers = cfg.get("tracker") or {}
    found += [(f"tracker.{n}", TRACKERS[n], trackers[n]) for n in trackers if n in TRACKERS]
    return found


def complete(cfg: DictConfig) -> DictConfig:
    """``cfg`` as composed (unresolved), with every engine group that was not
    composed on its schema (a project's own file without ``schema`` in its defaults,
    a group the project's train.yaml does not list) typed by it and its missing keys
    at their defaults. ``cfg`` itself when every group was (the usual case: no copy).
    ConfigError for a key the schema does not declare or a value of the wrong type."""
    from ..config import ConfigError

    untyped = [(k, c, n) for k, c, n in _groups(cfg) if OmegaConf.get_type(n) is not c]
    if not untyped:
        return cfg
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        for key, cls, node in untyped:
            try:
                typed = OmegaConf.merge(OmegaConf.structured(cls), node or {})
            except Exception as err:  # OmegaConf's ValidationError, ConfigKeyError
                raise ConfigError(type_error(err, key)) from None
            OmegaConf.update(cfg, key, typed, merge=False)
    return cfg


def section(key: str, values: Any) -> DictConfig:
    """The engine group ``key`` (``checkpoint``, ``watchdog``...) with every key: ``values``
    itself when it has them all (a resolved config's group), else ``values`` (a few
    keys, e.g. a test's dict) over the schema's defaults, resolved as a config of
    defaults would resolve them (``${trainer.monitor}``: val/acc). Not checked:
    check_config judges values. For code that takes a group and reads its keys."""
    cls = schema_of(key)
    node = values if isinstance(values, DictConfig) else OmegaConf.create(values or {})
    if _covers(cls, node):
        return node
    from ..config import ConfigError

    root = OmegaConf.create({name: OmegaConf.structured(c) for name, c in SCHEMAS.items()})
    try:
        typed = OmegaConf.merge(OmegaConf.structured(cls), node)
    except Exception as err:  # OmegaConf's ValidationError, ConfigKeyError
        raise ConfigError(type_error(err, key)) from None
    OmegaConf.update(root, key, typed, merge=False)
    return OmegaConf.create(OmegaConf.to_container(OmegaConf.select(root, key), resolve=True))


def values(key: str, node: Any) -> SimpleNamespace:
    """``section(key, node)`` as plain attributes (nested groups too), for code that reads
    them at every step: an OmegaConf attribute read costs ~10 us, this one ~50 ns."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return SimpleNamespace(**{k: plain(v) for k, v in value.items()})
        return value

    return plain(OmegaConf.to_container(section(key, node), resolve=True))


def _covers(cls: type, node: Any) -> bool:
    """Whether ``node`` has every key of ``cls``, nested groups included."""
    for field in dataclasses.fields(cls):
        if field.name not in node:
            return False
        inner = inner_section(cls, field.name)
        if (
            inner is not None
            and node[field.name] is not None
            and not _covers(inner, node[field.name])
        ):
            return False
    return True


def config_problems(cfg: Any) -> list[str]:
    """Every problem of the engine's keys in a resolved config: each value against
    its check, each key a group does not declare, each group's cross checks."""
    found = []
    for _, cls, node in _groups(cfg):
        found += problems(cls, node) if node is not None else []
    names = [f.name for f in dataclasses.fields(Run)]
    absent = [name for name in names if name not in cfg]
    found += [
        f"the config has no {name} (the project's configs/train.yaml sets it)" for name in absent
    ]
    return found + problems(Run, {name: cfg[name] for name in names if name not in absent})


def type_error(err: Exception, group: str = "") -> str:
    """OmegaConf's message about a value of the wrong type, or a key a schema does
    not declare, as ours: ``KEY=VALUE is not allowed: expected ...`` / ``KEY is not
    a key of GROUP: did you mean ...``. ``group``: where the node that was merged
    sits (its keys are relative to it)."""
    key = ".".join(k for k in (group, getattr(err, "full_key", None) or "") if k)
    name = type(err).__name__
    if name in ("ConfigKeyError", "ConfigAttributeError") and key:
        parent, _, leaf = key.rpartition(".")
        cls = schema_of(parent)
        names = [f.name for f in dataclasses.fields(cls)] if cls else []
        return unknown(parent, leaf, names)
    if key:
        return refused(key, getattr(err, "value", None), expected(key))
    return str(err).splitlines()[0]


def schema_of(key: str) -> type | None:
    """The Section class of a dotted group key (``trainer.ema``), else None."""
    if key in SCHEMAS:
        return SCHEMAS[key]
    if key.startswith("tracker.") and key.count(".") == 1:
        return TRACKERS.get(key.split(".")[1])
    parent, _, leaf = key.rpartition(".")
    outer = schema_of(parent) if parent else None
    if outer is None or leaf not in hints(outer):
        return None
    return inner_section(outer, leaf)


def expected(key: str) -> str:
    """What a dotted key allows, as its messages say it (its check's text, else its type's)."""
    parent, _, leaf = key.rpartition(".")
    cls = schema_of(parent) if parent else Run
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls else {}
    if leaf not in fields:
        return "a value of the key's type"
    check = fields[leaf].metadata.get("check")
    return check.allowed if check is not None else type_text(hints(cls)[leaf])


_UnionType = type(int | None)  # what `int | None` is (typing.Union is `Optional[int]`)


def type_text(kind: Any) -> str:
    """``int | None`` -> ``an integer or null``."""
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    union = typing.get_origin(kind) in (typing.Union, _UnionType)
    options = typing.get_args(kind) if union else (kind,)
    said = [
        words.get(o) or ("a list" if typing.get_origin(o) is list else "a mapping")
        for o in options
        if o is not type(None)
    ]
    return " or ".join(said + (["null"] if type(None) in options else []))


def _has_default(field: dataclasses.Field) -> bool:
    return _is_factory(field) or field.default is not REQUIRED


def _is_factory(field: dataclasses.Field) -> bool:
    return field.default_factory is not dataclasses.MISSING


def default(field: dataclasses.Field) -> Any:
    return field.default_factory() if _is_factory(field) else field.default


def _keys(*, null_groups: bool) -> Iterator[tuple[str, type, dataclasses.Field]]:
    """(dotted key, its schema, its field) of every key the engine reads, nested groups'
    keys instead of the group; ``null_groups``: also the keys of a group that is null
    until set (debug.profile), after its own row."""

    def walk(cls: type, prefix: str) -> Iterator[tuple[str, type, dataclasses.Field]]:
        for field in dataclasses.fields(cls):
            inner = inner_section(cls, field.name)
            if inner is not None and _is_factory(field):
                yield from walk(inner, f"{prefix}{field.name}.")
                continue
            yield f"{prefix}{field.name}", cls, field
            if inner is not None and null_groups:
                yield from walk(inner, f"{prefix}{field.name}.")

    yield from walk(Run, "")
    for key, cls in SCHEMAS.items():
        yield from walk(cls, f"{key}.")
    for name, cls in TRACKERS.items():
        yield from walk(cls, f"tracker.{name}.")


def defaults() -> dict[str, Any]:
    """``{dotted key: default}`` of every key the schemas give a default (not the
    project's top-level keys; not inside a group that is null until set): what a config
    written before a key existed meant by its absence (config.config_differences)."""
    return {key: default(f) for key, _, f in _keys(null_groups=False) if _has_default(f)}


def reference() -> str:
    """The table of every key the engine reads: key, type, default, what it does
    (docs/configuration.md holds it; ``python -m training_engine keys`` prints it)."""
    rows = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for key, cls, field in _keys(null_groups=True):
        shown = f"`{_yaml(default(field))}`" if _has_default(field) else "(the project's)"
        doc = field.metadata["doc"].replace("|", "\\|")  # in a table cell
        rows.append(f"| `{key}` | {type_text(hints(cls)[field.name])} | {shown} | {doc} |")
    return "\n".join(rows) + "\n"


def _yaml(value: Any) -> str:
    """A default as YAML writes it: null, true, [a, b], {}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)
