"""``python -m training_engine version | eject``: the engine's version; copy the engine
into the project (eject.py). Checkpoints: ``python -m training_engine.checkpoint``."""

import sys

from .version import __version__


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["version"]:
        print(__version__)
        return 0
    if args[:1] == ["eject"]:
        from .eject import main as eject

        return eject(args[1:])
    print("usage: python -m training_engine version | eject [--project DIR]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
