"""How the entry points (train.py, eval.py, predict.py, generate.py) end.

Exit codes (docs/trust.md): 0 done (or nothing to do), 1 a failure (a crash, a
failed preflight, no valid checkpoint, a rank that failed), 2 bad input (a value,
a key, an option, a file, a run dir: one message naming it and what is allowed,
and nothing left on disk), 3 a non-finite loss, 4 an Optuna trial pruned, 5 a hang
found by a rank's watchdog (docs/recovery.md), 128 + N
stopped by signal N after saving (143 SIGTERM, 138 SIGUSR1, 140 SIGUSR2, 130 Ctrl-C).

Hydra reports its own command-line errors (a key that does not exist, an option
that does not exist, an override that does not parse) itself, with exit code 1;
``run_entry_point`` turns them into ours: exit 2 and one message with the closest
valid key or the options there are.
"""

from __future__ import annotations

import atexit
import difflib
import gc
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .compose_once import composed_once
from .run_options import with_runs_data_option

EXIT_BAD_INPUT = 2


def run_entry_point(main: Callable[[], Any], config_dir: Path, config_name: str) -> None:
    """Call a ``@hydra.main`` function; Hydra's command-line errors exit 2 with a
    message of ours (module docstring), before anything is written."""
    from hydra.errors import ConfigCompositionException, OverrideParseException

    skip_the_final_collection()
    freeze_what_is_imported()
    # eval/predict/generate ckpt=RUN data.KEY=...: the run's own data option, not the default
    sys.argv[1:] = with_runs_data_option(sys.argv[1:], config_dir)
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises them to us instead of printing them
    try:
        with composed_once(sys.argv[1:]):  # not twice, as Hydra 1.3 does
            main()
    except (ConfigCompositionException, OverrideParseException) as err:
        message = command_line_problems(err, config_dir, config_name, sys.argv[1:])
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except OSError as err:
        if not _making_the_output_dir(err):
            raise
        print(
            f"error: cannot make the run dir {err.filename}: {err.strerror}. Give a writable "
            "runs_root (or hydra.run.dir)",
            file=sys.stderr,
        )
        sys.exit(EXIT_BAD_INPUT)
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


def freeze_what_is_imported() -> None:
    """Move every object alive now (the modules train.py imported: torch, Hydra, the
    engine, ~200k objects) out of the collector's reach. They live as long as the
    process, yet each full collection walks them all: two of those (~100-130 ms each,
    the dynamo import of the optimizer's constructor and torch.distributed.tensor's)
    fell between here and the first step. Frozen, those walk only what came after:
    ~170 ms sooner to the first step (bench.py --only startup). Nothing a run builds
    is frozen (a sweep's jobs in one process are collected as before); only cyclic
    garbage of the imports, pending now, is never collected."""
    gc.freeze()


def skip_the_final_collection() -> None:
    """A process that has imported torch spends about 1.5 s of its exit in the
    interpreter's last garbage collection (measured: a 3-step run 8.4 -> 6.5 s, a
    2-process DDP run 15.6 -> 12.9 s). What is alive then dies with the process anyway:
    frozen at exit, the collector skips it. Files, trackers and process groups are
    closed explicitly before, never left to the collector."""
    atexit.register(gc.freeze)


def command_line_problems(
    err: Exception, config_dir: Path, config_name: str, argv: list[str]
) -> str:
    """``command_line_error``'s message and every other problem of the command line, in
    one message (as check_config names every bad value): Hydra stops at the first
    override it refuses, so the others are composed again without it, until Hydra takes
    them, and then checked as the run would check them."""
    problems, rest = [], [a for a in argv if "=" in a and not a.startswith("-")]
    for _ in range(len(rest) + 1):
        problems.append(command_line_error(err, config_dir, config_name, rest))
        offending = _offending(err, rest)
        if offending is None:
            break
        rest.remove(offending)
        composed = _compose(config_dir, config_name, rest)
        if not isinstance(composed, Exception):
            problems += _value_problems(composed)
            break
        err = composed
    if len(problems) == 1:
        return problems[0]
    return "Invalid configuration:\n  " + "\n  ".join(problems)


def _offending(err: Exception, overrides: list[str]) -> str | None:
    """The override ``err`` is about, as given on the command line; None: not one."""
    text = str(err)
    override = getattr(err, "override", None)  # OverrideParseException
    merging = re.match(r"Error merging override (.+)", text)
    named = re.search(r"Could not (?:override|find) '([^'/]+(?:/[^'/]+)*?)(?:/[^'/]+)?'", text)
    if override is None and merging:
        override = merging.group(1)
    if override is not None and str(override) in overrides:
        return str(override)
    key = merging.group(1).split("=", 1)[0] if merging else named.group(1) if named else None
    return next((o for o in overrides if o.split("=", 1)[0].lstrip("+~") == key), None)


def _compose(config_dir: Path, config_name: str, overrides: list[str]) -> Any:
    """The config Hydra composes with these overrides, or the exception it raises."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException, OverrideParseException

    kept = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return compose(config_name, overrides=kept)
    except (ConfigCompositionException, OverrideParseException) as err:
        return err


def _value_problems(cfg: Any) -> list[str]:
    """check_config's problems of a composed config (the lines of its message)."""
    from .config import ConfigError, check_config, resolve_config

    try:
        check_config(resolve_config(cfg))
    except ConfigError as err:
        return [line.strip() for line in str(err).splitlines() if line.startswith("  ")] or [
            str(err)
        ]
    except Exception:  # anything else is the run's to say, once the first ones are fixed
        return []
    return []


