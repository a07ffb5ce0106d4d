"""``python -m jaxkv COMMAND [options]``: ``python -m jaxkv --help`` lists the commands."""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "demo": "serve a stream of requests with continuous batching from a jaxkv cache",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxkv",
        description="jaxkv: KV-cache management for JAX inference loops.",
        epilog="`python -m jaxkv COMMAND --help` gives a command's options.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in COMMANDS.items():
        # The command parses its own options (and its own --help).
        commands.add_parser(name, help=text, add_help=False)
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    from .demo import cli  # imports jax: only once a command was chosen

    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())
