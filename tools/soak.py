"""Soak: thousands of random cache steps checked against a host-side model of every sequence.

The paged cache gets admissions and decode steps (reserve, append every layer, commit), evictions
(compact), forks (page sharing with a copy-on-write last page), releases; the linear cache gets
admissions (instantiate a saved prompt), ragged appends, commits and compactions. Every step is a
jitted function with the cache donated, as a serving loop runs it. Every ``check_every`` steps and
at the end each live sequence's tokens are read back and compared bit for bit with the model, and
the paged pool must be whole: every page's reference count equals the number of table entries
naming it (no leaked and no double-owned page), held pages are a prefix of their row, and every
length fits its pages. The append and commit of a valid step must not report anything through
checkify.

    python3 tools/soak.py --steps 10000          # the GPU run of tools/gpu_check.sh
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

import jaxkv


@dataclasses.dataclass
class PagedShape:
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 8
    page_size: int = 4
    num_pages: int = 40
    max_batch: int = 8
    max_pages_per_seq: int = 6
    tokens: int = 5  # most tokens one row appends in a step
    layout: str = "HND"
    host_pages: int = 0  # a host tier: rows swapped out and in among the other steps


def _silent(err, what):
    msg = err.get()
    if msg is not None:
        raise AssertionError(f"{what} reported on a valid step: {msg}")


@functools.lru_cache(maxsize=None)
def _paged_steps(layout):
    donate = functools.partial(jax.jit, donate_argnums=0)

    @donate
    def reserve(cache, n):
        return cache.reserve(n)

    @donate
    @checkify.checkify
    def append_commit(cache, k, v, n):
        return cache.append_layers(k, v, n).commit(n)

    @donate
    @checkify.checkify
    def fork(cache, src, dst):
        return cache.fork(src, dst)

    release = donate(lambda cache, mask: cache.release(mask))
    compact = donate(checkify.checkify(lambda cache, m: cache.compact(m)))
    swap_out = donate(checkify.checkify(lambda cache, rows: cache.swap_out(rows)))
    swap_in = donate(checkify.checkify(lambda cache, rows: cache.swap_in(rows)))

    @jax.jit
    def read(cache):
        max_len = cache.max_pages_per_seq * cache.page_size
        return jnp.stack([cache.gather(l, max_len) for l in range(cache.num_layers)])

    return reserve, append_commit, fork, release, compact, read, swap_out, swap_in


def check_paged(cache, model, read, on_host=None):
    """The cache equals the model, token for token, and its pools are whole. ``on_host``: bool
    [B], the rows the model has swapped out (their pages on the host: a device prefix they share,
    then host pages; their tokens are checked once they are back)."""
    on_host = np.zeros(len(model), bool) if on_host is None else on_host
    table = np.asarray(cache.page_table)
    lengths = np.asarray(cache.lengths)
    refs = np.asarray(cache.ref_counts)
    named = np.bincount(table[(table >= 0) & (table < cache.num_pages)], minlength=cache.num_pages)
    assert np.all((table == jaxkv.NO_PAGE) | ((table >= 0) & (table < cache.num_pages))), "garbage"
    np.testing.assert_array_equal(refs, named, "ref_counts != table entries naming each page")
    held = table != jaxkv.NO_PAGE
    assert not np.any(~held[:, :-1] & held[:, 1:]), "held pages are not a prefix"
    pages = held.sum(1)
    if cache.host is not None:
        host_table = np.asarray(cache.host.table)
        on_host_pages = host_table != jaxkv.NO_PAGE
        np.testing.assert_array_equal(np.asarray(cache.on_host), on_host, "rows on the host")
        assert not np.any(held & on_host_pages), "a position held on both tiers"
        n = cache.host.num_pages
        np.testing.assert_array_equal(
            np.asarray(cache.host.ref_counts),
            np.bincount(host_table[on_host_pages], minlength=n) > 0, "host ref_counts")
        assert np.bincount(host_table[on_host_pages], minlength=n).max(initial=0) <= 1, \
            "a host page held twice"
        pages = pages + on_host_pages.sum(1)
    np.testing.assert_array_equal(pages, -(-lengths // cache.page_size), "pages held")
    want_lengths = [m.shape[3] for m in model]
    np.testing.assert_array_equal(lengths, want_lengths, "lengths")
    out = np.asarray(read(cache))  # [L, B, 2, H, M, D]
    for b, tokens in enumerate(model):
        if on_host[b]:
            continue
        got = out[:, b, :, :, : tokens.shape[3]]
        if not np.array_equal(got.view(np.uint8), tokens.view(np.uint8)):
            raise AssertionError(f"row {b}: tokens differ from the model")
        assert not np.any(out[:, b, :, :, tokens.shape[3]:]), f"row {b}: data past its length"


def soak_paged(steps: int, check_every: int = 25, seed: int = 0, shape: PagedShape = PagedShape(),
               dtype=jnp.float32) -> dict:
    rng = np.random.default_rng(seed)
    s = shape
    cache = jaxkv.PagedKVCache.create(s.num_layers, s.num_pages, s.page_size, s.num_kv_heads,
                                      s.head_dim, s.max_batch, s.max_pages_per_seq, dtype, s.layout,
                                      host_pages=s.host_pages)
    reserve, append_commit, fork, release, compact, read, swap_out, swap_in = _paged_steps(
        s.layout)
    on_host = np.zeros(s.max_batch, bool)  # the model's rows swapped out
    capacity = s.max_pages_per_seq * s.page_size
    empty = np.zeros((s.num_layers, 2, s.num_kv_heads, 0, s.head_dim), np.dtype(dtype))
    model = [empty] * s.max_batch  # per row [L, 2, H, length, D]
    counts = dict(append=0, fork=0, release=0, compact=0, checks=0, unserved=0, forks_made=0)
    actions = ["append"] * 6 + ["fork", "release", "compact"]
    if s.host_pages:
        actions += ["swap_out", "swap_in"]
        counts.update(swap_out=0, swap_in=0, swapped_out=0, swapped_in=0)
    for step in range(steps):
        action = rng.choice(actions)
        lengths = np.array([m.shape[3] for m in model])
        if action == "append":
            n = rng.integers(0, s.tokens + 1, s.max_batch).astype(np.int32)
            n[(rng.random(s.max_batch) < 0.3) | on_host] = 0
            n = np.minimum(n, capacity - lengths).astype(np.int32)
            cache, served = reserve(cache, jnp.asarray(n))
            served = np.asarray(served)
            counts["unserved"] += int(np.sum(~served & (n > 0)))
            n = np.where(served, n, 0).astype(np.int32)
            shape_kv = (s.num_layers, s.max_batch, s.num_kv_heads, s.tokens, s.head_dim)
            k = rng.standard_normal(shape_kv, np.float32).astype(dtype)
            v = rng.standard_normal(shape_kv, np.float32).astype(dtype)
            err, cache = append_commit(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(n))
            _silent(err, "append/commit")
            for b in range(s.max_batch):
                new = np.stack([k[:, b, :, : n[b]], v[:, b, :, : n[b]]], axis=1)
                model[b] = np.concatenate([model[b], new], axis=3)
        elif action == "fork":
            live = np.flatnonzero((lengths > 0) & ~on_host)
            if live.size == 0:
                continue
            src = int(rng.choice(live))
            others = [b for b in range(s.max_batch) if b != src]  # on the host too: released
            dst = rng.choice(others, size=int(rng.integers(1, 3)), replace=False).astype(np.int32)
            err, (cache, forked) = fork(cache, jnp.int32(src), jnp.asarray(dst))
            forked = np.asarray(forked)
            msg = err.get()
            if msg is not None and "out of pages" not in msg:
                raise AssertionError(f"fork reported on a valid step: {msg}")
            for d, ok in zip(dst, forked):
                model[d] = model[src].copy() if ok else empty
            on_host[dst] = False
            counts["forks_made"] += int(forked.sum())
        elif action == "release":
            mask = rng.random(s.max_batch) < 0.25
            cache = release(cache, jnp.asarray(mask))
            for b in np.flatnonzero(mask):
                model[b] = empty
            on_host &= ~mask
        elif action == "swap_out":  # rows with tokens, on the device; a full host skips some
            rows = (rng.random(s.max_batch) < 0.3) & (lengths > 0) & ~on_host
            err, (cache, swapped) = swap_out(cache, jnp.asarray(rows))
            swapped = np.asarray(swapped)
            msg = err.get()
            if msg is not None and "holds no pages of its own" not in msg:
                raise AssertionError(f"swap_out reported on a valid step: {msg}")
            assert not np.any(swapped & ~rows), "swap_out moved a row not selected"
            on_host |= swapped
            counts["swapped_out"] += int(swapped.sum())
        elif action == "swap_in":
            rows = (rng.random(s.max_batch) < 0.5) & on_host
            err, (cache, served) = swap_in(cache, jnp.asarray(rows))
            _silent(err, "swap_in")
            served = np.asarray(served)
            assert not np.any(served & ~rows), "swap_in moved a row not selected"
            on_host &= ~served
            counts["swapped_in"] += int(served.sum())
        else:  # evict some sequences and move the rest to random slots (any injective mapping)
            keep = rng.random(s.max_batch) < 0.7
            slots = rng.permutation(s.max_batch)
            mapping = np.where(keep, slots, -1).astype(np.int32)
            err, cache = compact(cache, jnp.asarray(mapping))
            _silent(err, "compact")
            new = [empty] * s.max_batch
            new_on_host = np.zeros(s.max_batch, bool)
            for b in range(s.max_batch):
                if mapping[b] >= 0:
                    new[mapping[b]] = model[b]
                    new_on_host[mapping[b]] = on_host[b]
            model, on_host = new, new_on_host
        counts[action] += 1
        if (step + 1) % check_every == 0 or step == steps - 1:
            check_paged(cache, model, read, on_host)
            counts["checks"] += 1
    if s.host_pages:  # everyone back, then every token checked
        err, (cache, served) = swap_in(cache, jnp.asarray(on_host))
        _silent(err, "swap_in")
        on_host &= ~np.asarray(served)
    check_paged(cache, model, read, on_host)
    counts["tokens_live"] = int(sum(m.shape[3] for m in model))
    counts["pages_free"] = int(cache.num_free_pages)
    return counts


@dataclasses.dataclass
class LinearShape:
    num_layers: int = 2
    max_batch: int = 6
    num_kv_heads: int = 2
    max_seq_len: int = 24
    head_dim: int = 8
    prompt: int = 3  # tokens of the saved prompt every admission starts from
    tokens: int = 4


@functools.lru_cache(maxsize=None)
def _linear_steps():
    donate = functools.partial(jax.jit, donate_argnums=0)

    @donate
    @checkify.checkify
    def append_commit(cache, k, v, n):
        for layer in range(cache.num_layers):
            cache = cache.append(layer, k[layer], v[layer], n)
        return cache.commit(n)

    @donate
    @checkify.checkify
    def admit(cache, saved, rows, first, total):
        cache = cache.instantiate(saved, rows)
        cache = cache.set_active_batch_size(total)
        new = (jnp.arange(cache.max_batch) >= first) & (jnp.arange(cache.max_batch) < total)
        return cache.commit(jnp.where(new, saved.length, 0).astype(jnp.int32))

    compact = donate(checkify.checkify(lambda cache, m: cache.compact(m)))
    return append_commit, admit, compact


def check_linear(cache, model):
    active = int(cache.active_batch_size)
    assert active == len(model), f"active batch size {active}, model {len(model)}"
    lengths = np.asarray(cache.lengths)
    buffer = np.asarray(cache.buffer)  # [L, B, 2, H, S, D]
    for b, tokens in enumerate(model):
        n = tokens.shape[3]
        assert lengths[b] == n, f"row {b}: length {lengths[b]}, model {n}"
        if not np.array_equal(buffer[:, b, :, :, :n].view(np.uint8), tokens.view(np.uint8)):
            raise AssertionError(f"row {b}: tokens differ from the model")
    assert not np.any(lengths[active:]), "inactive rows hold tokens"


def soak_linear(steps: int, check_every: int = 25, seed: int = 0,
                shape: LinearShape = LinearShape(), dtype=jnp.float32) -> dict:
    rng = np.random.default_rng(seed)
    s = shape
    cache = jaxkv.LinearKVCache.create(s.num_layers, s.max_batch, s.num_kv_heads, s.max_seq_len,
                                       s.head_dim, dtype)
    append_commit, admit, compact = _linear_steps()
    prompt = rng.standard_normal((s.num_layers, 2, s.num_kv_heads, s.prompt, s.head_dim),
                                 np.float32).astype(dtype)
    saved = jaxkv.SavedKV(layers=tuple(jnp.asarray(p) for p in prompt),
                          length=jnp.asarray(s.prompt, jnp.int32))
    model = []  # the active rows, in order: [L, 2, H, length, D]
    counts = dict(append=0, admit=0, compact=0, checks=0)
    for step in range(steps):
        action = rng.choice(["append"] * 5 + ["admit", "compact"])
        if action == "admit":
            room = s.max_batch - len(model)
            if room == 0:
                continue
            k = int(rng.integers(1, room + 1))
            # One shape for every admission: the first new row repeats (the same bytes again).
            rows = np.full(s.max_batch, len(model), np.int32)
            rows[:k] = np.arange(len(model), len(model) + k)
            err, cache = admit(cache, saved, jnp.asarray(rows), jnp.int32(len(model)),
                               jnp.int32(len(model) + k))
            _silent(err, "admit")
            model += [prompt.copy() for _ in range(k)]
        elif action == "append":
            lengths = np.array([m.shape[3] for m in model] + [0] * (s.max_batch - len(model)))
            n = rng.integers(0, s.tokens + 1, s.max_batch)
            n = np.minimum(n, s.max_seq_len - lengths).astype(np.int32)
            n[len(model):] = 0
            shape_kv = (s.num_layers, s.max_batch, s.num_kv_heads, s.tokens, s.head_dim)
            k = rng.standard_normal(shape_kv, np.float32).astype(dtype)
            v = rng.standard_normal(shape_kv, np.float32).astype(dtype)
            err, cache = append_commit(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(n))
            _silent(err, "append/commit")
            for b in range(len(model)):
                new = np.stack([k[:, b, :, : n[b]], v[:, b, :, : n[b]]], axis=1)
                model[b] = np.concatenate([model[b], new], axis=3)
        else:  # finished sequences leave; survivors take rows [0, survivors) in any order
            keep = np.flatnonzero(rng.random(len(model)) < 0.7)
            mapping = np.full(s.max_batch, -1, np.int32)
            mapping[keep] = rng.permutation(len(keep))
            err, cache = compact(cache, jnp.asarray(mapping))
            _silent(err, "compact")
            new = [None] * len(keep)
            for b in keep:
                new[mapping[b]] = model[b]
            model = new
        counts[action] += 1
        if (step + 1) % check_every == 0:
            check_linear(cache, model)
            counts["checks"] += 1
    check_linear(cache, model)
    counts["tokens_live"] = int(sum(m.shape[3] for m in model))
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--check-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=["HND", "NHD"], default="HND")
    args = p.parse_args(argv)
    print(f"soak on {jax.default_backend()} ({jax.devices()[0].device_kind})", flush=True)
    for name, run in (("paged", lambda: soak_paged(args.steps, args.check_every, args.seed,
                                                   PagedShape(layout=args.layout))),
                      ("paged with a host tier", lambda: soak_paged(
                          args.steps, args.check_every, args.seed,
                          PagedShape(layout=args.layout, host_pages=24))),
                      ("linear", lambda: soak_linear(args.steps, args.check_every, args.seed))):
        start = time.perf_counter()
        counts = run()
        took = time.perf_counter() - start
        summary = " ".join(f"{k}={v}" for k, v in counts.items())
        print(f"soak {name}: {args.steps} steps in {took:.1f} s, every check equal to the model "
              f"and the pool whole; {summary}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
