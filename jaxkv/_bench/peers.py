"""Peers (``--peers``): other libraries doing a case's work on the case's inputs, cross-checked
against jaxkv's result before they are timed.

Which peers a case has is its ``peer`` family: FlashInfer's kernels (``peers_flashinfer.py``) and
the PyTorch-native formulation a torch user would write (``peers_torch.py``, each row's name says
which). The case's JAX arrays are handed over with DLPack (zero-copy views of the same device
memory); the JAX side is finished (``block_until_ready``) before torch touches them.

For each peer, on fresh inputs (``case.build()`` again: deterministic, so the same bytes):

1. jaxkv's step ``i = 0`` gives the expected result (computed once per case, not donated);
2. the peer's call ``j = 0`` runs on the inputs, and its result must equal jaxkv's byte for byte
   (the specified bytes: a compaction's live tokens), or within ``tolerance`` for attention. A
   failed check marks the peer failed with the reason and no time is taken;
3. device time: the JAX profiler's trace over a few eager calls (CUPTI records every kernel of
   the process, torch's too), the duration of every kernel, memcpy and memset summed per call:
   the same quantity as jaxkv's profiler time, launch gaps excluded on both sides; torch.profiler
   only where that trace holds nothing (it keeps CUPTI after it ends, and later JAX traces in the
   process then fail). The peers run
   after every jaxkv measurement (``bench.add_peers``), so torch's profiler never runs between
   two of jaxkv's;
4. wall time, secondary: ``iters`` calls captured in one CUDA graph and replayed (CUDA events,
   median of ``reps`` replays), so that Python and launch overhead stay out as they do in
   jaxkv's jitted loop. Peers whose calls plan on the host (the attention wrappers) run eagerly.

A peer whose library does not import, or with no GPU, is skipped with the reason: never faked.
"""

from __future__ import annotations

import functools
import gc
import statistics
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import peers_flashinfer, peers_torch
from .peer_types import Peer, Spec
from . import timing as T

PROFILED_CALLS = 4  # eager calls under the profiler (after warm-up), like jaxkv's kernel_seconds
GRAPH_LAUNCHES = 20_000  # the most kernel launches captured in one CUDA graph


def specs(case) -> list[Spec]:
    """The peers of a case ([] when no peer does the same work)."""
    return [*peers_flashinfer.specs(case), *peers_torch.specs(case)]


@functools.cache
def unavailable(library: str) -> str | None:
    """Why a library's peers cannot run here, or None."""
    if jax.default_backend() != "gpu":
        return "needs a CUDA GPU"
    try:
        import torch

        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
    except Exception as e:  # ImportError, or a broken install
        return f"torch does not import ({first_line(e)})"
    if library == "flashinfer":
        try:
            import flashinfer  # noqa: F401
        except Exception as e:
            return f"flashinfer does not import ({first_line(e)})"
    return None


