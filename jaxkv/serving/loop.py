"""Continuous batching: a stream of requests served from one KV cache by jitted step functions.

The host keeps the schedule (``Slots``: which request lives in which row, how many tokens each
still needs); the device does the work in four jitted functions, each with the cache donated so it
is updated in place:

- ``prompt``: prefills the shared system prompt once, into row 0 (once per batch shard, into its
  first row, when the cache's batch is split); its KV is then saved.
- ``admit``: rows freed by evictions start from the saved system prompt (instantiate), and the new
  requests' user turns are prefilled together, ragged (``new_lengths``); yields each first token.
- ``decode``: ``n`` greedy steps in a ``fori_loop``, one token appended per live row per step;
  ``n`` is the number of steps until the next request finishes.
- ``evict``: finished rows leave; survivors are compacted to the front of their batch shard
  (rows ``[0, survivors)`` when the batch is not split).
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..models import decoder as M

# XLA's rematerialization pass, which runs when a program's planned memory (the donated cache
# counted as input and again as output) passes the device's limit, miscompiled the serving steps
# of an 8B model with a 16 GiB paged cache (H100, jax 0.11.2, 2026-11-26): pages were given to
# two sequences (413 reference counts wrong after 10 s), the tokens garbage. The steps need no
# rematerialization (their real peak is the weights and the cache), so it is off for them.
COMPILER_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}


@dataclasses.dataclass
class Request:
    id: int
    prompt: np.ndarray  # int32 [P]: the user turn (after the shared system prompt)
    max_new_tokens: int
    output: list = dataclasses.field(default_factory=list)


def make_requests(num: int, vocab: int, seed: int, prompt_len: tuple[int, int],
                  new_tokens: tuple[int, int]) -> list[Request]:
    """A random request stream: user turns and answer lengths drawn from the given ranges."""
    rng = np.random.default_rng(seed)
    return [
        Request(
            id=i,
            prompt=rng.integers(0, vocab, rng.integers(prompt_len[0], prompt_len[1] + 1),
                                dtype=np.int32),
            max_new_tokens=int(rng.integers(new_tokens[0], new_tokens[1] + 1)),
        )
        for i in range(num)
    ]


DECODE_CHUNK = 256  # most decode steps in one call of the jitted decode loop
PHASES = ("compile + warm-up", "system prompt", "admit + prefill", "decode", "evict")


@dataclasses.dataclass
class Stats:
    times: dict = dataclasses.field(default_factory=lambda: {p: 0.0 for p in PHASES})
    generated: int = 0
    prefilled: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    admissions: int = 0  # requests admitted
    admit_steps: int = 0  # admit + prefill calls (each admits every request that fits)
    evictions: int = 0  # requests evicted
    evict_steps: int = 0  # evict calls
    peak_in_use: int = 0
    allocated: int = 0
    cache_copies: int = -1  # set by the caller (Engine.cache_copies)

    @property
    def serving_time(self) -> float:
        return sum(t for p, t in self.times.items() if p != "compile + warm-up")


class Slots:
    """The schedule: which request lives in which cache row.

    The ``max_batch`` rows split into ``shards`` batch shards (``--mesh dp=k``; one without), each
    a cache of its own rows (docs/sharding.md): shard ``s`` owns rows ``[s * B/k, (s + 1) * B/k)``,
    its requests live in the first of them in admission order, and an eviction compacts its
    survivors to its own front, so no row ever moves to another shard. With one shard: rows
    ``[0, live)``, survivors compacted to ``[0, survivors)``. Every per-shard decision of the loop
    is made here; the device steps take global row ids and masks.
    """

    def __init__(self, max_batch: int, shards: int = 1):
        if shards < 1 or max_batch % shards:
            raise ValueError(f"max_batch {max_batch} does not split into {shards} batch shards")
        self.max_batch, self.per_shard = max_batch, max_batch // shards
        self.shards: list[list[Request]] = [[] for _ in range(shards)]

    def __len__(self) -> int:
        return sum(len(shard) for shard in self.shards)

    def rows(self) -> list[tuple[int, Request]]:
        """(row, request) of every live row, in row order."""
        return [(s * self.per_shard + i, r)
                for s, shard in enumerate(self.shards) for i, r in enumerate(shard)]

    def admit(self, pending: list[Request], prefer=None) -> list[tuple[int, Request]]:
        """Moves requests from the end of ``pending`` into free rows, each to the shard
        ``prefer(request)`` names where it has a free row, else to the shard with the most free
        rows (the first on a tie), and returns their (row, request)."""
        admitted = []
        while pending:
            s = prefer(pending[-1]) if prefer else None
            if s is None or len(self.shards[s]) == self.per_shard:
                s = max(range(len(self.shards)), key=lambda s: (-len(self.shards[s]), -s))
            shard = self.shards[s]
            if len(shard) == self.per_shard:
                break
            admitted.append((s * self.per_shard + len(shard), pending[-1]))
            shard.append(pending.pop())
        return admitted

    def evict(self, done: Callable[[Request], bool]) -> tuple[np.ndarray, list[Request]]:
        """Removes the requests for which ``done`` holds: (the ``batch_mapping`` [B] that
        compacts each shard's survivors, in order, to its front; the finished requests)."""
        mapping = np.full((self.max_batch,), -1, np.int32)
        finished = []
        for s, shard in enumerate(self.shards):
            base, kept = s * self.per_shard, []
            for i, r in enumerate(shard):
                if done(r):
                    finished.append(r)
                else:
                    mapping[base + i] = base + len(kept)
                    kept.append(r)
            shard[:] = kept
        return mapping, finished


class Engine:
    """Serves requests with a cache ``kind`` (``caches.py``) and a model (``model.py``)."""

    def __init__(self, cfg: M.ModelConfig, params, kind, *, max_batch: int, system_prompt,
                 max_prompt_len: int, max_new_tokens: int):
        self.cfg, self.params, self.kind = cfg, params, kind
        self.max_batch = max_batch
        self.system_prompt = np.asarray(system_prompt, np.int32)
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.max_seq_len = len(self.system_prompt) + max_prompt_len + max_new_tokens
        self.functions = self._jit_functions()
        self._compiled = None

    def _jit_functions(self) -> dict[str, Callable]:
        cfg, kind, batch = self.cfg, self.kind, self.max_batch

        def prompt(params, cache, tokens):
            cache = kind.clear(cache, 1)  # one row per batch shard: the first
            first = jnp.arange(batch) % (batch // kind.batch_shards) == 0
            lengths = jnp.where(first, tokens.shape[1], 0).astype(jnp.int32)
            _, cache = M.forward(cfg, params, kind, cache, tokens, lengths)
            cache, saved = kind.save(cache, tokens.shape[1])
            return kind.clear(cache, 0), saved

        def admit(params, cache, saved, next_tokens, tokens, new_lengths):
            new = new_lengths > 0  # the admitted rows (a user turn has a token at least)
            cache = kind.admit(cache, saved, new)
            logits, cache = M.forward(cfg, params, kind, cache, tokens, new_lengths)
            return cache, jnp.where(new, jnp.argmax(logits, -1).astype(jnp.int32), next_tokens)

        def decode(params, cache, next_tokens, steps):
            live = kind.live(cache).astype(jnp.int32)

            def step(i, carry):
                cache, tokens, out = carry
                logits, cache = M.forward(cfg, params, kind, cache, tokens[:, None], live)
                tokens = jnp.argmax(logits, -1).astype(jnp.int32)
                return cache, tokens, out.at[i].set(tokens)

            out = jnp.zeros((self.max_new_tokens, batch), jnp.int32)
            return jax.lax.fori_loop(0, steps, step, (cache, next_tokens, out))

        def evict(cache, next_tokens, batch_mapping):
            cache = kind.evict(cache, batch_mapping)
            keep = jnp.where(batch_mapping >= 0, batch_mapping, batch)
            return cache, next_tokens.at[keep].set(next_tokens, mode="drop")

        # The cache (and the per-row next tokens) are donated: every step updates them in place.
        return dict(
            prompt=jax.jit(prompt, donate_argnums=(1,)),
            admit=jax.jit(admit, donate_argnums=(1, 3)),
            decode=jax.jit(decode, donate_argnums=(1, 2)),
            evict=jax.jit(evict, donate_argnums=(0, 1)),
        )

    def abstract_cache(self):
        """The cache's shapes and dtypes; a sharded one (``--mesh``) also its placement, so that
        the steps compile for it (and keep it, in place)."""
        if getattr(self.kind, "sharding", None) is None:
            return jax.eval_shape(lambda: self.kind.create(self.max_batch, self.max_seq_len))
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            self.kind.create(self.max_batch, self.max_seq_len))

    def example_args(self) -> dict[str, tuple]:
        """Abstract arguments of every step function (for ahead-of-time compilation)."""
        shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
        params = jax.tree.map(shape, self.params)
        cache = self.abstract_cache()
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
        prompt = i32(self.max_batch, len(self.system_prompt))
        _, saved = jax.eval_shape(self.functions["prompt"], params, cache, prompt)
        return dict(
            prompt=(params, cache, prompt),
            admit=(params, cache, saved, i32(self.max_batch),
                   i32(self.max_batch, self.max_prompt_len), i32(self.max_batch)),
            decode=(params, cache, i32(self.max_batch), i32()),
            evict=(cache, i32(self.max_batch), i32(self.max_batch)),
        )

    def compile(self) -> dict:
        """Compiles every step function once (shapes are static: one executable each) and runs
        each once on a scratch cache, so that no timed phase pays a first execution (kernels
        loaded on first launch, buffers first allocated)."""
        if self._compiled is None:
            args = self.example_args()
            fns = {k: f.lower(*args[k]).compile(COMPILER_OPTIONS)
                   for k, f in self.functions.items()}
            zeros = lambda spec: jnp.zeros(spec.shape, spec.dtype)
            cache = self.kind.create(self.max_batch, self.max_seq_len)
            cache, saved = fns["prompt"](self.params, cache, zeros(args["prompt"][2]))
            lengths = jnp.ones((self.max_batch,), jnp.int32)
            cache, tokens = fns["admit"](self.params, cache, saved, zeros(args["admit"][3]),
                                         zeros(args["admit"][4]), lengths)
            cache, tokens, _ = fns["decode"](self.params, cache, tokens, jnp.int32(1))
            everyone_leaves = jnp.full((self.max_batch,), -1, jnp.int32)
            jax.block_until_ready(fns["evict"](cache, tokens, everyone_leaves))
            self._compiled = fns
        return self._compiled

    def cache_copies(self) -> int:
        """Copies of a cache data buffer in the compiled step functions (0 when all in place)."""
        cache = self.abstract_cache()
        types = {_hlo_type(x) for x in jax.tree.leaves(cache) if x.ndim >= 4}
        pattern = re.compile(r"=\s*(\S+?)(\{[^}]*\})?\s+copy(-start)?\(")
        return sum(
            1
            for fn in self.compile().values()
            for m in pattern.finditer(fn.as_text())
            if m.group(1) in types
        )

    def run(self, requests: list[Request], progress: Callable | None = None) -> Stats:
        """Serves ``requests`` (more than ``max_batch`` is the point) and fills their outputs.

        ``progress(finished_requests, stats)`` is called after every eviction and after every
        decode call that finished no request.
        """
        for r in requests:
            if not (1 <= len(r.prompt) <= self.max_prompt_len
                    and 1 <= r.max_new_tokens <= self.max_new_tokens):
                raise ValueError(f"request {r.id}: prompt length {len(r.prompt)} or max_new_tokens "
                                 f"{r.max_new_tokens} outside this engine's limits")
        stats = Stats()
        t = time.perf_counter()
        fns = self.compile()
        stats.times["compile + warm-up"] += time.perf_counter() - t

        def timed(phase, fn, *args):
            t = time.perf_counter()
            out = jax.block_until_ready(fns[fn](*args))
            stats.times[phase] += time.perf_counter() - t
            return out

        batch, kind, params = self.max_batch, self.kind, self.params
        cache = kind.create(batch, self.max_seq_len)
        stats.allocated = kind.memory(cache)[1]
        # The system prompt: computed once and saved; every admitted request starts from it.
        tokens = np.broadcast_to(self.system_prompt, (batch, len(self.system_prompt)))
        cache, saved = timed("system prompt", "prompt", params, cache, jnp.asarray(tokens))
        stats.prefilled += len(self.system_prompt) * kind.batch_shards

        pending = list(reversed(requests))
        slots = Slots(batch, kind.batch_shards)
        next_tokens = jnp.zeros((batch,), jnp.int32)  # each row's last token, not yet in the cache
        while pending or len(slots):
            admitted = slots.admit(pending)  # into the free rows
            if admitted:
                prompts = np.zeros((batch, self.max_prompt_len), np.int32)
                lengths = np.zeros((batch,), np.int32)
                for row, r in admitted:
                    prompts[row, : len(r.prompt)] = r.prompt
                    lengths[row] = len(r.prompt)
                cache, next_tokens = timed(
                    "admit + prefill", "admit", params, cache, saved, next_tokens,
                    jnp.asarray(prompts), jnp.asarray(lengths))
                first = np.asarray(next_tokens)
                for row, r in admitted:
                    r.output.append(int(first[row]))
                stats.admissions += len(admitted)
                stats.admit_steps += 1
                stats.prefilled += int(lengths.sum())
                stats.generated += len(admitted)
            stats.peak_in_use = max(stats.peak_in_use, kind.memory(cache)[0])
            # Decode until the first request is done.
            # (at most DECODE_CHUNK steps per call, so progress is reported during long answers)
            rows = slots.rows()
            steps = min(DECODE_CHUNK, *(r.max_new_tokens - len(r.output) for _, r in rows))
            if steps > 0:
                cache, next_tokens, out = timed("decode", "decode", params, cache,
                                                next_tokens, jnp.int32(steps))
                out = np.asarray(out)[:steps]
                for row, r in rows:
                    r.output.extend(int(x) for x in out[:, row])
                stats.generated += steps * len(rows)
                stats.decode_tokens += steps * len(rows)
                stats.decode_steps += steps
                stats.peak_in_use = max(stats.peak_in_use, kind.memory(cache)[0])
            # Evict the finished requests; the others move to the front of their shard, in order.
            mapping, finished = slots.evict(lambda r: len(r.output) >= r.max_new_tokens)
            if not finished:
                if progress is not None:
                    progress([], stats)
                continue
            cache, next_tokens = timed("evict", "evict", cache, next_tokens, jnp.asarray(mapping))
            stats.evictions += len(finished)
            stats.evict_steps += 1
            if progress is not None:
                progress(finished, stats)
        return stats


def _hlo_type(x) -> str:
    """HLO spelling of an array type, e.g. 'f32[2,4,2,8,64,128]'."""
    name = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "s8", "uint8": "u8",
            "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2",
            "int32": "s32"}[jnp.dtype(x.dtype).name]
    sharding = getattr(x, "sharding", None)  # a sharded step's HLO holds per-device shapes
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    return f"{name}[{','.join(map(str, shape))}]"
