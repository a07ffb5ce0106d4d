"""``python -m jaxkv COMMAND [options]``: ``python -m jaxkv --help`` lists the commands."""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "demo": "serve a stream of requests with continuous batching from a jaxkv cache",
    "serve": "the serving benchmark: jaxkv paged and linear, fixed slots in pure JAX and jaxkv's "
             "loop with XLA cache ops on one request stream, at one KV memory budget",
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
    # Imports jax: only once a command was chosen.
    if args.command == "serve":
        from .demo import serve_cli

        return serve_cli.main(rest)
    from .demo import cli

    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())
