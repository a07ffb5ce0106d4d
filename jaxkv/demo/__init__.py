"""``python -m jaxkv demo`` and ``python -m jaxkv serve``: the command lines.

- ``cli.py``: the demo, a stream of requests with continuous batching (``jaxkv.serving.loop``),
  its progress bar and report.
- ``serve_cli.py``: the serving benchmark (``jaxkv.serving.serve``) over its presets and engines.

The models live in ``jaxkv.models``, the engines and cache adapters in ``jaxkv.serving``.
"""