def versions() -> dict:
    """The peer libraries' versions, where they import (for the report's header)."""
    out = {}
    for name in ("torch", "flashinfer"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            pass
    return out


def first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def run(case, reps: int, specs_=None, available=None, measure=None) -> dict:
    """{peer name: result} for a case: status "ok" with its times, "failed" (cross-check),
    "error" (it raised) or "skipped" (its library is missing), with the reason. ``specs_``,
    ``available`` and ``measure`` replace the case's peers, the library check and the timing
    (tests)."""
    out = {}
    expected = None
    for spec in specs(case) if specs_ is None else specs_:
        why = (available or unavailable)(spec.library)
        if why:
            out[spec.name] = dict(status="skipped", library=spec.library, note=why)
            continue
        peer = None
        try:
            peer, expected, problem = bind(case, spec, expected)
            if problem:
                out[spec.name] = dict(status="failed", library=spec.library,
                                      error=f"cross-check failed: {problem}")
                continue
            check = ("byte for byte" if peer.tolerance is None
                     else f"max |diff| <= {peer.tolerance:g}")
            out[spec.name] = dict(status="ok", library=spec.library, checked=check,
                                  **(measure or timed)(peer, case, reps))
        except Exception as e:  # a peer's failure must not cost the jaxkv rows
            out[spec.name] = dict(status="error", library=spec.library, error=first_line(e))
        finally:
            del peer
            gc.collect()
            release()
    return out


def bind(case, spec: Spec, expected=None, inputs=None):
    """(peer, expected, what differs or None): the peer bound to fresh inputs of the case after
    its first call (j = 0), jaxkv's result of its step i = 0 on the same inputs (``expected``
    where given: the inputs are deterministic), and the cross-check of the two. ``inputs``:
    ``(carry, consts, kernel)`` already built (and not yet written by another peer)."""
    carry, consts, kernel = case.build()[:3] if inputs is None else inputs
    if expected is None:  # not donated: the inputs stay as built
        expected = jax.jit(kernel)(jnp.int32(0), carry, consts)
    jax.block_until_ready((carry, consts, expected))
    peer = spec.make(case, carry, consts)
    peer.call(0)
    synchronize()
    problem = mismatch(peer.outputs(), jax.tree_util.tree_leaves(expected), regions(case),
                       peer.tolerance)
    return peer, expected, problem


# --- the cross-check ------------------------------------------------------------------------------


def regions(case) -> Callable[[list], list]:
    """The bytes a case's op specifies, as pieces of its output leaves: everything, except a
    compaction's, which specifies only the live tokens of every survivor's new row."""
    if case.peer not in ("compact_linear", "compact_layers"):
        return lambda leaves: leaves
    lengths, mapping = case.params["lengths"], case.params["mapping"]
    survivors = np.flatnonzero(mapping >= 0)
    stacked = case.peer == "compact_linear"  # [L, B, 2, H, S, D]; else layers of [B, 2, H, S, D]

    def pieces(leaves):
        out = []
        for x in leaves:
            for i in survivors:
                row = x[:, int(mapping[i])] if stacked else x[int(mapping[i])]
                out.append(row[..., : int(lengths[i]), :])
        return out

    return pieces


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def mismatch(got: list, want: list, pick=lambda leaves: leaves,
             tolerance: float | None = None) -> str | None:
    """None when the peer's outputs ``got`` (torch tensors, or numpy / JAX arrays) equal
    ``want`` (jaxkv's, JAX arrays) on the specified pieces; else what differs."""
    if len(got) != len(want):
        return f"{len(got)} outputs, jaxkv has {len(want)}"
    if got and _is_torch(got[0]):
        import torch

        want = [torch.from_dlpack(w) for w in want]
    else:
        got, want = [np.asarray(g) for g in got], [np.asarray(w) for w in want]
    got, want = pick(got), pick(want)
    for n, (g, w) in enumerate(zip(got, want)):
        if tuple(g.shape) != tuple(w.shape) or _dtype_name(g) != _dtype_name(w):
            return (f"piece {n}: {_dtype_name(g)}{tuple(g.shape)}, jaxkv has "
                    f"{_dtype_name(w)}{tuple(w.shape)}")
        if tolerance is not None:
            err = _max_abs_diff(g, w)
            if not err <= tolerance:
                return f"piece {n}: max |peer - jaxkv| = {err:.3g} > {tolerance:g}"
            continue
        differ, size, first = _differing(g, w)
        if differ:
            return (f"piece {n} of shape {tuple(w.shape)}: {differ} of {size} elements differ, "
                    f"the first at {first}")
    return None


def _dtype_name(x) -> str:
    return str(x.dtype).removeprefix("torch.")


_TORCH_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _differing(g, w) -> tuple[int, int, tuple]:
    """(elements whose bits differ, elements, the first differing index)."""
    if _is_torch(g):
        import torch

        bits = getattr(torch, _TORCH_BITS[g.element_size()])
        ne = g.view(bits) != w.view(bits)
        count = int(ne.sum())
        first = tuple(int(i) for i in ne.nonzero()[0]) if count else ()
        return count, g.numel(), first
    bits = f"u{g.dtype.itemsize}"
    ne = g.view(bits) != w.view(bits)
    count = int(ne.sum())
    first = tuple(int(i) for i in np.argwhere(ne)[0]) if count else ()
    return count, g.size, first


def _max_abs_diff(g, w) -> float:
    if _is_torch(g):
        return float((g.float() - w.float()).abs().max()) if g.numel() else 0.0
    return float(np.max(np.abs(g.astype(np.float32) - w.astype(np.float32)), initial=0.0))


# --- timing (torch) -------------------------------------------------------------------------------


def synchronize() -> None:
    if jax.default_backend() == "gpu":
        import torch

        torch.cuda.synchronize()


def release() -> None:
    """Gives the peer's cached torch memory back (JAX's next case may need it)."""
    if jax.default_backend() == "gpu":
        try:
            import torch

            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:
            pass


def timed(peer: Peer, case, reps: int) -> dict:
    """Device time (profiler) and wall time (CUDA graph, else eager) of a checked peer, per op."""
    import torch

    for j in range(3):  # warm-up: JIT builds, autotuning, first touch
        peer.call(j)
    torch.cuda.synchronize()
    per_call, launches, profiler = device_seconds(peer.call, PROFILED_CALLS)
    n = max(1, min(case.iters, GRAPH_LAUNCHES // max(1, round(launches))))
    how, seconds = wall_seconds(peer, n, reps)
    ops = case.per_step  # a call does what one loop step of jaxkv's does
    median = statistics.median(seconds) / ops
    result = dict(time_s=median, times_s=[s / ops for s in seconds],
                  spread=(max(seconds) - min(seconds)) / (median * ops), timing=how,
                  kernel_launches=launches / ops, profiler=profiler)
    if per_call is not None:
        result.update(kernel_time_s=per_call / ops, gbps=case.min_bytes * ops / per_call / 1e9)
    return result


def device_seconds(call, n: int) -> tuple[float | None, float, str]:
    """(median device seconds of one call, device activities per call, the profiler): ``n``
    calls under the JAX profiler, whose trace records every kernel of the process (torch's
    too), the same measure as jaxkv's rows. Only where it records nothing, torch.profiler (the
    second of two sessions: the first starts CUPTI up). Not the other way round: torch's
    profiler keeps CUPTI subscribed after it ends, and every later JAX trace in the process then
    fails (CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED, seen on the H200)."""
    import torch

    profiler = "jax.profiler"
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for j in range(n):
                call(j)
            torch.cuda.synchronize()
        events = T.stream_durations(d)
    if not events:
        from torch.profiler import ProfilerActivity, profile

        profiler = "torch.profiler"
        try:
            for _ in range(2):
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for j in range(n):
                        call(j)
                    torch.cuda.synchronize()
            events = device_events(prof)
        except Exception:  # a profiler that cannot start here: no device time
            pass
    durations = [d for _, d in sorted(events)]
    if not durations:
        return None, 0.0, "none (no device activity recorded)"
    # The calls' activities are back to back in start order: a call's are its share of them.
    per_call = T.per_op_seconds(durations, n)
    return (per_call if per_call is not None else sum(durations) / n), len(durations) / n, profiler


def device_events(prof) -> list[tuple[float, float]]:
    """(start, seconds) of every device activity (kernel, memcpy, memset) a profile recorded;
    not the GPU-side spans of annotations (record_function ranges), which cover kernels."""
    from torch.autograd import DeviceType

    try:
        events = prof.profiler.kineto_results.events()
        return [(e.start_ns(), e.duration_ns() * 1e-9) for e in events
                if e.device_type() == DeviceType.CUDA
                and not getattr(e, "is_user_annotation", lambda: False)()]
    except AttributeError:  # another torch's private API: the public event list
        return [(e.time_range.start, e.time_range.elapsed_us() * 1e-6) for e in prof.events()
                if e.device_type == DeviceType.CUDA
                and not getattr(e, "is_user_annotation", False)]


def wall_seconds(peer: Peer, n: int, reps: int) -> tuple[str, list[float]]:
    """(how it ran, seconds per call of each repetition): ``n`` calls in one CUDA graph replayed,
    else (capture failed, or ``peer.graph`` False) ``n`` eager calls, timed with CUDA events."""
    import torch

    def eager():
        for j in range(n):
            peer.call(j)

    run, how = eager, f"eager, {n} calls"
    if peer.graph:
        try:
            graph = capture(peer.call, n)
            run, how = graph.replay, f"CUDA graph of {n} calls"
        except Exception as e:  # a call that cannot be captured: eager, and say why
            try:
                torch.cuda.synchronize()
            except Exception:
                pass
            how = f"eager, {n} calls (CUDA graph capture failed: {first_line(e)})"
    run()
    torch.cuda.synchronize()
    seconds = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        seconds.append(start.elapsed_time(stop) / 1e3 / n)
    return how, seconds


def capture(call, n: int):
    """A CUDA graph of calls 0 .. n-1 (warmed up on a side stream first, as torch asks)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for j in range(min(n, 3)):
            call(j)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: under the default ("global") a capture that fails (an op that synchronizes)
    # also fails the CUDA calls of JAX's runtime threads, which leaves JAX's stream broken for
    # the rest of the run (seen on the H200: "Callback registry is closed").
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for j in range(n):
            call(j)
    return graph
