"""How a key of the engine's config is declared: its type (the annotation), its
default, a one-line doc and its check (what values are allowed, said as the error
says it) in one ``setting(...)``; ``Section``, the base of every group's dataclass,
checks its values in ``__post_init__`` and says every problem at once.

The checks are plain predicates with the text of what they allow: OmegaConf checks
the type when the config is composed, these the values (a range, a choice, a file),
and the same text names what is allowed when the type is wrong (entry.py)."""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import OmegaConf

from ..config import ConfigError


class Check(NamedTuple):
    """A predicate on a value and what it allows (``expected ...`` in the message)."""

    ok: Callable[[Any], bool]
    allowed: str


def setting(default: Any, doc: str, check: Check | None = None) -> Any:
    """A field with its default, its one-line doc and its check (dataclasses.field).
    A list or dict default is copied for each instance."""
    meta = {"doc": doc, "check": check}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, doc: str) -> Any:
    """A nested group (e.g. trainer.ema) with its defaults."""
    return dataclasses.field(default_factory=cls, metadata={"doc": doc, "check": None})


class Section:
    """The base of every group's dataclass, declared ``@dataclass(repr=False, eq=False)``
    (each generated method costs start-up time; none is needed). ``KEY``: where it sits
    in the config (``trainer``, ``trainer.ema``); ``cross_problems``: checks across its
    own keys."""

    KEY = ""

    def __post_init__(self) -> None:
        found = problems(type(self), self)
        if found:
            raise ConfigError("Invalid configuration:\n  " + "\n  ".join(found))

    @classmethod
    def cross_problems(cls, values: Any) -> list[str]:
        """Problems of a combination of this group's keys (``values``: the group's
        values, a dataclass or a config node, each value of the right type or not)."""
        return []


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The fields' types (the annotations, evaluated)."""
    return typing.get_type_hints(cls)


def inner_section(cls: type, name: str) -> type | None:
    """The Section class a field holds (``trainer.ema``, ``debug.profile``), else None."""
    kind = hints(cls)[name]
    for option in typing.get_args(kind) or (kind,):
        if isinstance(option, type) and issubclass(option, Section):
            return option
    return None


def problems(cls: type, values: Any) -> list[str]:
    """Every value of ``values`` (a ``cls`` section, as a dataclass or a config node)
    that its check refuses, nested groups included, every key it has that ``cls``
    does not declare, then the group's cross checks: ``KEY=VALUE is not allowed:
    expected ...``."""
    found = []
    names = [field.name for field in dataclasses.fields(cls)]
    mapping = isinstance(values, Mapping)  # a config node (DictConfig) or a dict
    if mapping:
        found += [unknown(cls.KEY, str(key), names) for key in values if key not in names]
    for field in dataclasses.fields(cls):
        if mapping and field.name not in values:
            continue  # absent: complete() gave each group its defaults; the caller says
        value = values[field.name] if mapping else getattr(values, field.name)
        inner = inner_section(cls, field.name)
        if inner is not None and value is not None:
            found += problems(inner, value)
            continue
        if isinstance(value, str) and value.startswith("${"):
            continue  # an interpolation (a default such as ${trainer.monitor}): judged resolved
        check = field.metadata.get("check")
        if check is not None and not check.ok(value):
            found.append(refused(f"{cls.KEY}.{field.name}".lstrip("."), value, check.allowed))
    return found + cls.cross_problems(values)


def unknown(parent: str, key: str, names: list[str]) -> str:
    """``KEY is not a key of PARENT``, with the closest declared key."""
    import difflib

    where = f"{parent}." if parent else ""
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f": did you mean {where}{close[0]}?" if close else f" ({', '.join(names)})"
    return f"{where}{key} is not a key of {parent or 'the config'}{hint}"


def refused(key: str, value: Any, allowed: str) -> str:
    return f"{key}={plain(value)!r} is not allowed: expected {allowed}"


def plain(value: Any) -> Any:
    """A value as the message shows it: a config node as plain data (a list as [..]),
    a whole float as the integer it was given as (a float key made 0 into 0.0)."""
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


# --- the checks ---------------------------------------------------------------------------


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def one_of(*choices: Any) -> Check:
    return Check(lambda v: v in choices, "one of " + ", ".join(map(str, choices)))


def either(*choices: str) -> Check:
    """``a or b`` / ``a, b or c``: for a few words."""
    text = (
        " or ".join(choices) if len(choices) < 3 else ", ".join(choices[:-1]) + f" or {choices[-1]}"
    )
    return Check(lambda v: v in choices, text)


def ints(low: int, why: str = "", *, null: str | None = None) -> Check:
    """An integer >= low (``why`` in parentheses); ``null``: also null, saying what it means."""
    text = f"an integer >= {low}"
    if null is not None:
        text += " or null" + (f" ({null})" if null else "")
    elif why:
        text += f" ({why})"
    return Check(lambda v: (null is not None and v is None) or (is_int(v) and v >= low), text)


def numbers(
    *,
    above: float | None = None,
    at_least: float | None = None,
    null: str | None = None,
    unit: str = "a number",
) -> Check:
    """A number > above (or >= at_least); ``null``: also null, saying what it means."""
    bound = f"> {above:g}" if above is not None else f">= {at_least:g}"
    text = f"{unit} {bound}"
    if null is not None:
        text += " or null" + (f" ({null})" if null else "")

    def ok(v: Any) -> bool:
        if v is None:
            return null is not None
        if not is_number(v):
            return False
        return v > above if above is not None else v >= at_least

    return Check(ok, text)


BOOL = Check(lambda v: isinstance(v, bool), "true or false")
FRACTION = Check(lambda v: is_number(v) and 0 < v < 1, "a number between 0 and 1 (exclusive)")
SECONDS = numbers(above=0, unit="a number of seconds")


def existing_dir(v: Any) -> bool:
    return isinstance(v, str) and v != "" and Path(v).is_dir()
