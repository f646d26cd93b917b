"""``python -m training_engine.checkpoint list|verify|export PATH``:
inspect checkpoints.

    list   RUN_DIR|CHECKPOINTS_DIR|CHECKPOINT   step, epoch, size, validity, metrics
    verify PATH                                 every file's size and checksum; exit 1 if invalid
    export PATH [-o model.safetensors] [--best] the newest (or the best) valid checkpoint's
                                                weights; a sharded one streamed into one file;
                                                tied weights once, named in its metadata
                                                (checkpoint/ties.py: load_file)
    export PATH --format hf [--adapter]         a transformers directory; a model.peft run
                                                merged into its base, or its adapter directory

docs/checkpoints.md.
"""

import argparse
import os
import shutil
import sys
from pathlib import Path

from ..config import ConfigError
from ..inference import run_model_spec
from . import format as fmt
from . import sharded, ties
from .export_hf import export_hf
from .folder import find_checkpoints, read_pointer
from .format import (
    CheckpointError,
    check_content,
    parse_file,
    read_manifest,
    verify_checkpoint,
    verify_files,
)

# --- command line -------------------------------------------------------------------------


def _resolve_many(path: Path) -> list[Path]:
    """The checkpoints a path names (folder.find_checkpoints); none when it names none."""
    try:
        return find_checkpoints(path)
    except CheckpointError as err:
        print(err, file=sys.stderr)
        return []


def _cli_list(path: Path) -> int:
    ckpts = _resolve_many(path)
    if not ckpts:
        print(f"no checkpoints in {path}")
        return 1
    print(f"{'checkpoint':<16} {'step':>8} {'epoch':>6} {'size MB':>8}  status  metrics")
    for ckpt in ckpts:
        problem = verify_checkpoint(ckpt, run_model_spec(ckpt))
        size = sum(os.lstat(f"{top}/{n}").st_size for top, _, names in os.walk(ckpt) for n in names)
        size /= 2**20
        try:
            manifest = read_manifest(ckpt)
            step, epoch = manifest["step"], manifest["epoch"] + 1
            metrics = " ".join(
                f"{k}={v:.4g}" if isinstance(v, int | float) else f"{k}={v!r:.20}"
                for k, v in sorted(manifest["metrics"].items())
            )
        except CheckpointError:
            step, epoch, metrics = "?", "?", ""
        status = "valid" if problem is None else "INVALID"
        print(f"{ckpt.name:<16} {step:>8} {epoch:>6} {size:>8.2f}  {status:<7} {metrics}")
        if problem:
            print(f"    {problem}")
    return 0


def _cli_verify(path: Path) -> int:
    ckpts = _resolve_many(path)
    if not ckpts:
        print(f"no checkpoints in {path}")
        return 1
    bad = 0
    for ckpt in ckpts:
        problem = verify_checkpoint(ckpt, run_model_spec(ckpt))
        bad += problem is not None
        print(
            f"{'OK' if problem is None else 'INVALID':<8} {ckpt}"
            + (f"\n    {problem}" if problem else "")
        )
    print(f"{len(ckpts) - bad} valid, {bad} invalid")
    return 1 if bad else 0


def _best(path: Path) -> list[Path]:
    """The checkpoint ``best.json`` of a run dir or checkpoints dir names (one of
    the same folder: folder.read_pointer)."""
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    try:
        return [read_pointer(root, fmt.BEST)]
    except CheckpointError as err:
        print(f"--best: {err}", file=sys.stderr)
        return []


def _cli_export(
    path: Path, out: Path, best: bool, form: str, trusted: list[str], adapter: bool = False
) -> int:
    for ckpt in reversed(_best(path) if best else _resolve_many(path)):  # the newest valid one
        try:  # the whole checkpoint, as every reader checks it (format.check_content)
            layout = read_manifest(ckpt).get("layout", "full")
            verify_files(ckpt, parse=check_content, expected=run_model_spec(ckpt, trusted))
            # tied weights are stored once; the export names them in its metadata
            tied = ties.of_checkpoint(verify_files(ckpt, [ties.TIES_FILE], parse=parse_file), ckpt)
        except CheckpointError as err:
            print(f"skipping {ckpt}: {err}", file=sys.stderr)
            continue
        if form == "hf":
            try:
                export_hf(ckpt, out, trusted=trusted, adapter=adapter)
            except ConfigError as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
            how = "PeftModel.from_pretrained(base, " if adapter else "from_pretrained("
            print(f"exported {ckpt} -> {out} (transformers: {how}{str(out)!r}))")
            return 0
        if adapter:
            print("error: --adapter is an option of --format hf", file=sys.stderr)
            return 2
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        if layout == "sharded" and tied:
            staged = tmp.with_name(f"{tmp.name}.consolidated")
            sharded.consolidate(ckpt, staged)
            ties.with_metadata(staged, tmp, tied)
            staged.unlink()
        elif layout == "sharded":
            sharded.consolidate(ckpt, tmp)
        elif tied:
            ties.with_metadata(ckpt / fmt.MODEL, tmp, tied)
        else:
            shutil.copyfile(ckpt / fmt.MODEL, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
        print(
            f"exported {ckpt / ('model/' if layout == 'sharded' else 'model.safetensors')} -> {out}"
        )
        if read_manifest(ckpt).get("weights") == "trainable":  # checkpoint/base.py
            print(
                f"{out} holds the trainable weights only (the frozen base: {ckpt}/base.json); "
                "--format hf writes the whole model"
            )
        return 0
    print(f"no valid checkpoint in {path}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description="Inspect checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command, text in [
        ("list", "step, epoch, size, validity and metrics of each checkpoint"),
        ("verify", "check every file's size and checksum (exit 1 if any checkpoint is invalid)"),
        ("export", "write the newest valid (--best: the best) checkpoint's weights as one file"),
    ]:
        p = sub.add_parser(command, help=text)
        p.add_argument("path", type=Path, help="a run dir, its checkpoints/ or one checkpoint")
        if command == "export":
            p.add_argument(
                "-o",
                "--output",
                type=Path,
                default=None,
                help="default: model.safetensors (--format safetensors), hf-model/ (--format hf)",
            )
            p.add_argument("--best", action="store_true", help="the checkpoint best.json names")
            p.add_argument(
                "--format",
                choices=("safetensors", "hf"),
                default="safetensors",
                help="one model.safetensors, or a transformers directory (model=hf)",
            )
            p.add_argument(
                "--adapter",
                action="store_true",
                help="--format hf of a model.peft run: its adapter directory (default: merged)",
            )
            p.add_argument(
                "--trust",
                action="append",
                default=[],
                metavar="MODULE",
                help="a module besides this project's the run's config may name",
            )
    args = parser.parse_args(argv)
    if args.command == "list":
        return _cli_list(args.path)
    if args.command == "verify":
        return _cli_verify(args.path)
    out = args.output or Path("hf-model" if args.format == "hf" else "model.safetensors")
    return _cli_export(args.path, out, args.best, args.format, args.trust, args.adapter)


if __name__ == "__main__":
    sys.exit(main())