def command_line_error(err: Exception, config_dir: Path, config_name: str, argv: list[str]) -> str:
    """One line (or two) saying which override is wrong and what is allowed."""
    from hydra.errors import MissingConfigException, OverrideParseException

    from .schema import OPTION, schema_of, type_error

    text = str(err)
    if isinstance(err, MissingConfigException):
        found = re.search(r"Could not find '([^']+)/([^']+)'", text)
        # a group's schema (<group>/schema) is what its options are composed on, not one
        options = ", ".join(sorted(o for o in err.options or [] if o != OPTION))
        if found:
            group, value = found.groups()
            return f"{group}={value} is not an option: choose one of {options}"
        return text.splitlines()[0]
    if isinstance(err, OverrideParseException):
        return f"cannot read the override {err.override!r}: {text.splitlines()[0]}"
    cause = err.__cause__
    if text.startswith("Error merging override") and getattr(cause, "full_key", None):
        return type_error(cause)  # KEY=VALUE of the wrong type for the engine's schema
    preset = re.match(r"In '([^']+)': (\w+) raised while composing config:\n", text)
    if preset:  # a preset that sets a key its schema lacks, or a value of the wrong type
        return f"{preset.group(1)}.yaml: {_preset_problem(text[preset.end() :])}"
    found = re.search(r"Could not override '([^']+)'", text)
    if not found:
        return " ".join(text.split())
    key = found.group(1)
    value = next((a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] == key), "")
    rest = [a for a in argv if a.split("=", 1)[0].lstrip("+~") != key and "=" in a]
    keys = config_keys(config_dir, config_name, rest)
    if key in keys and value.lstrip().startswith("{"):  # a dict merged into a struct
        cause = str(err.__cause__ or "")
        missing = re.search(r"Key '([^']+)' is not in struct", cause)
        why = f"{key} has no key {missing.group(1)!r}" if missing else f"{key} has fixed keys"
        return (
            f"{key}={value} is not allowed: a dict merges into {key}, and {why}. A whole "
            f"new {key}: {key}=null '{key}={value}' (null first, then the new one); one new "
            f"key: +{key}.KEY=VALUE"
        )
    message = f"{key}={value} is not a key of the config"
    close = closest_keys(key, keys)
    if close:
        message += f": did you mean {' or '.join(close)}?"
    if schema_of(key.rpartition(".")[0]) is not None:  # the engine's groups declare theirs
        return message
    return message + f" (to add a new key on purpose: +{key}={value})"


def _preset_problem(said: str) -> str:
    """OmegaConf's message (``Key 'x' not in 'Trainer'``, ``Value 'abc' of type 'str'
    could not be converted ...``, then ``full_key: K``) as ours."""
    from .schema import expected, schema_of
    from .schema.fields import refused, unknown

    key = re.search(r"full_key: (\S+)", said)
    if key is None:
        return " ".join(said.split())
    full_key = key.group(1)
    parent, _, leaf = full_key.rpartition(".")
    if re.match(r"Key '[^']+' not in", said):
        cls = schema_of(parent)
        return unknown(parent, leaf, list(cls.__dataclass_fields__) if cls else [])
    value = re.match(r"Value '(.*)' (of type|is not)", said)
    return refused(full_key, value.group(1) if value else "?", expected(full_key))


# The engine's own config groups (a project's configs/train.yaml puts them on Hydra's
# search path as pkg://training_engine.configs).
ENGINE_CONFIGS = Path(__file__).resolve().parent / "configs"


def config_keys(config_dir: Path, config_name: str, overrides: list[str]) -> list[str]:
    """Every key (dotted) of the config composed with ``overrides``; the config
    groups count as keys too (``tracker=...``)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(
                config_name, overrides=[o for o in overrides if not o.startswith("hydra")]
            )
    except Exception:  # the other overrides are broken too: suggest from the defaults
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(config_name)
    keys = list(_flatten(OmegaConf.to_container(cfg, resolve=False)))
    groups = [p.name for d in (config_dir, ENGINE_CONFIGS) for p in d.iterdir() if p.is_dir()]
    return sorted(set(keys) | set(groups))


def closest_keys(key: str, keys: list[str]) -> list[str]:
    """The keys most like ``key``: by the whole dotted name, then by the last part
    among the keys of the same parent."""
    close = difflib.get_close_matches(key, keys, n=2, cutoff=0.75)
    if close:
        return close
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
    prefix = f"{parent}." if parent else ""
    return [prefix + s for s in difflib.get_close_matches(leaf, siblings, n=2, cutoff=0.6)]


def _flatten(tree: Any, prefix: str = ""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            name = f"{prefix}{key}"
            yield name
            yield from _flatten(value, name + ".")


def _making_the_output_dir(err: OSError) -> bool:
    """Raised by Hydra's own ``mkdir`` of the job's output dir (before our code runs)."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    return any(f.name == "run_job" and "hydra" in f.filename for f in frames) and any(
        f.name == "mkdir" for f in frames[-3:]
    )
