"""The host's side of ``python -m jaxkv serve``'s loop: the queue of requests, the rows they
hold, admission (paged: by the pages the pool has), the prefill chunks, reading the device's
results, preemption and the swaps of a host tier. ``serve.ServeEngine`` runs it against the
device; it reads the engine's sizes and flags, never its compiled functions."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

import jax
import numpy as np

from . import loop
from .stream import ServeRequest


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

    def admit(self, pending: list, prefer=None) -> list:  # (prefer: no shards to prefer)
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


@dataclasses.dataclass
class Chunk:
    """One prefill call: ``width`` rows (lanes), each up to ``prefill_chunk`` prompt tokens."""

    lanes: list  # (lane, row, request) of the lanes in use
    new: np.ndarray  # bool [B]: rows admitted now (they start from the system prompt)
    # int32 [width]: the lanes' rows; B for an unused lane. Over k batch shards the lanes are k
    # equal groups, group s holding rows of shard s (each device prefills its own rows).
    rows: np.ndarray
    tokens: np.ndarray  # int32 [width, chunk]
    n: np.ndarray  # int32 [width]: tokens of each lane
    last: np.ndarray  # bool [width]: the chunk ends the lane's prompt
    budget: np.ndarray  # int32 [width]: tokens the request may still generate
    # Prefix cache: each lane's whole sequence [width, max_seq_len] and its length; the device
    # picks the chunk from the row's length (``new``: bool [width], the row's first lane), and
    # each lane's namespace (int32 [width]: its request's tenant) keeps the pages it finds and
    # makes findable to its tenant's.
    seq: np.ndarray | None = None
    total: np.ndarray | None = None
    space: np.ndarray | None = None

    @property
    def width(self) -> int:
        return len(self.rows)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The prefill call's host arrays (the engine puts them on its devices in one call)."""
        if self.seq is not None:
            return (self.new, self.rows, self.seq, self.total, self.budget, self.space)
        return (self.new, self.rows, self.tokens, self.n, self.last, self.budget)

    def on_lanes(self) -> tuple[bool, ...]:
        """Which of ``arrays()`` lead with the lane axis (over batch shards: split with it)."""
        return (True,) * 6 if self.seq is not None else (False,) + (True,) * 5


# Waiting requests a prefix-caching engine looks past for one whose prefix is not being
# prefilled (bounds the host's work per admission).
_DEFER_SCAN = 64


def output_tokens(requests) -> int:
    """Tokens generated so far, over every request."""
    return sum(len(r.output) for r in requests)


