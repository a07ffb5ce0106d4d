"""``ModelConfig``: one decoder-only transformer's shapes and the choices its family makes.

Every family (``llama.py``, ``mistral.py``, ``gemma.py``, ``gpt_oss.py``) is the same skeleton
(``decoder.py``) with a few switches: per-layer sliding windows, soft caps, sinks, the norm's form,
the MLP's activation or experts, and RoPE's variants. A family's module turns its checkpoint's
``config.json`` into this; ``registry.PRESETS`` names the shapes the serving benchmark runs.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE's frequency scaling, as transformers' ``rope_parameters`` name it.

    ``kind``: ``"llama3"`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_positions``), ``"linear"`` (``factor``) or ``"yarn"`` (``factor``,
    ``beta_fast``, ``beta_slow``, ``original_max_positions``, ``truncate``; cos and sin scaled by
    ``0.1 ln(factor) + 1``).
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str = "llama"  # llama, mistral, gemma2, gemma3, gpt_oss (registry.FAMILIES)
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Attention. ``windows``: each layer's sliding window (the last ``w`` tokens a query sees,
    # itself included) or None for a global layer; None: every layer global.
    windows: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None  # Gemma 3: the window layers' RoPE base (unscaled)
    query_scale: float | None = None  # the softmax scale; None: head_dim ** -0.5
    attn_soft_cap: float | None = None  # Gemma 2: scores -> cap * tanh(s / cap)
    final_soft_cap: float | None = None  # Gemma 2: the same on the logits
    sinks: bool = False  # gpt-oss: a learned sink logit per query head
    attention_bias: bool = False  # gpt-oss: q, k, v and o projections with a bias
    qk_norm: bool = False  # Gemma 3: RMSNorm over each head's q and k, before RoPE
    # Gemma: RMSNorm weights are offsets from 1, post-norms after attention and the MLP, the
    # embedding scaled by sqrt(hidden_size).
    gemma_norms: bool = False
    activation: str = "silu"  # the gated MLP's: silu (SwiGLU) or gelu_tanh (GeGLU)
    # gpt-oss: a mixture of experts in place of the MLP (top-k routing, clamped SwiGLU).
    num_experts: int = 0
    experts_per_token: int = 0
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        name = type(self).__name__
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{name}: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"{name}: head_dim must be even for RoPE, got {self.head_dim}")
        if self.windows is not None:
            if len(self.windows) != self.num_layers:
                raise ValueError(f"{name}: windows has {len(self.windows)} entries for "
                                 f"{self.num_layers} layers")
            if any(w is not None and (not isinstance(w, int) or w < 1) for w in self.windows):
                raise ValueError(f"{name}: each window must be None or an int >= 1, got "
                                 f"{self.windows}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"{name}: activation must be silu or gelu_tanh, got "
                             f"{self.activation!r}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"{name}: experts_per_token must be in [1, num_experts], got "
                             f"{self.experts_per_token} of {self.num_experts}")

    @property
    def hybrid(self) -> bool:
        """Some layer has a sliding window."""
        return self.windows is not None and any(w is not None for w in self.windows)

    def window(self, layer: int) -> int | None:
        return None if self.windows is None else self.windows[layer]
