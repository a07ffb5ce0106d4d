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
an eviction would make the GPU wait), picks the prefill chunks, reads the tokens, and on a
shortage of pages preempts the youngest request, which later starts again from its prompt and the
tokens it had generated (recomputation, vLLM's default policy; greedy decoding makes the result the
same); no request is admitted then until one finishes, so that the pool does not thrash.
All layers run in a ``lax.scan`` over stacked weights with a traced layer index (``unroll``: a
Python loop over them, for comparison).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv.sharding

from . import caches, loop
from . import model as M
from .fixed_slot import FixedSlotKind
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
}
PREEMPT = ("recompute", "swap")  # --preempt: what the paged engines do with a preempted request
KV_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "int8": "int8"}  # --kv-dtype
DEFAULT_ENGINES = ("paged", "fixed", "linear", "linear-xla")  # the targets first


# --- the request stream: stream.py ---

# --- engines ---


def kv_bytes_per_token(cfg: M.LlamaConfig, dtype, scaled: bool = False) -> int:
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
         max_batch: int) -> Plan:
    """Rows of ``max_seq_len`` (linear, fixed) or pages (paged) that fit in ``kv_bytes``; the
    paged engines decode at most ``max_batch`` rows together."""
    tokens = kv_bytes // per_token
    if name.startswith("paged"):
        pages = tokens // page_size
        return Plan(name, max(1, max_batch), pages, page_size)
    return Plan(name, tokens // max_seq_len)


def make_kind(name: str, cfg: M.LlamaConfig, dtype: str, p: Plan, unroll: bool = False,
              kv_dtype: str = "float8_e4m3fn", sharding=None, host_pages: int = 0):
    """The cache kind of engine ``name``; ``sharding`` (a ``jaxkv.CacheSharding``): jaxkv's
    caches split over KV heads and batch (the fixed slots' buffers over KV heads too);
    ``host_pages``: a paged engine's host tier (it then preempts by swap; ``paged-swap``
    always has one)."""
    if name == "fixed":  # unrolled layers: a buffer per layer, as a JAX expert keeps them
        return FixedSlotKind(cfg, dtype, per_layer=unroll,
                             mesh=None if sharding is None else sharding.mesh)
    base, _, ops = name.partition("-")
    options = dict(page_size=p.page_size, num_pages=p.num_pages) if base == "paged" else {}
    if ops == "8bit":
        ops, options = "jaxkv", dict(options, kv_dtype=kv_dtype)
    if ops == "prefix":
        ops, options = "jaxkv", dict(options, prefix_cache=True)
    if ops == "swap":
        ops, host_pages = "jaxkv", host_pages or p.num_pages
    if base == "paged" and host_pages and ops != "xla":
        options["host_pages"] = host_pages
    if sharding is not None:
        options["sharding"] = sharding
    return caches.make_kind(base, cfg, dtype, ops or "jaxkv", **options)


class FreeSlots:
    """The schedule of slots that never move (fixed slots): ``loop.Slots``' interface, a new
    request takes the lowest free slot and a finished one frees its own."""

    def __init__(self, max_batch: int):
        self.max_batch = max_batch
        self.slots: list[ServeRequest | None] = [None] * max_batch

    def __len__(self) -> int:
        return sum(r is not None for r in self.slots)

    def rows(self):
        return [(i, r) for i, r in enumerate(self.slots) if r is not None]

    def admit(self, pending: list) -> list:
        admitted = []
        for i in range(self.max_batch):
            if not pending:
                break
            if self.slots[i] is None:
                self.slots[i] = pending.pop()
                admitted.append((i, self.slots[i]))
        return admitted

    def evict(self, done: Callable) -> tuple[np.ndarray, list]:
        mapping = np.arange(self.max_batch, dtype=np.int32)
        finished = []
        for i, r in enumerate(self.slots):
            if r is None:
                mapping[i] = -1
            elif done(r):
                finished.append(r)
                self.slots[i], mapping[i] = None, -1
        return mapping, finished


class ServeEngine(loop.Engine):
    """The serving loop over one cache kind (see the module's docstring). From the demo's
    ``loop.Engine`` it keeps ``abstract_cache`` and ``cache_copies`` (copies of the cache in the
    compiled functions: 0 when every call updates it in place)."""

    def __init__(self, cfg: M.LlamaConfig, params, kind, *, batch: int, max_seq_len: int,
                 system_prompt, prefill_rows: int | tuple[int, ...], prefill_chunk: int,
                 decode_steps: int, mixed_steps: int | None = None, unroll: bool = False):
        # unroll: the layers as a Python loop (static layer indices) instead of a scan
        layers = M.unstack_layers if unroll else M.stack_layers
        self.cfg, self.params, self.kind = cfg, layers(params), kind
        self.batch = self.max_batch = batch
        self.max_seq_len = max_seq_len
        self.system_prompt = np.asarray(system_prompt, np.int32)
        self.lane_sizes = tuple(sorted(set(np.atleast_1d(prefill_rows).tolist())))
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

        def prefill_prefix(params, cache, tok, remaining, new, rows, seq, total, budget, eos):
            # With a prefix cache: each lane carries its request's whole sequence (system prompt,
            # prompt, output so far). A row's first lane (new) starts it on the cached pages of
            # its longest indexed prefix; every lane then runs the next chunk from the row's
            # length, and the pages it filled become findable: all on the device.
            at = jnp.clip(rows, 0, batch - 1)
            width = seq.shape[1]
            cache, matched = kind.match(cache, rows, seq, jnp.where(new, total, 0))
            start = kind.lengths(cache)[at]
            size = self.prefill_chunk
            n = jnp.where(rows < batch, jnp.clip(total - start, 0, size), 0)
            pick = jnp.clip(start[:, None] + jnp.arange(size, dtype=i32)[None, :], 0, width - 1)
            tokens = jnp.take_along_axis(seq, pick, axis=1)
            last = (rows < batch) & (start + n == total)
            cache, tok, remaining, first, ok = chunk(params, cache, tok, remaining, rows, tokens,
                                                     n, last, budget, eos)
            n = jnp.where(ok, n, 0)
            cache = kind.insert(cache, rows, seq, start + n)
            return cache, pin(tok), pin(remaining), first, ok, n, last, matched

        def chunk(params, cache, tok, remaining, rows, tokens, n, last, budget, eos):
            at = jnp.clip(rows, 0, batch - 1)
            n_full = jnp.zeros((batch,), i32).at[rows].set(n, mode="drop")
            cache, served = kind.reserve_served(cache, n_full)
            ok = served[at] & (rows < batch)
            n = jnp.where(ok, n, 0)
            steps = tokens.shape[1]
            positions = kind.lengths(cache)[at][:, None] + jnp.arange(steps, dtype=i32)[None, :]

            def attend(cache, i, q, k, v):
                return kind.attend_rows(cache, i, rows, q, k.transpose(0, 2, 1, 3),
                                        v.transpose(0, 2, 1, 3), n, positions)

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
            usage = jnp.stack([jnp.sum(live, dtype=i32),
                               jnp.sum(jnp.where(live, kind.lengths(cache), 0), dtype=i32),
                               kind.reserved_tokens(cache), uncached])
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

        def spill(cache, size):  # -> (cache, pages spilled)
            cache, n = cache.spill_prefix(size)
            return placed(cache), n

        if self.swap:  # `size`: static, the most pages a call moves (a whole row)
            fns.update(swap_out=jax.jit(swap_out, donate_argnums=(0,), static_argnums=(2,)),
                       swap_in=jax.jit(swap_in, donate_argnums=(0,), static_argnums=(2,)))
        if self.spill:
            fns["spill"] = jax.jit(spill, donate_argnums=(0,), static_argnums=(1,))
        return fns

    @property
    def spill_sizes(self) -> tuple[int, ...]:
        """The most pages a spill moves, compiled per size: powers of two, then a whole row. (A
        swap moves one row, whatever its size, in one compiled function: a transfer's cost is
        the pages it moves.)"""
        if not self.spill:
            return ()
        whole = self.whole_row
        return tuple(sorted({min(1 << i, whole) for i in range(whole.bit_length() + 1)}))

    @property
    def whole_row(self) -> int:
        return -(-self.max_seq_len // self.kind.page_size)

    def spill_size(self, pages: int) -> int:
        return min(n for n in self.spill_sizes if n >= min(pages, self.spill_sizes[-1]))

    def example_args(self) -> dict[str, tuple]:
        shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
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
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
        row = jax.ShapeDtypeStruct((self.batch,), jnp.int32, sharding=self.replicated)
        _, saved = jax.eval_shape(self.functions["save"], cache)
        bools = lambda n: jax.ShapeDtypeStruct((n,), jnp.bool_)  # noqa: E731
        if self.prefix:
            prefill = {f"prefill{r}": (params, cache, row, row, bools(r), i32(r),
                                       i32(r, self.max_seq_len), i32(r), i32(r), i32())
                       for r in self.lane_sizes}
        else:
            prefill = {f"prefill{r}": (params, cache, row, row, saved, bools(self.batch),
                                       i32(r), i32(r, self.prefill_chunk), i32(r), bools(r),
                                       i32(r), i32())
                       for r in self.lane_sizes}
        decode = {f"decode{n}": (params, cache, row, row, i32(), n) for n in self.step_counts}
        swaps = {d: (cache, bools(self.batch), self.whole_row)
                 for d in ("swap_out", "swap_in") if self.swap}
        swaps.update({f"spill{n}": (cache, n) for n in self.spill_sizes})
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
            for r in self.lane_sizes:
                ones = jnp.ones((r,), jnp.int32)
                lanes = jnp.minimum(jnp.arange(r, dtype=jnp.int32), b - 1)
                if self.prefix:
                    cache, tok, rem, *_ = fns[f"prefill{r}"](
                        self.params, cache, tok, rem, jnp.ones((r,), bool), lanes,
                        jnp.zeros((r, self.max_seq_len), jnp.int32), ones, ones * 2,
                        jnp.int32(-1))
                else:
                    cache, tok, rem, _, _ = fns[f"prefill{r}"](
                        self.params, cache, tok, rem, saved, jnp.arange(b) < min(r, b), lanes,
                        jnp.zeros((r, self.prefill_chunk), jnp.int32), ones,
                        jnp.ones((r,), bool), ones * 2, jnp.int32(-1))
                for n in self.step_counts:
                    cache, tok, rem, *_ = fns[f"decode{n}"](self.params, cache, tok, rem,
                                                            jnp.int32(-1))
                cache, tok, rem, _ = fns["evict"](cache, tok, rem, jnp.full((b,), -1, jnp.int32))
            jax.block_until_ready(cache)
        return self._compiled

    def _start(self, fns):
        """(cache, tok, remaining, saved): an empty cache and the system prompt saved."""
        kind, b = self.kind, self.batch
        # The first row of each batch shard takes the prompt (a shard's rows never leave it).
        cache = kind.clear(kind.create(b, self.max_seq_len), 1)
        shards = getattr(kind, "batch_shards", 1)
        firsts = [s * (b // shards) for s in range(shards)]
        tok = jax.device_put(jnp.zeros((b,), jnp.int32), self.replicated)
        remaining = jax.device_put(jnp.zeros((b,), jnp.int32), self.replicated)
        _, saved = jax.eval_shape(self.functions["save"], cache)
        dummy = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), saved)
        none = jnp.zeros((b,), bool)
        prompt, chunk, r = self.system_prompt, self.prefill_chunk, self.lane_sizes[0]
        if self.prefix:  # every request prefills (or finds) the system prompt itself
            cache, saved = fns["save"](cache)
            return cache, tok, remaining, saved
        for start in range(0, len(prompt), chunk):
            part = prompt[start:start + chunk]
            for group in range(0, shards, r):
                lanes = firsts[group:group + r]
                tokens = np.zeros((r, chunk), np.int32)
                tokens[:len(lanes), :len(part)] = part
                rows = np.full((r,), b, np.int32)
                rows[:len(lanes)] = lanes
                n = np.zeros((r,), np.int32)
                n[:len(lanes)] = len(part)
                cache, tok, remaining, _, _ = fns[f"prefill{r}"](
                    self.params, cache, tok, remaining, dummy, none, jnp.asarray(rows),
                    jnp.asarray(tokens), jnp.asarray(n), jnp.zeros((r,), bool),
                    jnp.ones((r,), jnp.int32), jnp.int32(-1))
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
        eos = jnp.int32(-1 if eos is None else eos)
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
            chunk = sched.prefill_chunk(admitted)
            if mapping is not None:
                cache, tok, remaining, _ = fns["evict"](cache, tok, remaining, mapping)
            if self.swap:
                cache = self._swap(fns, sched, cache)
            if self.spill and (pages := sched.spill_wanted()):
                cache, n = fns[f"spill{self.spill_size(pages)}"](cache)
                sched.m["spilled"].append(n)  # read at the end: no wait here
            if chunk is not None:
                extra = () if self.prefix else (saved,)
                cache, tok, remaining, *prefilled = fns[f"prefill{chunk.width}"](
                    self.params, cache, tok, remaining, *extra, *chunk.arrays(), eos)
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
            cache, tok, remaining, _ = fns["evict"](cache, tok, remaining, mapping)
        self.final_cache = cache
        audit = getattr(self.kind, "miscounted_pages", None)  # paged: the allocator's audit
        m["miscounted_pages"] = None if audit is None else audit(cache)
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
            cache, moved, count = fns[direction](cache, jnp.asarray(mask))
            sched.swapped(direction, r, bool(np.asarray(moved)[row]), int(count))
        return cache


@dataclasses.dataclass
class Chunk:
    """One prefill call: ``width`` rows (lanes), each up to ``prefill_chunk`` prompt tokens."""

    lanes: list  # (row, request) of the lanes in use
    new: np.ndarray  # bool [B]: rows admitted now (they start from the system prompt)
    rows: np.ndarray  # int32 [width]: the lanes' rows; B for an unused lane
    tokens: np.ndarray  # int32 [width, chunk]
    n: np.ndarray  # int32 [width]: tokens of each lane
    last: np.ndarray  # bool [width]: the chunk ends the lane's prompt
    budget: np.ndarray  # int32 [width]: tokens the request may still generate
    # Prefix cache: each lane's whole sequence [width, max_seq_len] and its length; the device
    # picks the chunk from the row's length (``new``: bool [width], the row's first lane).
    seq: np.ndarray | None = None
    total: np.ndarray | None = None

    @property
    def width(self) -> int:
        return len(self.rows)

    def arrays(self):
        if self.seq is not None:
            return tuple(jnp.asarray(x) for x in (self.new, self.rows, self.seq, self.total,
                                                  self.budget))
        return tuple(jnp.asarray(x) for x in (self.new, self.rows, self.tokens, self.n,
                                              self.last, self.budget))


# Waiting requests a prefix-caching engine looks past for one whose prefix is not being
# prefilled (bounds the host's work per admission).
_DEFER_SCAN = 64


class Schedule:
    """The host's side of a run: the queue, the rows (``loop.Slots``, or ``FreeSlots`` for a kind
    that does not compact), admission, the prefill chunks, reading results, preemption."""

    def __init__(self, engine: ServeEngine, requests: list[ServeRequest], num_pages: int):
        self.engine, self.requests = engine, requests
        kind, b = engine.kind, engine.batch
        self.page_size = getattr(kind, "page_size", None) if num_pages else None
        self.num_pages = self.free_pages = num_pages
        self.syslen = len(engine.system_prompt)
        self.future = collections.deque(sorted(requests, key=lambda r: r.arrival))
        self.waiting: collections.deque[ServeRequest] = collections.deque()
        shards = getattr(kind, "batch_shards", 1)
        self.slots = loop.Slots(b, shards) if getattr(kind, "compacts", True) else FreeSlots(b)
        self.leaving: set[int] = set()
        self.hold = False  # after a preemption, no admission until a request finishes
        self.to_host: list[ServeRequest] = []  # preempted, to swap out in the next iteration
        self.to_device: list[ServeRequest] = []  # swapped, to bring back in the next iteration
        self.short = False  # a row got no page in the last iteration
        self.order = self.done = 0
        self.live: list = []
        # [live rows, live tokens, reserved tokens, never-cached free pages] after each decode
        self.usage: list = []
        self.uncached = num_pages  # never-cached free pages (a prefix cache), as last read
        self.sys_indexed = False  # prefix cache: a row has indexed the system prompt's full pages
        self.prefilling = 0  # rows still prefilling after the current chunk
        self.m = dict(iterations=0, prefill_calls=0, decode_calls=0, evict_calls=0,
                      decode_steps=0, preemptions=0, peak_live=0, peak_decoding=0, busy_host=0.0,
                      prefill_requested=0, prefill_computed=0, prefill_matched=0,
                      swaps_out=0, swaps_in=0, swap_pages_out=0, swap_pages_in=0, deferred=0,
                      spilled=[])

    def arrive(self, t: float) -> None:
        while self.future and self.future[0].arrival <= t:
            self.waiting.append(self.future.popleft())

    def wait(self, t: float) -> None:
        if self.future:
            time.sleep(max(0.0, self.future[0].arrival - t))

    def leave(self, everyone: bool = False):
        """The ``batch_mapping`` that evicts the finished and preempted rows, or None."""
        if everyone:
            self.leaving |= {id(r) for _, r in self.slots.rows()}
        if not self.leaving:
            return None
        mapping, _ = self.slots.evict(lambda r: id(r) in self.leaving)
        self.leaving.clear()
        self.m["evict_calls"] += 1
        return jnp.asarray(mapping)

    def pages_in_use(self, reserved_tokens) -> None:
        if self.page_size:
            self.free_pages = self.num_pages - int(reserved_tokens) // self.page_size

    def reserve_ahead(self, steps: int) -> None:
        """A decode call of ``steps`` is running and not read yet: admission counts the most
        pages it may take (every decoding row crossing ``ceil(steps / page_size)`` pages)."""
        if self.page_size:
            rows = sum(r.phase == "decode" for _, r in self.live)
            self.free_pages -= rows * _pages(steps, self.page_size)

    def admit(self) -> list:
        """Moves waiting requests into free rows, first come first served; paged: while the pool
        has pages for their prompts (beyond what the rows still prefilling will take, and a 1%
        watermark). A request preempted before is prefilled with the tokens it had made."""
        chosen, size = [], self.page_size
        if size:
            pending = sum(_pages(self.syslen + len(r.ext), size)
                          - _pages(self.syslen + r.offset, size)
                          for _, r in self.slots.rows() if r.phase == "prefill")
            room = self.free_pages - pending - max(1, self.num_pages // 100)
            room -= self._swap_ins(room)
            if any(r.phase == "swapped" and r not in self.to_device for _, r in self.slots.rows()):
                self.live = self.slots.rows()  # the swapped come back before anyone new
                return self.slots.admit([])
        free_rows = self.engine.batch - len(self.slots)
        prefilling = [r for _, r in self.slots.rows() if r.phase == "prefill"]
        i = 0
        while (i < len(self.waiting) and len(chosen) < free_rows
               and not (self.hold and len(self.slots))):
            r = self.waiting[i]
            ext = np.concatenate([r.prompt, np.asarray(r.output, np.int32)])
            if self.engine.prefix and i < _DEFER_SCAN and self._waits_for(ext, prefilling + chosen):
                i += 1  # its prefix is still being prefilled by another row: later, it finds it
                self.m["deferred"] += 1
                continue
            if size:
                need = _pages(self.syslen + len(ext) + 1, size) - self.syslen // size
                if need > room and (chosen or len(self.slots)):
                    break
                room -= need
            r.ext, r.offset, r.phase, r.order = ext, 0, "prefill", self.order
            r.started = False
            self.order += 1
            chosen.append(r)
            del self.waiting[i]
        admitted = self.slots.admit(list(reversed(chosen)))
        self.live = self.slots.rows()
        self.m["peak_live"] = max(self.m["peak_live"], len(self.live))
        return admitted

    def _waits_for(self, ext: np.ndarray, prefilling: list) -> bool:
        """Whether a waiting request (its prompt and output ``ext``) shares full pages with a
        row still prefilling that has not yet made them findable (the index gets a row's pages
        chunk by chunk): admitted now, it would compute them again. Under load, turns of one
        conversation and requests of one long prompt arrive while the first of them is still
        prefilling: a burst then reuses the oracle's best (tests/test_serve.py). (On an H100 at
        16 chat conversations/s reuse stayed near 72% of the unbounded oracle's, which counts
        pages the pool has evicted: docs/serving.md.) The system prompt's pages, shared by every
        request, only until a first row has indexed them (at the start)."""
        size = self.page_size
        if not size or not prefilling:
            return False
        sys_pages = self.syslen // size
        total = self.syslen + len(ext)
        if not self.sys_indexed and min(sys_pages, (total - 1) // size) > 0:
            return True  # the system prompt's pages: the first row to prefill them indexes them
        if total <= (sys_pages + 1) * size:
            return False  # no full page past the system prompt's to share
        head = slice(0, (sys_pages + 1) * size - self.syslen)  # ext's part of that first page
        for other in prefilling:
            if len(other.ext) < head.stop or not np.array_equal(other.ext[head], ext[head]):
                continue
            m = min(len(ext), len(other.ext))
            differ = np.flatnonzero(other.ext[:m] != ext[:m])
            shared = self.syslen + (int(differ[0]) if differ.size else m)
            usable = min(shared, self.syslen + len(ext) - 1) // size * size  # match leaves one
            if usable > self.syslen + other.offset:  # the other row has not indexed them yet
                return True
        return False

    def spill_wanted(self) -> int:
        """Pages to spill to the host now (a prefix-caching engine with a host tier): what the
        next iteration may take beyond the never-cached free pages, so that reserve evicts no
        cached page the host has room for."""
        e, size = self.engine, self.page_size
        decoding = sum(r.phase == "decode" for _, r in self.slots.rows())
        ahead = (e.prefill_rows * _pages(e.prefill_chunk, size) + 1
                 + decoding * _pages(max(e.decode_steps, 1), size))
        want = ahead - self.uncached
        if want <= 0:
            return 0
        self.uncached += want  # until the next read: do not spill the same pages twice
        return want

    def _swap_ins(self, room: int) -> int:
        """Plans bringing swapped requests back, oldest first, while their pages fit in
        ``room`` and no preemption is pending; returns the pages they take. With no row running,
        the oldest comes back whatever the estimate says (the device decides), so that the
        schedule always moves."""
        active = self._active()
        if self.hold and active:
            return 0
        swapped = sorted((r for _, r in self.slots.rows()
                          if r.phase == "swapped" and r not in self.to_host), key=lambda r: r.order)
        taken = 0
        for r in swapped:
            need = self._pages_held(r)
            if taken + need > room and (active or taken):
                break
            taken += need
            self.to_device.append(r)
        return taken

    def _active(self) -> int:
        return sum(r.phase in ("prefill", "decode") for _, r in self.slots.rows())

    def _pages_held(self, r: ServeRequest) -> int:
        """The most pages of its own request ``r``'s row can hold (the system prompt's full
        pages are shared with the prompt row: a swap leaves them on the device): its tokens in
        the cache, and what the calls in flight may have added."""
        e = self.engine
        tokens = self.syslen + (len(r.prompt) + len(r.output) + max(e.decode_steps, 1)
                                if "decode" in (r.phase, r.resume) else r.offset + e.prefill_chunk)
        return max(1, _pages(tokens + 1, self.page_size) - self.syslen // self.page_size)

    def swaps(self) -> list:
        """(direction, row, request) of the swaps to dispatch now, outs first."""
        rows = {id(r): row for row, r in self.slots.rows()}
        plan = [(d, rows[id(r)], r)
                for d, queue in (("swap_out", self.to_host), ("swap_in", self.to_device))
                for r in queue if id(r) in rows and r.phase == "swapped"]
        self.to_host, self.to_device = [], []
        return plan

    def swapped(self, direction: str, r: ServeRequest, moved: bool, pages: int) -> None:
        """A swap's outcome. A request whose pages found no room on the host is preempted by
        recomputation instead; one that found no room on the device stays on the host, unless no
        row is running: then it could only wait for itself, and is recomputed instead."""
        if not moved and (direction == "swap_out" or not self._active()):
            self._requeue(r)
        elif moved:
            kind = "out" if direction == "swap_out" else "in"
            self.m[f"swaps_{kind}"] += 1
            self.m[f"swap_pages_{kind}"] += pages
            if kind == "in":
                r.phase, r.resume = r.resume, ""

    def note_drain(self, t: float) -> None:
        """The drain begins when the queue is empty and fewer than half the peak rows are left."""
        if (self.m.get("drained_at") is None and not (self.future or self.waiting)
                and 2 * len(self.live) < self.m["peak_live"]):
            self.m["drained_at"] = t
            self.m["drained_tokens"] = sum(len(r.output) for r in self.requests)

    def prefill_chunk(self, admitted) -> Chunk | None:
        """The next chunk of the oldest rows still prefilling, on the fewest lanes that hold
        them; None when there is nothing to admit or prefill."""
        e = self.engine
        waiting = sorted(((r.order, row, r) for row, r in self.live if r.phase == "prefill"),
                         key=lambda x: x[0])
        lanes = [(row, r) for _, row, r in waiting[: e.prefill_rows]]
        self.prefilling = len(waiting)
        if not (admitted or lanes):
            return None
        width = min(w for w in e.lane_sizes if w >= len(lanes))
        new = np.zeros((e.batch,), bool)
        new[[row for row, _ in admitted]] = True
        c = Chunk(lanes, new, np.full((width,), e.batch, np.int32),
                  np.zeros((width, e.prefill_chunk), np.int32), np.zeros((width,), np.int32),
                  np.zeros((width,), bool), np.ones((width,), np.int32))
        if e.prefix:
            c.new = np.zeros((width,), bool)
            c.seq = np.zeros((width, e.max_seq_len), np.int32)
            c.total = np.zeros((width,), np.int32)
        for i, (row, r) in enumerate(lanes):
            part = r.ext[r.offset:r.offset + e.prefill_chunk]
            c.rows[i], c.n[i], c.tokens[i, :len(part)] = row, len(part), part
            c.last[i] = r.offset + len(part) == len(r.ext)
            c.budget[i] = r.max_new_tokens - len(r.output)
            if e.prefix:
                whole = np.concatenate([e.system_prompt, r.ext])
                c.seq[i, :len(whole)], c.total[i], c.new[i] = whole, len(whole), not r.started
            if not r.started:
                self.m["prefill_requested"] += self.syslen + len(r.ext)
                r.started = True
        self.prefilling -= int(c.last.sum())  # prefix cache: at least (a match only helps)
        return c

    def take(self, call, prefill, now: Callable[[], float]) -> None:
        """A decode call's results (and the prefill's before it), read in one transfer: tokens,
        finished and stalled rows, pages in use; timed by ``now()`` once they are here."""
        (out, stalled, usage, done), live, _ = call
        got = jax.device_get((out, stalled, usage, done) + (prefill[1:] if prefill else ()))
        host = time.perf_counter()
        if prefill is not None:
            (self.prefilled_prefix if self.engine.prefix else self.prefilled)(prefill[0],
                                                                              *got[4:])
        out, stalled, usage, done = got[:4]
        self.decoded(live, out, done, stalled, now())
        self.pages_in_use(usage[2])
        self.uncached = int(usage[3])
        self.usage.append(usage)
        self.preempt_if_short()
        self.m["busy_host"] += time.perf_counter() - host

    def prefilled(self, c: Chunk, first: np.ndarray, ok: np.ndarray) -> None:
        for i, (row, r) in enumerate(c.lanes):
            if _doing(r) != "prefill":  # preempted (recomputed) since the chunk was dispatched
                continue
            if not ok[i]:  # no pages for the chunk
                self.short = True
                continue
            self.m["prefill_computed"] += int(c.n[i])
            r.offset += int(c.n[i])
            if c.last[i]:
                r.output.append(int(first[i]))
                _set_doing(r, "decode")

    def prefilled_prefix(self, c: Chunk, first, ok, n, last, matched) -> None:
        """A prefix-cache chunk's results: tokens run and matched per lane, as the device chose."""
        for i, (row, r) in enumerate(c.lanes):
            if r.phase != "prefill":
                continue
            if c.new[i]:
                if not r.preemptions:  # its first admission: what the oracle is measured on
                    r.matched = int(matched[i])
                self.m["prefill_matched"] += int(matched[i])
                r.offset = int(matched[i]) - self.syslen
            self.m["prefill_computed"] += int(n[i])
            if not ok[i]:
                self.short = True
                continue
            r.offset += int(n[i])
            # (its pages are indexed after each chunk; the system prompt's are shared by all)
            size = self.page_size
            self.sys_indexed |= self.syslen + r.offset >= self.syslen // size * size
            if last[i]:
                r.output.append(int(first[i]))
                r.phase = "decode"

    def decoded(self, live: list, out: np.ndarray, done: np.ndarray, stalled: np.ndarray,
                t: float) -> None:
        """A decode call's results: ``live`` the (row, request) pairs when it was dispatched,
        ``out`` [steps, B] tokens (-1: none), ``done`` [B] rows with nothing left to make."""
        decoding = 0
        made = out.T.tolist()
        for row, r in live:
            if _doing(r) != "decode":  # still prefilling, or preempted (recomputed) since
                continue
            decoding += 1
            r.output.extend(x for x in made[row] if x >= 0)
            if r.first_time is None:
                r.first_time = t
            self.short |= bool(stalled[row])
            if done[row]:
                if r in self.to_host:  # finished in the call that ran out of pages
                    self.to_host.remove(r)
                r.phase, r.finish_time = "done", t
                self.leaving.add(id(r))
                self.done += 1
                self.hold = False
        self.m["decode_steps"] += int(np.max(np.sum(out >= 0, axis=0), initial=0))
        self.m["peak_decoding"] = max(self.m["peak_decoding"], decoding)

    def preempt_if_short(self) -> None:
        """Out of pages: the youngest request is preempted: its pages go to the host (a
        swapping engine), or it leaves, back to the front of the queue, to be recomputed."""
        short, self.short = self.short, False
        victims = [r for _, r in self.live
                   if r.phase in ("prefill", "decode") and id(r) not in self.leaving]
        if short and victims:
            v = max(victims, key=lambda r: r.order)
            v.preemptions += 1
            self.m["preemptions"] += 1
            self.hold = True
            if self.engine.swap:
                v.phase, v.resume = "swapped", v.phase
                self.to_host.append(v)
            else:
                self._requeue(v)

    def _requeue(self, r: ServeRequest) -> None:
        r.phase, r.resume = "waiting", ""
        self.leaving.add(id(r))
        self.waiting.appendleft(r)


def _doing(r: ServeRequest) -> str:
    """What a request's row does on the device: a swapped one finishes its calls in flight."""
    return r.resume if r.phase == "swapped" else r.phase


def _set_doing(r: ServeRequest, phase: str) -> None:
    if r.phase == "swapped":
        r.resume = phase
    else:
        r.phase = phase


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


# --- measurements ---


def percentile(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(requests: list[ServeRequest], m: dict, per_token: int, allocated: int,
              oracle: dict | None = None) -> dict:
    """The report of one engine's run (times in seconds, memory in bytes). ``oracle``: request id
    -> the tokens an unbounded prefix cache could give it (``oracle_reuse``)."""
    started = [r for r in requests if r.started]
    best = sum(oracle[r.id] for r in started) if oracle else 0
    wall = m["wall"]
    out_tokens = sum(len(r.output) for r in requests)  # also of requests cut by a duration
    done = [r for r in requests if r.finish_time is not None]
    ttft = [r.first_time - r.arrival for r in requests if r.first_time is not None]
    tpot = [(r.finish_time - r.first_time) / (len(r.output) - 1)
            for r in done if len(r.output) > 1]
    usage = m["usage"]
    return dict(
        requests=len(done), output_tokens=out_tokens, wall_s=wall,
        tokens_per_s=out_tokens / wall, requests_per_s=len(done) / wall,
        # Until the drain, where only the longest requests are left (its length is set by the
        # stream's longest outputs, whatever the engine): the loaded phase.
        loaded_tokens_per_s=(m["drained_tokens"] / m["drained_at"]
                             if m.get("drained_at") else None),
        loaded_s=m.get("drained_at"),
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
        peak_concurrent=m["peak_live"], peak_decoding=m["peak_decoding"],
        kv_allocated_bytes=allocated,
        kv_reserved_mean_bytes=float(np.mean(usage[:, 2])) * per_token if len(usage) else 0.0,
        kv_live_mean_bytes=float(np.mean(usage[:, 1])) * per_token if len(usage) else 0.0,
        kv_reserved_peak_bytes=int(np.max(usage[:, 2], initial=0)) * per_token,
        iterations=m["iterations"], decode_calls=m["decode_calls"],
        prefill_calls=m["prefill_calls"], evict_calls=m["evict_calls"],
        decode_steps=m["decode_steps"], preemptions=m["preemptions"],
        swaps_out=m["swaps_out"], swaps_in=m["swaps_in"],
        spilled_pages=m["spilled_pages"],
        swap_bytes=(m["swap_pages_out"] + m["swap_pages_in"] + m["spilled_pages"]) * per_token
        * m["page_size"],
        host_s=m["busy_host"], compile_s=m["compile_s"], profile=m["profile"],
        prefill_requested=m["prefill_requested"], prefill_computed=m["prefill_computed"],
        prefill_matched=m["prefill_matched"], oracle_reuse=best,
        miscounted_pages=m.get("miscounted_pages"),
        reuse_of_oracle=(sum(r.matched for r in started) / best) if best else None,
    )


def classify(name: str) -> str:
    """A GPU kernel's share: "attention", "cache" (writes, moves, page and slot bookkeeping) or
    "other" (the model's matmuls and fusions). jaxkv's kernels are recognised by their mangled
    names; XLA's cache ops by the scatter / dynamic-update-slice / gather in their fusion's name
    (a heuristic: XLA's attention is fused with the model's other ops and counts as "other")."""
    low = name.lower()
    if "jaxkv" in low:
        return "attention" if ("attention" in low or "prefill_tc" in low or "combine" in low) \
            else "cache"
    if any(w in low for w in ("scatter", "dynamic_update_slice", "dynamic-update-slice",
                              "gather")):
        return "cache"
    return "other"


def profile_summary(trace_dir: str, window) -> dict | None:
    """GPU busy time (the union of kernel intervals) over the window's wall time, and the share of
    kernel time by ``classify``; None on a machine without GPU planes in the trace (the CPU)."""
    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not paths:
        return None
    try:
        data = jax.profiler.ProfileData.from_file(paths[0])
    except Exception as e:  # a profiler without the reader: say so, keep the run's results
        print(f"profile: cannot read {paths[0]}: {e}")
        return None
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = [ln for ln in plane.lines if ln.name.startswith("Stream")] or [
            ln for ln in plane.lines if "XLA" not in ln.name]
        events += [(e.name, e.start_ns, e.duration_ns) for line in lines for e in line.events]
    return kernel_summary(events, window[1] - window[0]) if events else None


def kernel_summary(events, wall: float) -> dict:
    """``events``: (kernel name, start ns, duration ns). GPU busy = the union of the intervals
    (kernels of several streams may overlap), shares of the summed kernel time by ``classify``.
    ``idle``: the GPU's idle time between its first and last kernel, split into gaps under 20 us
    (launch latency within a call) and longer ones, the longest named by the kernels around them
    (where the host made the GPU wait)."""
    by_kind, by_name = collections.Counter(), collections.Counter()
    short, long_gaps = 0, collections.Counter()
    busy, end, last = 0, -1, None
    for name, start, duration in sorted(events, key=lambda e: e[1]):
        by_kind[classify(name)] += duration
        by_name[name] += duration
        if last is not None and start > end:
            if start - end < 20_000:
                short += start - end
            else:
                long_gaps[(last[:60], name[:60])] += start - end
        if start + duration > end:
            busy += start + duration - max(start, end)
            end, last = start + duration, name
    kernels = sum(by_kind.values()) or 1
    ms = 1e-6
    return dict(window_s=wall, gpu_busy_s=busy * 1e-9, gpu_busy_share=busy * 1e-9 / wall,
                kernels=len(events),
                **{f"{k}_share": by_kind[k] / kernels for k in ("cache", "attention", "other")},
                top=[(name[:120], t / kernels) for name, t in by_name.most_common(10)],
                idle=dict(short_gaps_ms=short * ms, long_gaps_ms=sum(long_gaps.values()) * ms,
                          longest=[(f"after {a} / before {b}", t * ms)
                                   for (a, b), t in long_gaps.most_common(6)]))
