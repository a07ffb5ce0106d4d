"""``python -m jaxkv demo``: a small Llama served with continuous batching from a jaxkv cache.

- ``model.py``: the decoder (RMSNorm, RoPE, GQA, SwiGLU) and a cache-free reference.
- ``hf_loader.py``: a local Hugging Face Llama checkpoint (config.json + safetensors).
- ``caches.py``: one adapter per cache kind, with jaxkv ops or plain-XLA ops.
- ``loop.py``: the request stream and the jitted, cache-donating step functions.
- ``cli.py``: the command line, progress bar and report.
"""
