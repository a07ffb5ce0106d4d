"""The serving schedule's host-side choices over batch shards (``jaxkv.serving.schedule``), on a
stand-in engine: no device and no model. Each batch shard has its own rows and its own pool of
pages, so admission, prefill lanes and preemption are decided shard by shard."""

import types

import numpy as np

from jaxkv.serving import schedule as S
from jaxkv.serving.stream import ServeRequest

PAGE = 16


def engine(shards: int, batch: int = 8, lanes=(2, 4)):
    kind = types.SimpleNamespace(page_size=PAGE, batch_shards=shards)
    return types.SimpleNamespace(kind=kind, batch=batch, system_prompt=np.zeros(0, np.int32),
                                 prefix=False, swap=False, lane_sizes=lanes,
                                 prefill_rows=max(lanes), prefill_chunk=32, decode_steps=4)


def requests(n: int, prompt: int = 40) -> list[ServeRequest]:
    rng = np.random.default_rng(0)
    return [ServeRequest(i, rng.integers(1, 100, prompt).astype(np.int32), 8, 0.0)
            for i in range(n)]


def schedule(shards: int, num_pages: int, n: int) -> S.Schedule:
    sched = S.Schedule(engine(shards), requests(n), num_pages)
    sched.arrive(0.0)
    return sched


def test_admission_counts_each_shards_pages():
    """Shard 0's pool is nearly full and shard 1's empty: every request admitted goes to shard
    1 (a count over both pools would put half of them where no page is left), while it has
    rows and pages."""
    sched = schedule(2, num_pages=64, n=6)
    sched.pages_in_use([30 * PAGE, 0])  # 2 of shard 0's 32 pages free
    admitted = sched.admit()
    assert [row // 4 for row, _ in admitted] == [1, 1, 1, 1]  # shard 1's four rows
    assert len(sched.waiting) == 2


def test_admission_stops_where_no_shard_has_the_pages():
    """A request that fits no shard's pool waits (first come, first served), though the pools
    together would hold it."""
    sched = schedule(2, num_pages=16, n=3)  # 8 pages a shard, a mark of 1; 3 pages a request
    sched.pages_in_use([2 * PAGE, 2 * PAGE])  # 6 free in each: 5 usable
    admitted = sched.admit()
    assert sorted(row // 4 for row, _ in admitted) == [0, 1]
    assert len(sched.waiting) == 1


def test_one_shard_admits_while_its_pool_has_the_pages():
    sched = schedule(1, num_pages=20, n=10)  # 19 usable pages, 3 a request (41 tokens): 6
    sched.pages_in_use([0])
    assert [row for row, _ in sched.admit()] == list(range(6))


def test_a_prefill_chunks_lanes_are_grouped_by_shard():
    """Over 2 shards the lanes are two groups, each holding its shard's oldest prefilling rows
    (at most half the lanes); the other group's lanes are unused (row B)."""
    sched = schedule(2, num_pages=64, n=3)
    sched.pages_in_use([0, 32 * PAGE])  # shard 1 full: all three go to shard 0
    admitted = sched.admit()
    assert [row // 4 for row, _ in admitted] == [0, 0, 0]
    c = sched.prefill_chunk(admitted)
    assert c.width == 4 and c.rows.tolist() == [0, 1, 8, 8]
    assert [(lane, row) for lane, row, _ in c.lanes] == [(0, 0), (1, 1)]


def test_a_shard_out_of_pages_preempts_its_own_youngest():
    """A row of shard 0 stalled for want of a page: the youngest request of shard 0 is
    preempted, not the youngest of all (shard 1's pages would free nothing for shard 0)."""
    sched = schedule(2, num_pages=256, n=4)
    sched.pages_in_use([0, 0])
    admitted = sched.admit()  # shards alternate (the most free rows first): 0, 1, 0, 1
    assert [row // 4 for row, _ in admitted] == [0, 1, 0, 1]
    for _, r in admitted:
        r.phase = "decode"
    youngest_of_0 = max((r for row, r in admitted if row // 4 == 0), key=lambda r: r.order)
    stalled = np.zeros(8, bool)
    stalled[0] = True
    out = np.full((1, 8), -1, np.int32)
    sched.decoded(sched.live, out, np.zeros(8, bool), stalled, 0.0)
    sched.preempt_if_short()
    assert [r.preemptions for _, r in admitted] == [int(r is youngest_of_0) for _, r in admitted]


def test_a_request_waits_only_for_its_own_tenants_prefilling_prefix():
    """Prefix caching with tenants: a waiting request whose prefix a row of its own tenant is
    still prefilling waits for it (it will find the pages); the same prefix prefilled by another
    tenant's row never becomes findable to it, so it is admitted now. Over batch shards, the
    shard that last took a prefix is remembered per tenant. Each lane carries its tenant."""
    e = engine(2)
    e.prefix, e.max_seq_len = True, 128
    rs = requests(4)
    rs[1].prompt = rs[0].prompt.copy()  # same tenant as request 0
    rs[2].prompt, rs[2].tenant = rs[0].prompt.copy(), 1  # the same tokens, another tenant
    rs[3].prompt, rs[3].tenant = rs[0].prompt.copy(), 1
    sched = S.Schedule(e, rs, 64)
    sched.arrive(0.0)
    sched.pages_in_use([0, 0])
    admitted = sched.admit()
    # request 1 waits for request 0's pages; request 2 (tenant 1) goes, and 3 waits for it
    assert [r.id for _, r in admitted] == [0, 2]
    assert [r.id for r in sched.waiting] == [1, 3] and sched.m["deferred"] == 2
    assert {key[0] for key in sched.home} == {0, 1}
    c = sched.prefill_chunk(admitted)
    assert sorted((int(c.space[i]), r.id) for i, _, r in c.lanes) == [(0, 0), (1, 2)]


def test_the_second_half_of_a_run_counts_from_its_middle():
    """note_half marks the first iteration past half the duration, with the tokens so far; a run
    without a duration has no second half."""
    requests = [types.SimpleNamespace(output=[1, 2]), types.SimpleNamespace(output=[3])]
    sched = types.SimpleNamespace(m={}, requests=requests)
    S.Schedule.note_half(sched, 0.4, 1.0)
    assert sched.m == {}
    S.Schedule.note_half(sched, 0.6, 1.0)
    assert sched.m == {"half_at": 0.6, "half_tokens": 3}
    requests[0].output.append(4)
    S.Schedule.note_half(sched, 0.9, 1.0)
    assert sched.m == {"half_at": 0.6, "half_tokens": 3}
    unbounded = types.SimpleNamespace(m={}, requests=requests)
    S.Schedule.note_half(unbounded, 5.0, None)
    assert unbounded.m == {}
