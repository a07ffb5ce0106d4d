"""Decoder-only models on jaxkv's caches: Llama, Mistral, Gemma 2, Gemma 3 and gpt-oss.

- ``config.py``: ``ModelConfig``, one dataclass for every family's switches.
- ``layers.py``: norms, RoPE variants, gated MLPs, experts, dense attention.
- ``decoder.py``: the shared skeleton (scanned or unrolled layers), random weights, ``forward``
  over a cache kind (``jaxkv.serving.caches``) and the cache-free reference.
- ``llama.py``, ``mistral.py``, ``gemma.py``, ``gpt_oss.py``: each family's checkpoint config
  and weight names; ``registry.py``: the families by ``model_type`` and the presets.
- ``hf_loader.py``: a local Hugging Face checkpoint (config.json + safetensors), streamed.
"""

from .config import ModelConfig, RopeScaling
from .registry import FAMILIES, PRESETS

__all__ = ["FAMILIES", "PRESETS", "ModelConfig", "RopeScaling"]