class Schedule:
    """The host's side of a run: the queue, the rows (``loop.Slots``, or ``FreeSlots`` for a kind
    that does not compact), admission, the prefill chunks, reading results, preemption."""

    def __init__(self, engine, requests: list[ServeRequest], num_pages: int):
        # engine: the serve.ServeEngine it schedules for (not imported: serve imports this)
        self.engine, self.requests = engine, requests
        kind, b = engine.kind, engine.batch
        self.page_size = getattr(kind, "page_size", None) if num_pages else None
        self.num_pages = num_pages
        # A kind with sliding windows keeps a page table per layer group over its pool: a row's
        # pages in all of them (its window groups' bounded by their windows).
        self.groups = getattr(kind, "page_groups", 1)
        row_pages = getattr(kind, "row_pages", None)
        chunk = getattr(engine, "prefill_chunk", 1)
        self._pages = ((lambda n: row_pages(n, chunk)) if row_pages is not None
                       else (lambda n: _pages(n, self.page_size)))
        self.syslen = len(engine.system_prompt)
        self.future = collections.deque(sorted(requests, key=lambda r: r.arrival))
        self.waiting: collections.deque[ServeRequest] = collections.deque()
        shards = getattr(kind, "batch_shards", 1)
        self.slots = loop.Slots(b, shards) if getattr(kind, "compacts", True) else FreeSlots(b)
        # Over batch shards each has its rows and its pool: rows, pages and shortages are
        # counted per shard (a row never leaves its shard, nor takes another's pages).
        self.shards, self.per_shard = shards, b // shards
        self.free = [num_pages // shards] * shards  # free pages of each shard, as last read
        self.leaving: set[int] = set()
        self.hold = False  # after a preemption, no admission until a request finishes
        self.to_host: list[ServeRequest] = []  # preempted, to swap out in the next iteration
        self.to_device: list[ServeRequest] = []  # swapped, to bring back in the next iteration
        self.short: set[int] = set()  # shards where a row got no page in the last iteration
        self.order = self.done = 0
        self.live: list = []
        # [live rows, live tokens, reserved tokens, never-cached free pages] after each decode
        self.usage: list = []
        self.uncached = num_pages  # never-cached free pages (a prefix cache), as last read
        # prefix cache: the tenants a row of which has indexed the system prompt's full pages
        # (each tenant its own: its namespace's)
        self.sys_indexed: set[int] = set()
        # prefix cache over batch shards: the shard that last took each (tenant, first page past
        # the system prompt) (each shard's index holds what its rows prefilled)
        self.home: dict[tuple[int, bytes], int] | None = (
            {} if engine.prefix and shards > 1 else None)
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
        """The ``batch_mapping`` (host array) that evicts the finished and preempted rows, or
        None."""
        if everyone:
            self.leaving |= {id(r) for _, r in self.slots.rows()}
        if not self.leaving:
            return None
        mapping, _ = self.slots.evict(lambda r: id(r) in self.leaving)
        self.leaving.clear()
        self.m["evict_calls"] += 1
        return mapping

    def pages_in_use(self, reserved_tokens) -> None:
        """``reserved_tokens``: the tokens of the pages each batch shard has in use."""
        if self.page_size:
            share = self.num_pages // self.shards
            self.free = [share - int(t) // self.page_size for t in reserved_tokens]

    def reserve_ahead(self, steps: int) -> None:
        """A decode call of ``steps`` is running and not read yet: admission counts the most
        pages it may take (every decoding row crossing ``ceil(steps / page_size)`` pages)."""
        if self.page_size:
            for row, r in self.live:
                if r.phase == "decode":
                    self.free[self._shard(row)] -= self.groups * _pages(steps, self.page_size)

    def _shard(self, row: int) -> int:
        return row // self.per_shard

    def admit(self) -> list:
        """Moves waiting requests into free rows, first come first served; paged: while the pool
        has pages for their prompts (beyond what the rows still prefilling will take, and a 1%
        watermark). A request preempted before is prefilled with the tokens it had made."""
        chosen, size = [], self.page_size
        room = [0] * self.shards  # paged: pages each shard can still give
        if size:
            pending = [0] * self.shards
            for row, r in self.slots.rows():
                if r.phase == "prefill":
                    pending[self._shard(row)] += (self._pages(self.syslen + len(r.ext))
                                                  - self._pages(self.syslen + r.offset))
            mark = max(1, self.num_pages // self.shards // 100)
            room = [f - p - mark for f, p in zip(self.free, pending)]
            self._swap_ins(room)
            if any(r.phase == "swapped" and r not in self.to_device for _, r in self.slots.rows()):
                self.live = self.slots.rows()  # the swapped come back before anyone new
                return self.slots.admit([])
        free_rows = ([self.engine.batch - len(self.slots)] if self.shards == 1 else
                     [self.per_shard - len(rows) for rows in self.slots.shards])
        prefilling = [r for _, r in self.slots.rows() if r.phase == "prefill"]
        shard_of: dict[int, int] = {}
        i = 0
        while (i < len(self.waiting) and any(free_rows)
               and not (self.hold and len(self.slots))):
            r = self.waiting[i]
            ext = np.concatenate([r.prompt, np.asarray(r.output, np.int32)])
            if self.engine.prefix and i < _DEFER_SCAN and self._waits_for(
                    ext, r.tenant, prefilling + chosen):
                i += 1  # its prefix is still being prefilled by another row: later, it finds it
                self.m["deferred"] += 1
                continue
            # (the system prompt's full pages are shared, by fork, in every group)
            need = (self._pages(self.syslen + len(ext) + 1) - self.syslen // size * self.groups
                    if size else 0)
            s = self._pick_shard(ext, r.tenant, need, free_rows, room)
            if size:
                if need > room[s] and (chosen or len(self.slots)):
                    break
                room[s] -= need
            free_rows[s] -= 1
            shard_of[id(r)] = s
            r.ext, r.offset, r.phase, r.order = ext, 0, "prefill", self.order
            r.started = False
            self.order += 1
            chosen.append(r)
            del self.waiting[i]
        admitted = self.slots.admit(list(reversed(chosen)), lambda r: shard_of[id(r)])
        if self.home is not None:
            for row, r in admitted:
                if (key := self._first_page(r.ext)) is not None:
                    self.home[r.tenant, key] = self._shard(row)
        self.live = self.slots.rows()
        self.m["peak_live"] = max(self.m["peak_live"], len(self.live))
        return admitted

    def _first_page(self, ext: np.ndarray) -> bytes | None:
        """The tokens of a request's first full page past the system prompt's (a conversation's
        first message, a long shared prompt's start; ``ext``: its prompt and output), or None
        where it has none."""
        stop = (self.syslen // self.page_size + 1) * self.page_size - self.syslen
        return ext[:stop].tobytes() if len(ext) > stop else None

    def _pick_shard(self, ext: np.ndarray, tenant: int, need: int, free_rows: list,
                    room: list) -> int:
        """The batch shard for a request (prompt and output ``ext``, ``need`` pages): with a
        prefix cache, the shard whose index may hold its prefix (the last to take its first
        page for its tenant), so that a conversation's turns and a shared prompt's requests meet
        their pages, if it has a free row and the pages; else, of the shards with a free row and
        the pages, the one with the most free rows (the first on a tie); else the one with the
        most pages (which the caller finds short)."""
        key = None if self.home is None else self._first_page(ext)
        home = None if key is None else self.home.get((tenant, key))
        if home is not None and free_rows[home] and room[home] >= need:
            return home
        open_ = [s for s in range(self.shards) if free_rows[s]]
        fit = [s for s in open_ if room[s] >= need]
        if fit:
            return max(fit, key=lambda s: (free_rows[s], -s))
        return max(open_, key=lambda s: (room[s], -s))

    def _waits_for(self, ext: np.ndarray, tenant: int, prefilling: list) -> bool:
        """Whether a waiting request (its prompt and output ``ext``, of ``tenant``) shares full
        pages with a row of its tenant still prefilling that has not yet made them findable (the
        index gets a row's pages chunk by chunk): admitted now, it would compute them again
        (another tenant's pages it would never find: it does not wait for them). Under load,
        turns of one conversation and requests of one long prompt arrive while the first of them
        is still prefilling: a burst then reuses the oracle's best (tests/test_serve.py). (On an H100 at
        16 chat conversations/s reuse stayed near 72% of the unbounded oracle's, which counts
        pages the pool has evicted: docs/serving.md.) The system prompt's pages, shared by every
        request, only until a first row (of the tenant) has indexed them (at the start)."""
        size = self.page_size
        prefilling = [other for other in prefilling if other.tenant == tenant]
        if not size or not prefilling:
            return False
        sys_pages = self.syslen // size
        total = self.syslen + len(ext)
        if tenant not in self.sys_indexed and min(sys_pages, (total - 1) // size) > 0:
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

    def _swap_ins(self, room: list) -> None:
        """Plans bringing swapped requests back, oldest first, while their pages fit in their
        shards' ``room`` (taken from it) and no preemption is pending. With no row running, the
        oldest comes back whatever the estimate says (the device decides), so that the schedule
        always moves."""
        active = self._active()
        if self.hold and active:
            return
        swapped = sorted(((r.order, row, r) for row, r in self.slots.rows()
                          if r.phase == "swapped" and r not in self.to_host), key=lambda x: x[0])
        planned = 0
        for _, row, r in swapped:
            need, s = self._pages_held(r), self._shard(row)
            if need > room[s] and (active or planned):
                break
            room[s] -= need
            planned += 1
            self.to_device.append(r)

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
            self.m["drained_tokens"] = output_tokens(self.requests)

    def note_half(self, t: float, duration: float | None) -> None:
        """Half-way through a run of fixed length: the output rate after it is the one past the
        ramp, where every engine first prefills the prompts of its first rows."""
        if duration and self.m.get("half_at") is None and t >= duration / 2:
            self.m["half_at"] = t
            self.m["half_tokens"] = output_tokens(self.requests)

    def prefill_chunk(self, admitted) -> Chunk | None:
        """The next chunk of the oldest rows still prefilling, on the fewest lanes that hold
        them; None when there is nothing to admit or prefill."""
        e = self.engine
        waiting = sorted(((r.order, row, r) for row, r in self.live if r.phase == "prefill"),
                         key=lambda x: x[0])
        self.prefilling = len(waiting)
        k = self.shards
        groups: list[list] = [[] for _ in range(k)]  # each shard's oldest rows
        for _, row, r in waiting:
            group = groups[self._shard(row)]
            if len(group) < e.prefill_rows // k:
                group.append((row, r))
        if not (admitted or any(groups)):
            return None
        width = min(w for w in e.lane_sizes if w // k >= max(map(len, groups)))
        lanes = [(s * (width // k) + j, row, r)
                 for s, group in enumerate(groups) for j, (row, r) in enumerate(group)]
        new = np.zeros((e.batch,), bool)
        new[[row for row, _ in admitted]] = True
        c = Chunk(lanes, new, np.full((width,), e.batch, np.int32),
                  np.zeros((width, e.prefill_chunk), np.int32), np.zeros((width,), np.int32),
                  np.zeros((width,), bool), np.ones((width,), np.int32))
        if e.prefix:
            c.new = np.zeros((width,), bool)
            c.seq = np.zeros((width, e.max_seq_len), np.int32)
            c.total = np.zeros((width,), np.int32)
            c.space = np.zeros((width,), np.int32)
        for i, row, r in lanes:
            part = r.ext[r.offset:r.offset + e.prefill_chunk]
            c.rows[i], c.n[i], c.tokens[i, :len(part)] = row, len(part), part
            c.last[i] = r.offset + len(part) == len(r.ext)
            c.budget[i] = r.max_new_tokens - len(r.output)
            if e.prefix:
                whole = np.concatenate([e.system_prompt, r.ext])
                c.seq[i, :len(whole)], c.total[i], c.new[i] = whole, len(whole), not r.started
                c.space[i] = r.tenant
            if not r.started:
                self.m["prefill_requested"] += self.syslen + len(r.ext)
                r.requested += self.syslen + len(r.ext)
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
        self.pages_in_use(usage[4:])
        self.uncached = int(usage[3])
        self.usage.append(usage[:4])  # (then each batch shard's reserved tokens)
        self.preempt_if_short()
        self.m["busy_host"] += time.perf_counter() - host

    def prefilled(self, c: Chunk, first: np.ndarray, ok: np.ndarray) -> None:
        for i, row, r in c.lanes:
            if _doing(r) != "prefill":  # preempted (recomputed) since the chunk was dispatched
                continue
            if not ok[i]:  # no pages for the chunk
                self.short.add(self._shard(row))
                continue
            self.m["prefill_computed"] += int(c.n[i])
            r.computed += int(c.n[i])
            r.offset += int(c.n[i])
            if c.last[i]:
                r.output.append(int(first[i]))
                _set_doing(r, "decode")

    def prefilled_prefix(self, c: Chunk, first, ok, n, last, matched) -> None:
        """A prefix-cache chunk's results: tokens run and matched per lane, as the device chose."""
        for i, row, r in c.lanes:
            if r.phase != "prefill":
                continue
            if c.new[i]:
                if not r.preemptions:  # its first admission: what the oracle is measured on
                    r.matched = int(matched[i])
                self.m["prefill_matched"] += int(matched[i])
                r.offset = int(matched[i]) - self.syslen
            self.m["prefill_computed"] += int(n[i])
            r.computed += int(n[i])
            if not ok[i]:
                self.short.add(self._shard(row))
                continue
            r.offset += int(n[i])
            # (its pages are indexed after each chunk; the system prompt's are shared by all
            # the tenant's requests)
            size = self.page_size
            if self.syslen + r.offset >= self.syslen // size * size:
                self.sys_indexed.add(r.tenant)
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
            if stalled[row]:
                self.short.add(self._shard(row))
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
        """Out of pages: the youngest request of a shard that ran out is preempted: its pages go
        to the host (a swapping engine), or it leaves, back to the front of the queue, to be
        recomputed."""
        short, self.short = self.short, set()
        victims = [r for row, r in self.live if self._shard(row) in short
                   and r.phase in ("prefill", "decode") and id(r) not in self.leaving]
        if victims:
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
