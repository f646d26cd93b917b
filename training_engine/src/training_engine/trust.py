"""The trust boundary: what a run directory or a checkpoint may make this project do.

A run dir may come from someone else (a checkpoint downloaded, a colleague's run),
so everything read from one is data, never instructions:

- JSON is read bounded (``read_json``: size and nesting depth) and then checked by
  its reader against what it must hold; anything else is malformed (for a
  checkpoint: corrupt, and the next one is tried).
- A config read from a run dir names code only among the ``_target_``s this project
  trusts (``check_targets``): the engine, the project's own packages (``src/`` of the
  project that runs: its scripts' folder, or the current one) and the modules listed in
  ``trusted_targets`` (configs/train.yaml). Anything else is refused before it is
  imported. Its strings are taken literally (``literal``): a ``${...}`` in them is
  text, never an interpolation or a resolver call.
- Paths read from a run dir stay inside it (``inside``); files of a checkpoint are
  regular files (``regular_file``), never followed through a symlink.

docs/trust.md says what is verified, what is trusted and what a checkpoint from
elsewhere can and cannot do.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

from .config import ConfigError

ENGINE_PACKAGE = __package__.split(".")[0]  # the engine itself: always trusted
MAX_JSON_BYTES = 16 * 2**20  # a manifest of ~100k shard files; configs are a few kB
MAX_JSON_DEPTH = 64  # configs nest ~6 deep; JSON nested deeper is not ours
_ESCAPE = re.compile(r"(\\*)\$\{")  # a run of backslashes, then ${


class Malformed(ValueError):
    """A file read from a run dir is not what it must be (too big, too deep, not
    JSON, a symlink, outside its directory). Each reader says what that means for it."""


def read_json(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """JSON from a regular file of at most ``max_bytes`` bytes, nested at most
    MAX_JSON_DEPTH deep. Raises Malformed, never RecursionError or MemoryError."""
    path = regular_file(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise Malformed(f"{path}: {size} bytes, more than the {max_bytes} a file of its kind holds")
    text = path.read_bytes()
    if _depth(text) > MAX_JSON_DEPTH:
        raise Malformed(f"{path}: nested more than {MAX_JSON_DEPTH} deep")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        raise Malformed(f"{path}: not JSON ({err})") from None


def _depth(text: bytes) -> int:
    """The deepest nesting of ``[``/``{`` outside strings, counted without parsing
    (json.loads recurses once per level: 200,000 levels would not return)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in text:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_JSON_DEPTH:
                    return deepest
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


def regular_file(path: Path) -> Path:
    """``path`` itself (not followed) is a regular file; raises Malformed otherwise."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as err:
        raise Malformed(f"{path}: cannot be read ({err.strerror})") from None
    if stat.S_ISLNK(mode):
        raise Malformed(f"{path}: a symlink (a checkpoint's files are its own regular files)")
    if not stat.S_ISREG(mode):
        raise Malformed(f"{path}: not a regular file")
    return path


def real_dir(path: Path) -> bool:
    """A directory that is not a symlink."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def inside(name: str, root: Path) -> Path:
    """``root / name`` for a plain name of an entry of ``root`` (no separator, no
    ``..``, not absolute, not hidden); raises Malformed otherwise."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name[0] == ".":
        raise Malformed(f"{name!r} is not the name of an entry of {root}")
    return root / name


# --- configs read from a run dir ---------------------------------------------------------


def literal(tree: Any) -> Any:
    """``tree`` with every ``${`` in its strings escaped, so OmegaConf reads them as
    text: a config from a run dir never calls a resolver (``${oc.env:...}``) or
    reaches into another key when it is built."""
    if isinstance(tree, dict):
        return {k: literal(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [literal(v) for v in tree]
    if isinstance(tree, str):  # OmegaConf: \${ is a literal ${, \\${ a \ then an interpolation
        return _ESCAPE.sub(lambda m: m.group(1) * 2 + "\\${", tree)
    return tree


TRUST_IN_CONFIG = "add the module to trusted_targets (configs/train.yaml), e.g. trusted_targets="


def check_targets(
    tree: Any, *, trusted: list[str] | tuple[str, ...], where: str, hint: str = TRUST_IN_CONFIG
) -> None:
    """Raise ConfigError (exit 2) when a ``_target_`` anywhere in ``tree`` (a config
    read from a run dir) is not under the project's package or a module listed in
    ``trusted``. Checked before anything is imported."""
    allowed = (ENGINE_PACKAGE, *project_packages(), *trusted)
    for key, target in _targets(tree, ""):
        ok = isinstance(target, str) and any(
            target == prefix or target.startswith(prefix + ".") for prefix in allowed
        )
        if not ok:
            raise ConfigError(
                f"{where} names {key}={target!r}, which this project does not trust: a config "
                f"read from a run dir may only build classes and functions of "
                f"{', '.join(allowed)}. If you trust that run, {hint}[{_module(target)}]"
            )


def untrusted_targets(tree: Any, *, trusted: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """The (key, target) pairs of ``tree`` that ``check_targets`` would refuse."""
    allowed = (ENGINE_PACKAGE, *project_packages(), *trusted)
    return [
        (key, str(target))
        for key, target in _targets(tree, "")
        if not (
            isinstance(target, str)
            and any(target == p or target.startswith(p + ".") for p in allowed)
        )
    ]


def warn_what_evaluation_will_refuse(
    config: dict, keys: tuple[str, ...], trusted: Any
) -> str | None:
    """Said at the start of training: which ``_target_``s of the run's model, data and
    task eval.py, predict.py and load_model will refuse to build, and how to trust
    them (a run dir never grants itself trust). None when there are none."""
    found = [
        (f"{key}.{name}" if name else key, target)
        for key in keys
        if isinstance(config.get(key), dict)
        for name, target in untrusted_targets(config[key], trusted=list(trusted or ()))
    ]
    if not found:
        return None
    modules = sorted({_module(t) for _, t in found})
    named = ", ".join(f"{k}={t}" for k, t in found)
    model = [_module(t) for k, t in found if k.startswith("model.")]
    also = f"; load_model(..., trusted={sorted(set(model))})" if model else ""
    return (
        f"{named}: outside this project and trusted_targets, so eval.py and predict.py will "
        f"refuse this run until trusted: trusted_targets=[{', '.join(modules)}] "
        f"(configs/train.yaml){also}"
    )


def project_packages() -> list[str]:
    """The packages of the project that runs (always trusted: its owner wrote them):
    those under ``src/`` beside the main script (train.py, eval.py, ...) or of the
    current directory (a notebook, ``python -m``). Never named by a run dir."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    roots = {Path.cwd(), *([Path(main).resolve().parent] if main else [])}
    return sorted({p.parent.name for root in roots for p in (root / "src").glob("*/__init__.py")})


def _targets(tree: Any, prefix: str):
    if isinstance(tree, dict):
        for key, value in tree.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if key == "_target_":
                yield name, value
            else:
                yield from _targets(value, name)
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _targets(value, f"{prefix}[{i}]")


def _module(target: Any) -> str:
    return str(target).rsplit(".", 1)[0] if "." in str(target) else str(target)
