"""``python -m {{ cookiecutter.package_name }}.engine.checkpoint list|verify|export PATH``:
inspect checkpoints.

    list   RUN_DIR|CHECKPOINTS_DIR|CHECKPOINT   step, epoch, size, validity, metrics
    verify PATH                                 every file's size and checksum; exit 1 if invalid
    export PATH [-o model.safetensors] [--best] the newest (or the best) valid checkpoint's
                                                weights; a sharded one streamed into one file;
                                                tied weights once, named in its metadata
                                                (checkpoint/ties.py: load_file)

README: "Checkpoints and resuming".
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from . import sharded, ties
from .folder import find_checkpoints
from .format import (
    CheckpointError,
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
        problem = verify_checkpoint(ckpt)
        size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()) / 2**20
        try:
            manifest = read_manifest(ckpt)
            step, epoch = manifest["step"], manifest["epoch"] + 1
            metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(manifest["metrics"].items()))
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
        problem = verify_checkpoint(ckpt)
        bad += problem is not None
        print(
            f"{'OK' if problem is None else 'INVALID':<8} {ckpt}"
            + (f"\n    {problem}" if problem else "")
        )
    print(f"{len(ckpts) - bad} valid, {bad} invalid")
    return 1 if bad else 0


def _best(path: Path) -> list[Path]:
    """The checkpoint ``best.json`` of a run dir or checkpoints dir names."""
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    try:
        return [root / json.loads((root / "best.json").read_text())["path"]]
    except (OSError, ValueError, KeyError) as err:
        print(f"--best: no readable best.json in {root} ({err})", file=sys.stderr)
        return []


def _consolidate(ckpt: Path, tmp: Path) -> None:
    """The model shards of a sharded checkpoint as one safetensors file, written
    tensor by tensor from the shards' headers (DCP's consolidation: no full
    state in memory; the shards were hashed and their headers checked first)."""
    from safetensors import safe_open
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    shards = ckpt / sharded.MODEL_DIR
    names: set[str] = set()
    for shard in shards.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            names.update(f.keys())
    with tempfile.TemporaryDirectory(dir=tmp.parent) as folder:
        consolidate_safetensors_files(str(shards), folder, dict.fromkeys(sorted(names), 1))
        os.replace(Path(folder) / "model-00001-of-00001.safetensors", tmp)


def _cli_export(path: Path, out: Path, best: bool) -> int:
    for ckpt in reversed(_best(path) if best else _resolve_many(path)):  # the newest valid one
        try:
            layout = read_manifest(ckpt).get("layout", "full")
            if layout == "sharded":
                names = [n for n in read_manifest(ckpt)["files"] if n.startswith("model/")]
                verify_files(ckpt, names, parse=lambda _n, p: sharded.check_shard(p))
            else:
                verify_files(ckpt, ["model.safetensors"], parse=parse_file)
            # tied weights are stored once; the export names them in its metadata
            tied = ties.of_checkpoint(verify_files(ckpt, [ties.TIES_FILE], parse=parse_file), ckpt)
        except CheckpointError as err:
            print(f"skipping {ckpt}: {err}", file=sys.stderr)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        if layout == "sharded" and tied:
            staged = tmp.with_name(f"{tmp.name}.consolidated")
            _consolidate(ckpt, staged)
            ties.with_metadata(staged, tmp, tied)
            staged.unlink()
        elif layout == "sharded":
            _consolidate(ckpt, tmp)
        elif tied:
            ties.with_metadata(ckpt / "model.safetensors", tmp, tied)
        else:
            shutil.copyfile(ckpt / "model.safetensors", tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
        print(
            f"exported {ckpt / ('model/' if layout == 'sharded' else 'model.safetensors')} -> {out}"
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
            p.add_argument("-o", "--output", type=Path, default=Path("model.safetensors"))
            p.add_argument("--best", action="store_true", help="the checkpoint best.json names")
    args = parser.parse_args(argv)
    if args.command == "list":
        return _cli_list(args.path)
    if args.command == "verify":
        return _cli_verify(args.path)
    return _cli_export(args.path, args.output, args.best)


if __name__ == "__main__":
    sys.exit(main())
