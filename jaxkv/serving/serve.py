"""The serving benchmark behind ``python -m jaxkv serve``: one request stream, several engines.

An engine is the serving loop below with one cache kind (``caches.py``, or ``fixed_slot.py``, the
pure-JAX bar). The device does the work in four jitted functions, the cache and the per-row state
donated (updated in place):

- ``prefill``: starts newly admitted rows from the saved system prompt (``kind.admit``: a fork of
  its pages, or a copy), then runs one chunk of at most ``prefill_chunk`` prompt tokens for each
  of at most ``prefill_rows`` rows (``kind.attend_rows``; compiled for a few row counts, the
  smallest that holds the chunk is called); a row whose prompt ends in the chunk gets its first
  token and starts decoding. A long prompt thus takes several iterations, each of which also
  decodes: it never stalls the others.
- ``decode``: ``decode_steps`` greedy steps per iteration (``mixed_steps`` while prompts are
  still being prefilled, so that prefill keeps pace), every decoding row one token per step, in
  two calls of a fixed number of steps: the host reads the first call's tokens while the GPU runs
  the second. Stops are decided on the device: a row stops at its token budget or at the end
  token. Paged: each step reserves its pages on the device; a row that gets none stalls for the
  rest of the call (and the host preempts).
- ``evict``: rows that finished (or were preempted) leave; ``kind.evict`` compacts the survivors
  to the front (jaxkv's linear and paged kinds) or frees the slots in place (fixed slots).
- ``save``: the shared system prompt, prefilled once into row 0, kept for every admission.

The host, between calls: admits arrived requests into free rows (paged: while the pool has pages
for their prompts, with a 1% watermark, as counted by the last decode call: reading the count after
an eviction would make the GPU wait; over batch shards, each shard's rows and pool), picks the
prefill chunks, reads the tokens, and on a shortage of pages preempts the youngest request (of
the shard that ran short), which later starts again from its prompt and the
tokens it had generated (recomputation, vLLM's default policy; greedy decoding makes the result the
same); no request is admitted then until one finishes, so that the pool does not thrash.
All layers run in a ``lax.scan`` over stacked weights with a traced layer index (``unroll``: a
Python loop over them, for comparison).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv.sharding

from jaxkv import _windows

from . import caches, loop
from ..models import decoder as M
from .fixed_slot import FixedSlotKind
from .metrics import profile_summary
from .schedule import Schedule
# The streams live in stream.py; the serving loop's users find them here too.
from .stream import (STREAMS, ServeRequest, StreamConfig, fresh, lognormal_lengths,  # noqa: F401
                     make_stream, oracle_reuse)

ENGINES = {
    "paged": "jaxkv PagedKVCache: reserve / append / release, the system prompt shared by fork",
    "linear": "jaxkv LinearKVCache: rows of max_seq_len, finished rows evicted by compaction",
    "fixed": "fixed slots in pure JAX (no jaxkv): slots of max_seq_len, masked dense attention",
    "linear-xla": "the linear engine's loop with XLA-formulated cache ops (the demo's ops=xla)",
    "paged-xla": "the paged engine's loop with XLA-formulated cache ops (gathers whole rows)",
    "paged-8bit": "the paged engine with its cache in 8 bits (--kv-dtype), per-token-head scales",
    "paged-prefix": "the paged engine with automatic prefix caching: a request starts on the "
                    "cached pages of its longest indexed prefix (match_prefix / insert_prefix)",
    "paged-swap": "the paged engine preempting by swap: a preempted request's pages go to host "
                  "memory (swap_out) and come back when it is readmitted (swap_in)",
    "paged-global": "a model with sliding windows: the paged engine keeping every layer's "
                    "tokens (the windows apply in attention only; vLLM with its hybrid manager "
                    "off), where paged releases what a window layer no longer sees",
    "paged-global-8bit": "paged-global with its cache in 8 bits (--kv-dtype)",
}
PREEMPT = ("recompute", "swap")  # --preempt: what the paged engines do with a preempted request
KV_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "int8": "int8"}  # --kv-dtype
DEFAULT_ENGINES = ("paged", "fixed", "linear", "linear-xla")  # the targets first


# --- engines (the host's schedule: schedule.py; the report: metrics.py) ---


def kv_bytes_per_token(cfg: M.ModelConfig, dtype, scaled: bool = False) -> int:
    """K and V bytes of one token, every layer (an 8-bit cache's with its float32 scales)."""
    per_head = cfg.head_dim * jnp.dtype(dtype).itemsize + (4 if scaled else 0)
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head


@dataclasses.dataclass(frozen=True)
class Plan:
    """How an engine spends the KV budget: ``batch`` rows; paged: ``num_pages`` pages."""

    name: str
    batch: int
    num_pages: int | None = None
    page_size: int | None = None


def plan(name: str, kv_bytes: int, per_token: int, max_seq_len: int, page_size: int,
         max_batch: int, cfg: M.ModelConfig | None = None) -> Plan:
    """Rows of ``max_seq_len`` (linear, fixed) or pages (paged) that fit in ``kv_bytes``; the
    paged engines decode at most ``max_batch`` rows together. A model with windows (``cfg``): a
    paged engine that releases window pages has pages of one layer group (a page table per
    group over one pool), more of them for the same bytes."""
    tokens = kv_bytes // per_token
    if name.startswith("paged"):
        pages = tokens // page_size
        if cfg is not None and cfg.hybrid and "global" not in name.split("-"):
            pages = pages * cfg.num_layers // _windows.groups(cfg.windows).slots
        return Plan(name, max(1, max_batch), pages, page_size)
    return Plan(name, tokens // max_seq_len)


def sequence_bytes(name: str, cfg: M.ModelConfig, per_token: int, tokens: int, page_size: int,
                   chunk: int) -> int:
    """KV bytes a sequence of ``tokens`` holds in engine ``name`` (``per_token``: a token's,
    every layer): a paged engine of a model with windows releases what each window no longer
    sees (its window groups hold ``ceil((window + chunk) / page_size) + 1`` pages at most)."""
    if not (name.startswith("paged") and cfg.hybrid and "global" not in name.split("-")):
        return per_token * tokens
    groups = _windows.groups(cfg.windows)
    kind = caches.PagedKind(cfg, page_size=page_size, windows=cfg.windows)
    return kind.row_pages(tokens, chunk) * page_size * per_token * groups.slots // cfg.num_layers


def make_kind(name: str, cfg: M.ModelConfig, dtype: str, p: Plan, unroll: bool = False,
              kv_dtype: str = "float8_e4m3fn", sharding=None, host_pages: int = 0):
    """The cache kind of engine ``name``; ``sharding`` (a ``jaxkv.CacheSharding``): jaxkv's
    caches split over KV heads and batch (the fixed slots' buffers over KV heads too);
    ``host_pages``: a paged engine's host tier (it then preempts by swap; ``paged-swap``
    always has one)."""
    if name == "fixed":  # unrolled layers: a buffer per layer, as a JAX expert keeps them
        return FixedSlotKind(cfg, dtype, per_layer=unroll,
                             mesh=None if sharding is None else sharding.mesh)
    base, *mods = name.split("-")
    options = dict(page_size=p.page_size, num_pages=p.num_pages) if base == "paged" else {}
    ops = "xla" if "xla" in mods else "jaxkv"
    if "8bit" in mods:
        options["kv_dtype"] = kv_dtype
    if "prefix" in mods:
        options["prefix_cache"] = True
    if "swap" in mods:
        host_pages = host_pages or p.num_pages
    if base == "paged" and host_pages and ops != "xla":
        options["host_pages"] = host_pages
    if base == "paged" and cfg.hybrid and "global" not in mods:
        options["windows"] = cfg.windows  # window layers release their old pages
    if sharding is not None:
        options["sharding"] = sharding
    return caches.make_kind(base, cfg, dtype, ops, **options)


class ServeEngine(loop.Engine):
    """The serving loop over one cache kind (see the module's docstring). From the demo's
    ``loop.Engine`` it keeps ``abstract_cache`` and ``cache_copies`` (copies of the cache in the
    compiled functions: 0 when every call updates it in place)."""

    def __init__(self, cfg: M.ModelConfig, params, kind, *, batch: int, max_seq_len: int,
                 system_prompt, prefill_rows: int | tuple[int, ...], prefill_chunk: int,
                 decode_steps: int, mixed_steps: int | None = None, unroll: bool = False):
        # unroll: the layers as a Python loop (static layer indices) instead of a scan
        layers = M.unstack_layers if unroll else M.stack_layers
        self.cfg, self.params, self.kind = cfg, layers(params), kind
        self.batch = self.max_batch = batch
        self.max_seq_len = max_seq_len
        self.system_prompt = np.asarray(system_prompt, np.int32)
        # Over k batch shards a chunk's lanes are k equal groups, one a shard (schedule.Chunk):
        # each lane count rounds up to a multiple of k.
        self.lane_shards = k = getattr(kind, "batch_shards", 1)
        self.lane_sizes = tuple(sorted({-(-w // k) * k
                                        for w in np.atleast_1d(prefill_rows).tolist()}))
        self.prefill_rows, self.prefill_chunk = self.lane_sizes[-1], prefill_chunk
        self.decode_steps = decode_steps
        self.mixed_steps = min(decode_steps, mixed_steps or decode_steps)
        self.prefix = bool(getattr(kind, "prefix_cache", False))  # automatic prefix caching
        # A host tier: a prefix-caching engine spills cached pages to it ahead of eviction;
        # any other paged engine preempts by swapping rows to it.
        tier = bool(getattr(kind, "host_pages", 0))
        self.swap, self.spill = tier and not self.prefix, tier and self.prefix
        # On a mesh: the small per-row arrays replicated.
        sharding = getattr(kind, "sharding", None)
        mesh = getattr(kind, "mesh", None) or (sharding.mesh if sharding is not None else None)
        self.replicated = (None if mesh is None else
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        # ... and a prefill chunk's lanes split over the batch shards, so that each device
        # runs the model on its own rows' tokens (replicated, every device ran every lane)
        self.split_lanes = (self.replicated if k == 1 else
                            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
                                sharding.batch)))
        self.functions = self._jit_functions()
        self._compiled = None
        self.step_counts = tuple(sorted({1, *self.halves(self.decode_steps),
                                         *self.halves(self.mixed_steps)}))

    def _jit_functions(self) -> dict[str, Callable]:
        cfg, kind, batch = self.cfg, self.kind, self.batch
        i32 = jnp.int32

        def pin(x):  # the per-row state stays replicated on a mesh, whatever XLA would choose,
            # so that every compiled function takes what the others return
            if self.replicated is None:
                return x
            return jax.lax.with_sharding_constraint(x, self.replicated)

        def placed(cache):  # a cache kind that is not jaxkv's keeps its own placement
            if getattr(kind, "mesh", None) is None:
                return cache
            return jax.lax.with_sharding_constraint(cache, kind.placement(cache))

        def stops(tokens, remaining, eos):  # tokens still to make after `tokens` (eos -1: none)
            return jnp.where(tokens == eos, 0, remaining)

        def prefill(params, cache, tok, remaining, saved, new, rows, tokens, n, last, budget,
                    eos):
            cache = kind.admit(cache, saved, new)
            return chunk(params, cache, tok, remaining, rows, tokens, n, last, budget, eos)

        def prefill_prefix(params, cache, tok, remaining, new, rows, seq, total, budget, space,
                           eos):
            # With a prefix cache: each lane carries its request's whole sequence (system prompt,
            # prompt, output so far) and its tenant (space: the prefix index's namespace). A
            # row's first lane (new) starts it on the cached pages of its tenant's longest
            # indexed prefix; every lane then runs the next chunk from the row's length, and the
            # pages it filled become findable to its tenant: all on the device.
            at = jnp.clip(rows, 0, batch - 1)
            width = seq.shape[1]
            cache, matched = kind.match(cache, rows, seq, jnp.where(new, total, 0), space)
            start = kind.lengths(cache)[at]
            size = self.prefill_chunk
            n = jnp.where(rows < batch, jnp.clip(total - start, 0, size), 0)
            pick = jnp.clip(start[:, None] + jnp.arange(size, dtype=i32)[None, :], 0, width - 1)
            tokens = jnp.take_along_axis(seq, pick, axis=1)
            last = (rows < batch) & (start + n == total)
            cache, tok, remaining, first, ok = chunk(params, cache, tok, remaining, rows, tokens,
                                                     n, last, budget, eos)
            n = jnp.where(ok, n, 0)
            cache = kind.insert(cache, rows, seq, start + n, space)
            return cache, pin(tok), pin(remaining), first, ok, n, last, matched

        def chunk(params, cache, tok, remaining, rows, tokens, n, last, budget, eos):
            at = jnp.clip(rows, 0, batch - 1)
            n_full = jnp.zeros((batch,), i32).at[rows].set(n, mode="drop")
            cache, served = kind.reserve_served(cache, n_full)
            ok = served[at] & (rows < batch)
            n = jnp.where(ok, n, 0)
            steps = tokens.shape[1]
            positions = kind.lengths(cache)[at][:, None] + jnp.arange(steps, dtype=i32)[None, :]

            def attend(cache, i, q, k, v, spec):
                return kind.attend_rows(cache, i, rows, q, k.transpose(0, 2, 1, 3),
                                        v.transpose(0, 2, 1, 3), n, positions, spec)

            x, cache = M.decoder(cfg, params, tokens, positions, attend, cache)
            cache = kind.commit(cache, jnp.where(served, n_full, 0))
            x = jnp.take_along_axis(x, jnp.clip(n - 1, 0, steps - 1)[:, None, None], axis=1)[:, 0]
            first = jnp.argmax(M.logits(cfg, params, x), -1).astype(i32)
            ends = jnp.where(ok & last, rows, batch)  # rows whose prompt ends here start decoding
            tok = tok.at[ends].set(first, mode="drop")
            remaining = remaining.at[ends].set(stops(first, budget - 1, eos), mode="drop")
            return placed(cache), pin(tok), pin(remaining), first, ok

        def decode(params, cache, tok, remaining, eos, steps):
            # A fixed trip count (steps is static): XLA then runs the loop without reading a
            # predicate back to the host after every step, so the call is dispatched
            # asynchronously like any other (a data-dependent exit blocks the host for the whole
            # call). A row that stops early idles for the rest of the call.
            parked = kind.on_host(cache) if self.swap else jnp.zeros((batch,), bool)

            def body(i, c):
                cache, tok, remaining, out, stalled = c
                want = (remaining > 0) & ~stalled & ~parked  # a swapped row waits its turn
                cache, served = kind.reserve_served(cache, want.astype(i32))
                go = want & served
                logits, cache = M.forward(cfg, params, kind, cache, tok[:, None],
                                          go.astype(i32), reserve=False)
                nxt = jnp.argmax(logits, -1).astype(i32)
                out = out.at[i].set(jnp.where(go, nxt, -1))
                remaining = jnp.where(go, stops(nxt, remaining - 1, eos), remaining)
                return (cache, jnp.where(go, nxt, tok), remaining, out,
                        stalled | (want & ~served))

            out = jnp.full((steps, batch), -1, i32)
            init = (cache, tok, remaining, out, jnp.zeros((batch,), bool))
            cache, tok, remaining, out, stalled = jax.lax.fori_loop(0, steps, body, init)
            live = kind.live(cache)
            uncached = kind.uncached_free_pages(cache) if self.spill else jnp.int32(0)
            by_shard = (kind.reserved_by_shard(cache) if hasattr(kind, "reserved_by_shard")
                        else kind.reserved_tokens(cache)[None])
            usage = jnp.concatenate([jnp.stack([
                jnp.sum(live, dtype=i32), jnp.sum(jnp.where(live, kind.lengths(cache), 0),
                                                  dtype=i32), jnp.sum(by_shard), uncached]),
                by_shard])
            # `remaining` is donated to the next call; the host reads which rows are done
            return placed(cache), pin(tok), pin(remaining), out, stalled, usage, remaining == 0

        def evict(cache, tok, remaining, mapping):
            cache = kind.evict(cache, mapping)
            keep = jnp.where(mapping >= 0, mapping, batch)
            move = lambda x: jnp.zeros_like(x).at[keep].set(x, mode="drop")  # noqa: E731
            return (placed(cache), pin(move(tok)), pin(move(remaining)),
                    kind.reserved_tokens(cache))

        def save(cache):
            cache, saved = kind.save(cache, len(self.system_prompt))
            return placed(kind.clear(cache, 0)), saved

        fns = dict(prefill=jax.jit(prefill_prefix if self.prefix else prefill,
                                   donate_argnums=(1, 2, 3)),
                    decode=jax.jit(decode, donate_argnums=(1, 2, 3), static_argnums=(5,)),
                   evict=jax.jit(evict, donate_argnums=(0, 1, 2)),
                   save=jax.jit(save, donate_argnums=(0,)))
        def swap_out(cache, rows, size):  # -> (cache, moved [B], pages moved)
            cache, moved = kind.swap_out(cache, rows, size)
            return placed(cache), moved, jnp.sum(jnp.where(moved, kind.host_pages_held(cache),
                                                           0))

        def swap_in(cache, rows, size):  # the pages moved: those the rows held on the host
            held = kind.host_pages_held(cache)
            cache, moved = kind.swap_in(cache, rows, size)
            return placed(cache), moved, jnp.sum(jnp.where(moved, held, 0))

        def spill(cache, count):  # -> (cache, pages spilled): at most count, a whole row
            cache, n = cache.spill_prefix(self.whole_row, count)
            return placed(cache), n

        if self.swap:  # `size`: static, the most pages a call moves (a whole row)
            fns.update(swap_out=jax.jit(swap_out, donate_argnums=(0,), static_argnums=(2,)),
                       swap_in=jax.jit(swap_in, donate_argnums=(0,), static_argnums=(2,)))
        if self.spill:
            fns["spill"] = jax.jit(spill, donate_argnums=(0,))
        return fns

    def put(self, *arrays) -> tuple:
        """Host arrays on the engine's devices in one call: on a mesh, replicated, as every
        compiled function takes them (an array on the first device alone was copied to the
        others, device to device, at each call)."""
        return jax.device_put(arrays, self.replicated)

    def put_lanes(self, arrays, on_lanes) -> tuple:
        """A prefill chunk's host arrays on the devices in one call, those that lead with the
        lane axis (``on_lanes``, as ``schedule.Chunk.on_lanes``) split over the batch shards."""
        if self.replicated is None:
            return jax.device_put(arrays)
        return jax.device_put(arrays, tuple(self.split_lanes if lanes else self.replicated
                                            for lanes in on_lanes))

    def warm_rows(self, width: int) -> np.ndarray:
        """Rows for a warm-up chunk of ``width`` lanes: each lane group's within its shard."""
        group, per = width // self.lane_shards, self.batch // self.lane_shards
        lane = np.arange(width)
        return ((lane // group) * per + np.minimum(lane % group, per - 1)).astype(np.int32)

    @property
    def whole_row(self) -> int:
        return -(-self.max_seq_len // self.kind.page_size)

    def example_args(self) -> dict[str, tuple]:
        # the weights as placed (tensor parallel: split over the mesh)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                             sharding=x.sharding), self.params)
        if self.swap or self.spill:  # lowered from a real cache: a ShapeDtypeStruct cannot
            # say that the host tier lives in host memory, and the compiled functions would
            # expect device memory
            cache = self.kind.create(self.batch, self.max_seq_len)
        else:
            cache = jax.eval_shape(lambda: self.kind.create(self.batch, self.max_seq_len))
        if self.replicated is not None:  # on a mesh: eval_shape drops the placement
            mesh = self.replicated.mesh
            if self.swap or self.spill:  # a real cache: placed, its host tier in host memory
                shardings = jax.tree.map(lambda x: x.sharding, cache)
            elif hasattr(self.kind, "placement"):
                shardings = self.kind.placement(cache)
            else:  # a jaxkv cache: the partition spec of each leaf, from its roles
                specs = jaxkv.sharding.leaf_specs(cache, self.kind.sharding)
                shardings = jax.tree.map(lambda spec: jax.sharding.NamedSharding(mesh, spec),
                                         specs, is_leaf=lambda x: isinstance(
                                             x, jax.sharding.PartitionSpec))
            cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                 cache, shardings)
        # the host's arrays: replicated on a mesh (``put``)
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=self.replicated)  # noqa
        row = i32(self.batch)
        _, saved = jax.eval_shape(self.functions["save"], cache)
        bools = lambda n: jax.ShapeDtypeStruct((n,), jnp.bool_, sharding=self.replicated)  # noqa
        # a chunk's lane arrays: split over the batch shards (put_chunk)
        lanes = lambda dtype, *s: jax.ShapeDtypeStruct(s, dtype, sharding=self.split_lanes)  # noqa
        i, b = jnp.int32, jnp.bool_
        if self.prefix:
            prefill = {f"prefill{r}": (params, cache, row, row, lanes(b, r), lanes(i, r),
                                       lanes(i, r, self.max_seq_len), lanes(i, r), lanes(i, r),
                                       lanes(i, r), i32())
                       for r in self.lane_sizes}
        else:
            prefill = {f"prefill{r}": (params, cache, row, row, saved, bools(self.batch),
                                       lanes(i, r), lanes(i, r, self.prefill_chunk), lanes(i, r),
                                       lanes(b, r), lanes(i, r), i32())
                       for r in self.lane_sizes}
        decode = {f"decode{n}": (params, cache, row, row, i32(), n) for n in self.step_counts}
        swaps = {d: (cache, bools(self.batch), self.whole_row)
                 for d in ("swap_out", "swap_in") if self.swap}
        if self.spill:  # one compiled spill: a transfer's cost is the pages it moves
            swaps["spill"] = (cache, i32())
        return dict(**prefill, **decode, **swaps, evict=(cache, row, row, row), save=(cache,))

    @staticmethod
    def halves(steps: int) -> tuple[int, ...]:
        """An iteration's decode steps as its two calls (one call for a single step)."""
        return tuple(n for n in (steps - steps // 2, steps // 2) if n)

    def compile(self) -> dict:
        """Every function compiled once (static shapes) and run once on a scratch cache, so that
        no timed call pays a first execution."""
        if self._compiled is None:
            args = self.example_args()
            fns = {k: self.functions[k.rstrip("0123456789")].lower(*a).compile(
                       loop.COMPILER_OPTIONS)
                   for k, a in args.items()}
            # A host-tier engine lowers from a real cache: freed before the warm-up makes its
            # own, or the device holds two pools (at 8B on an 80 GB card: out of memory).
            del args
            self._compiled = fns
            cache, tok, rem, saved = self._start(fns)
            b = self.batch
            no_eos, = self.put(np.int32(-1))
            for r in self.lane_sizes:
                ones = np.ones((r,), np.int32)
                lanes = self.warm_rows(r)
                if self.prefix:
                    cache, tok, rem, *_ = fns[f"prefill{r}"](
                        self.params, cache, tok, rem, *self.put_lanes(
                            (np.ones((r,), bool), lanes, np.zeros((r, self.max_seq_len), np.int32),
                             ones, ones * 2, ones * 0), (True,) * 6), no_eos)
                else:
                    new = np.zeros((b,), bool)
                    new[lanes] = True
                    cache, tok, rem, _, _ = fns[f"prefill{r}"](
                        self.params, cache, tok, rem, saved, *self.put_lanes(
                            (new, lanes, np.zeros((r, self.prefill_chunk), np.int32), ones,
                             np.ones((r,), bool), ones * 2), (False,) + (True,) * 5), no_eos)
                for n in self.step_counts:
                    cache, tok, rem, *_ = fns[f"decode{n}"](self.params, cache, tok, rem, no_eos)
                cache, tok, rem, _ = fns["evict"](cache, tok, rem,
                                                  *self.put(np.full((b,), -1, np.int32)))
            jax.block_until_ready(cache)
        return self._compiled

    def _start(self, fns):
        """(cache, tok, remaining, saved): an empty cache and the system prompt saved."""
        kind, b = self.kind, self.batch
        # The first row of each batch shard takes the prompt (a shard's rows never leave it).
        cache = kind.clear(kind.create(b, self.max_seq_len), 1)
        shards = getattr(kind, "batch_shards", 1)
        firsts = [s * (b // shards) for s in range(shards)]
        tok, remaining = self.put(np.zeros((b,), np.int32), np.zeros((b,), np.int32))
        _, saved = jax.eval_shape(self.functions["save"], cache)
        dummy = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), saved)
        none = np.zeros((b,), bool)
        prompt, chunk, r = self.system_prompt, self.prefill_chunk, self.lane_sizes[0]
        if self.prefix:  # every request prefills (or finds) the system prompt itself
            cache, saved = fns["save"](cache)
            return cache, tok, remaining, saved
        no_eos, = self.put(np.int32(-1))
        # a lane a shard, the first of each lane group (lane_sizes are multiples of the shards)
        lanes = np.arange(shards) * (r // shards)
        for start in range(0, len(prompt), chunk):
            part = prompt[start:start + chunk]
            tokens = np.zeros((r, chunk), np.int32)
            tokens[lanes, :len(part)] = part
            rows = np.full((r,), b, np.int32)
            rows[lanes] = firsts
            n = np.zeros((r,), np.int32)
            n[lanes] = len(part)
            cache, tok, remaining, _, _ = fns[f"prefill{r}"](
                self.params, cache, tok, remaining, dummy, *self.put_lanes(
                    (none, rows, tokens, n, np.zeros((r,), bool), np.ones((r,), np.int32)),
                    (False,) + (True,) * 5), no_eos)
        cache, saved = fns["save"](cache)
        return cache, tok, remaining, saved

    def run(self, requests: list[ServeRequest], *, steps: int | None = None,
            eos: int | None = None, duration: float | None = None,
            profile: tuple[float, int] | None = None, progress: Callable | None = None) -> dict:
        """Serves ``requests`` (their outputs filled in) and returns the run's measurements.

        ``steps``: decode steps per call (default ``decode_steps``, and ``mixed_steps`` while
        prompts are being prefilled; 1: one step per dispatch).
        ``eos``: the end token (a request stops after generating it), or None.
        ``duration``: stop after this many seconds of serving (a saturated server measured over a
        fixed window: give more requests than it can serve); the requests still running keep the
        tokens they have. None: serve every request.
        ``profile``: (seconds, iterations): the iterations that start once this many seconds of
        serving have passed run under the JAX profiler.
        """
        for r in requests:
            total = len(self.system_prompt) + len(r.prompt) + r.max_new_tokens
            if len(r.prompt) < 1 or r.max_new_tokens < 1 or total > self.max_seq_len:
                raise ValueError(f"request {r.id}: {total} tokens, max_seq_len {self.max_seq_len}")
        mixed_n = self.mixed_steps if steps is None else steps
        steps_n = self.decode_steps if steps is None else steps
        wanted = set(self.halves(mixed_n) + self.halves(steps_n))
        if not wanted <= set(self.step_counts):  # compiled for these step counts too
            self.step_counts = tuple(sorted(wanted | set(self.step_counts)))
            self._compiled = None
        t = time.perf_counter()
        fns = self.compile()
        compile_s = time.perf_counter() - t
        eos, = self.put(np.int32(-1 if eos is None else eos))
        cache, tok, remaining, saved = self._start(fns)
        jax.block_until_ready(cache)
        sched = Schedule(self, requests, cache.num_pages if hasattr(cache, "ref_counts") else 0)
        m, trace_dir, window = sched.m, None, None
        start = time.perf_counter()
        now = lambda: time.perf_counter() - start  # noqa: E731
        second = None  # the last iteration's second decode call, read during this one
        while sched.done < len(requests) and (duration is None or now() < duration):
            if profile and trace_dir is None and now() >= profile[0]:
                trace_dir = tempfile.mkdtemp(prefix="jaxkv-serve-")
                jax.profiler.start_trace(trace_dir)
                window = [time.perf_counter(), None]
                profile_end = m["iterations"] + profile[1]
            # The host prepares and dispatches this iteration while the GPU still runs the last
            # one's second decode call, so the GPU's queue never runs dry.
            sched.arrive(now())
            mapping = sched.leave()
            admitted = sched.admit()
            sched.note_drain(now())
            sched.note_half(now(), duration)
            chunk = sched.prefill_chunk(admitted)
            if mapping is not None:
                cache, tok, remaining, _ = fns["evict"](cache, tok, remaining,
                                                        *self.put(mapping))
            if self.swap:
                cache = self._swap(fns, sched, cache)
            if self.spill and (pages := sched.spill_wanted()):
                cache, n = fns["spill"](cache, *self.put(np.int32(pages)))
                sched.m["spilled"].append(n)  # read at the end: no wait here
            if chunk is not None:
                extra = () if self.prefix else (saved,)
                cache, tok, remaining, *prefilled = fns[f"prefill{chunk.width}"](
                    self.params, cache, tok, remaining, *extra,
                    *self.put_lanes(chunk.arrays(), chunk.on_lanes()), eos)
                m["prefill_calls"] += 1
            calls = []
            # The iteration's decode steps in two calls: the host waits for the first one's
            # results (with the prefill's) and prepares the next iteration while the GPU runs
            # the second, which the host reads after dispatching that next iteration. Rows
            # finishing in the second call leave one iteration later.
            for part in self.halves(mixed_n if sched.prefilling else steps_n) if sched.live else ():
                cache, tok, remaining, *res = fns[f"decode{part}"](self.params, cache, tok,
                                                                   remaining, eos)
                calls.append((res, list(sched.live), part))
            m["decode_calls"] += len(calls)
            if second is not None:
                sched.take(second, None, now)
                second = None
            if not calls:  # nothing to do until the next arrival
                sched.wait(now())
                m["iterations"] += 1
                continue
            sched.take(calls[0], (chunk, *prefilled) if chunk is not None else None, now)
            if len(calls) == 2:
                second = calls[1]
                sched.reserve_ahead(second[2])
            m["iterations"] += 1
            if window is not None and window[1] is None and m["iterations"] == profile_end:
                if second is not None:
                    jax.block_until_ready(second[0])
                window[1] = time.perf_counter()
                jax.profiler.stop_trace()
            if progress is not None:
                progress(sched.done, len(requests))
        if second is not None:
            sched.take(second, None, now)
        wall = now()
        if window is not None and window[1] is None:
            window[1] = time.perf_counter()
            jax.profiler.stop_trace()
        mapping = sched.leave(everyone=True)  # so that the cache ends empty
        if mapping is not None:
            cache, tok, remaining, _ = fns["evict"](cache, tok, remaining, *self.put(mapping))
        self.final_cache = cache
        audit = getattr(self.kind, "miscounted_pages", None)  # paged: the allocator's audit
        m["miscounted_pages"] = None if audit is None else audit(cache)
        # prefix cache: the index's audit, pages whose chain crosses tenants (namespaces)
        m["cross_tenant_pages"] = self.kind.cross_namespace_pages(cache) if self.prefix else None
        m.update(wall=wall, compile_s=compile_s, usage=np.array(sched.usage).reshape(-1, 4),
                 spilled_pages=int(sum(int(n) for n in m["spilled"])),
                 page_size=sched.page_size or 0,
                 profile=profile_summary(trace_dir, window) if trace_dir else None)
        return m


    def _swap(self, fns, sched: "Schedule", cache):
        """Dispatches the schedule's swaps, a row per call, and reads whether each moved (a
        small read that waits for the device; it happens only around a preemption)."""
        for direction, row, r in sched.swaps():
            mask = np.zeros((self.batch,), bool)
            mask[row] = True
            cache, moved, count = fns[direction](cache, *self.put(mask))
            sched.swapped(direction, r, bool(np.asarray(moved)[row]), int(count))
        return cache
