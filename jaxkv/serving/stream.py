"""The request streams of ``python -m jaxkv serve``: lognormal lengths, chat conversations that
resend themselves, long shared prompts, and the oracle of what a prefix cache could reuse."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """A synthetic stream: lognormal prompt and output lengths (long-tailed: most requests are far
    shorter than the longest), clipped so that system prompt + prompt + output <= max_seq_len."""

    requests: int = 48
    seed: int = 0
    system_len: int = 8  # the shared system prompt (a prefix of every request)
    mean_prompt: float = 12.0  # mean of the lognormal before clipping
    mean_output: float = 12.0
    sigma: float = 1.0  # of log(length), for both
    max_seq_len: int = 256
    rate: float | None = None  # Poisson arrivals, requests/s; None: all queued at the start
    # "lognormal": independent prompts. "chat": conversations of `turns` turns, each turn's
    # prompt the whole conversation so far (earlier prompts and replies) and a new message,
    # `turn_gap` s after the turn before (`rate`: conversations/s). "shared": `prefixes` long
    # prompts of `prefix_len` tokens, each request one of them and a message of its own.
    kind: str = "lognormal"
    turns: int = 4
    turn_gap: float = 1.0
    prefixes: int = 8
    prefix_len: int = 64
    # Tenants: each request belongs to one (chat: each conversation; otherwise request i to
    # tenant i % tenants), and a prefix-caching engine shares cached pages only within a tenant
    # (the prefix index's namespaces). 1: one tenant, every page shareable.
    tenants: int = 1


@dataclasses.dataclass
class ServeRequest:
    id: int
    prompt: np.ndarray  # int32 [P], after the system prompt
    max_new_tokens: int
    arrival: float  # seconds after the start
    output: list = dataclasses.field(default_factory=list)
    tenant: int = 0  # its prefix-cache namespace: it finds only its own tenant's cached pages
    # The schedule's state.
    ext: np.ndarray | None = None  # tokens to prefill: the prompt (+ the output, once preempted)
    offset: int = 0  # tokens of ext prefilled
    phase: str = "waiting"  # waiting, prefill, decode, swapped (its pages on the host), done
    resume: str = ""  # swapped: the phase it goes back to when its pages return
    order: int = -1  # admission order (the youngest is preempted first)
    first_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    started: bool = False  # prefix cache: its first chunk (which matches its prefix) dispatched
    matched: int = 0  # prefix cache: tokens its admissions found cached
    # prompt tokens (system prompt's included) its admissions asked for and its prefill chunks
    # computed (each admission again, once preempted and recomputed)
    requested: int = 0
    computed: int = 0


def lognormal_lengths(rng, n: int, mean: float, sigma: float) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2  # so that the mean is `mean`
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(np.int64)


STREAMS = ("lognormal", "chat", "shared")


def make_stream(sc: StreamConfig, vocab: int) -> tuple[np.ndarray, list[ServeRequest]]:
    """(system prompt, requests), the same for a given config on every machine."""
    rng = np.random.default_rng(sc.seed)
    system = rng.integers(0, vocab, sc.system_len, dtype=np.int32)
    room = sc.max_seq_len - sc.system_len
    if sc.kind == "chat":
        return system, _chat(sc, rng, vocab, room)
    if sc.kind == "shared":
        return system, _tenants(sc, _shared(sc, rng, vocab, room))
    prompts = np.minimum(lognormal_lengths(rng, sc.requests, sc.mean_prompt, sc.sigma), room - 1)
    outputs = np.minimum(lognormal_lengths(rng, sc.requests, sc.mean_output, sc.sigma),
                         room - prompts)
    requests = [ServeRequest(i, rng.integers(0, vocab, int(p), dtype=np.int32), int(o), 0.0)
                for i, (p, o) in enumerate(zip(prompts, outputs))]
    if sc.rate:  # from a generator of their own: the same requests, offline or not
        gaps = np.random.default_rng([sc.seed, 1]).exponential(1 / sc.rate, sc.requests)
        for r, t in zip(requests, np.cumsum(gaps)):
            r.arrival = float(t)
    return system, _tenants(sc, requests)


def _tenants(sc: StreamConfig, requests: list[ServeRequest]) -> list[ServeRequest]:
    """Request ``i`` to tenant ``i % tenants`` (after the stream is drawn: the same requests for
    any count of tenants)."""
    for r in requests:
        r.tenant = r.id % sc.tenants
    return requests


def _starts(sc: StreamConfig, n: int) -> np.ndarray:
    if not sc.rate:
        return np.zeros(n)
    return np.cumsum(np.random.default_rng([sc.seed, 1]).exponential(1 / sc.rate, n))


def _chat(sc: StreamConfig, rng, vocab: int, room: int) -> list[ServeRequest]:
    """Conversations: turn t's prompt is turns 0..t-1's prompts and replies and a new message;
    conversation ``c``'s turns belong to tenant ``c % tenants``."""
    count = -(-sc.requests // sc.turns)
    requests: list[ServeRequest] = []
    for c, start in enumerate(_starts(sc, count)):
        history = np.zeros((0,), np.int32)
        for t in range(sc.turns):
            message = rng.integers(0, vocab, int(lognormal_lengths(rng, 1, sc.mean_prompt,
                                                                  sc.sigma)[0]), dtype=np.int32)
            reply = int(lognormal_lengths(rng, 1, sc.mean_output, sc.sigma)[0])
            prompt = np.concatenate([history, message])
            if len(prompt) + 1 > room or len(requests) == sc.requests:
                break
            requests.append(ServeRequest(len(requests), prompt, min(reply, room - len(prompt)),
                                         float(start + t * sc.turn_gap),
                                         tenant=c % sc.tenants))
            # the reply as the next turn sees it (the stream's own tokens, not the model's)
            history = np.concatenate([prompt, rng.integers(0, vocab, reply, dtype=np.int32)])
    return sorted(requests, key=lambda r: (r.arrival, r.id))


def _shared(sc: StreamConfig, rng, vocab: int, room: int) -> list[ServeRequest]:
    """A few long prompts shared by many requests, each with a message of its own."""
    prefixes = rng.integers(0, vocab, (sc.prefixes, min(sc.prefix_len, room - 2)), dtype=np.int32)
    which = rng.integers(0, sc.prefixes, sc.requests)
    messages = lognormal_lengths(rng, sc.requests, sc.mean_prompt, sc.sigma)
    outputs = lognormal_lengths(rng, sc.requests, sc.mean_output, sc.sigma)
    requests = []
    for i, (w, m, o, t) in enumerate(zip(which, messages, outputs, _starts(sc, sc.requests))):
        prompt = np.concatenate([prefixes[w], rng.integers(0, vocab, int(m), dtype=np.int32)])
        prompt = prompt[:room - 1]
        requests.append(ServeRequest(i, prompt, int(min(o, room - len(prompt))), float(t)))
    return requests


def oracle_reuse(system: np.ndarray, requests: list[ServeRequest], page_size: int) -> dict:
    """Per request, the most tokens a prefix cache of unbounded size could give it: full pages
    it shares, from the start, with a request of its tenant that arrived before it (at least one
    token left)."""
    index: dict = {}
    best = {}
    for r in sorted(requests, key=lambda r: (r.arrival, r.id)):
        seq = np.concatenate([system, r.prompt]).tolist()
        root = -1 - r.tenant  # each tenant's chains from a root of its own
        node, k = root, 0
        limit = (len(seq) - 1) // page_size
        while k < limit and (node, tuple(seq[k * page_size:(k + 1) * page_size])) in index:
            node = index[(node, tuple(seq[k * page_size:(k + 1) * page_size]))]
            k += 1
        best[r.id] = k * page_size
        node = root
        for j in range(len(seq) // page_size):
            node = index.setdefault((node, tuple(seq[j * page_size:(j + 1) * page_size])),
                                    len(index))
    return best


def fresh(requests: list[ServeRequest]) -> list[ServeRequest]:
    return [ServeRequest(r.id, r.prompt, r.max_new_tokens, r.arrival, tenant=r.tenant)
            for r in requests]
