"""``python -m jaxkv demo [options]``: see ``python -m jaxkv demo --help``."""

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "demo":
        print("usage: python -m jaxkv demo [--help] [options]", file=sys.stderr)
        return 2
    from .demo import cli

    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
