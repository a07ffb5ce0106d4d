"""Redraws the serving plot from the JSON of a run (for a GPU machine without matplotlib):

    python3 tools/serve_plot.py docs/serving-8b.json docs/serving-8b.png
"""

from __future__ import annotations

import json
import sys

from jaxkv.demo import serve_cli


def main(argv) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    doc = json.loads(open(argv[0]).read())
    serve_cli.plot([*doc["engines"].values(), *doc["sweep"]], argv[1],
                   f"{doc['model']}, {doc['dtype']}, {doc['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
