"""jaxkv: KV-cache management for JAX inference loops (XLA FFI custom calls, CUDA and CPU).

The caches (``LinearKVCache``, ``KVCacheManager``, ``PagedKVCache``) are pytrees whose methods
return new caches; under ``jit`` with the cache donated every method runs in place. The functional
ops below work on raw arrays. ``jaxkv.reference`` holds a pure-jnp version of every op.
"""

from . import reference as reference
from .linear import LinearKVCache as LinearKVCache
from .manager import KVCacheManager as KVCacheManager
from .manager import KVLayerConfig as KVLayerConfig
from .ops import compact_kv_cache as compact_kv_cache
from .ops import compact_tensor_batch as compact_tensor_batch
from .ops import increment_lengths as increment_lengths
from .paged import PagedKVCache as PagedKVCache
from .paged_ops import NO_PAGE as NO_PAGE
from .paged_ops import copy_pages as copy_pages
from .paged_ops import paged_append as paged_append
from .paged_ops import paged_gather as paged_gather
from .reuse import SavedKV as SavedKV
from .reuse import instantiate_kv_cache as instantiate_kv_cache
from .reuse import save_kv_cache as save_kv_cache

__version__ = "0.1.0"

__all__ = [
    "LinearKVCache",
    "KVCacheManager",
    "KVLayerConfig",
    "PagedKVCache",
    "SavedKV",
    "NO_PAGE",
    "compact_kv_cache",
    "compact_tensor_batch",
    "copy_pages",
    "increment_lengths",
    "instantiate_kv_cache",
    "paged_append",
    "paged_gather",
    "reference",
    "save_kv_cache",
]


def __dir__() -> list[str]:
    # dir(jaxkv) lists the public API, not the private modules importing it loads.
    return sorted(__all__ + ["__version__"])
