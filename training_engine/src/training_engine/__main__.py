"""``python -m training_engine version | keys | eject``: the engine's version; the table of
every config key it reads (schema/: key, type, default, what it does); copy the engine
into the project (eject.py). Checkpoints: ``python -m training_engine.checkpoint``."""

import sys

from .version import __version__


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["version"]:
        print(__version__)
        return 0
    if args[:1] == ["keys"]:
        from .schema import reference

        print(reference(), end="")
        return 0
    if args[:1] == ["eject"]:
        from .eject import main as eject

        return eject(args[1:])
    print(
        "usage: python -m training_engine version | keys | eject [--project DIR]", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
