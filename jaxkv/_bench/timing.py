"""Device time of an op, its peak memory, and what XLA compiled for it.

An op is timed as ``n`` applications inside ONE jitted ``fori_loop`` whose carry (the cache, or the
op's output) is donated and feeds the next iteration, so each application runs in place, nothing
can be hoisted out of the loop, and one dispatch is spread over ``n`` applications. The wall time of
the whole call (``block_until_ready``) over ``n`` is the per-op time; the loop's own per-iteration
cost is measured separately (``loop_overhead``) and is included, not subtracted.
"""

from __future__ import annotations

import gc
import glob
import re
import statistics
import sys
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

Step = Callable  # (i: int32 scalar, carry, consts) -> carry


class Progress:
    """A one-line progress bar on stderr (a line per step when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.done, self.enabled = max(total, 1), 0, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        """Starts the next step."""
        self.done = min(self.done + 1, self.total)
        self.label(label)

    def label(self, label: str, finished: int | None = None) -> None:
        """Shows what the current step is doing now."""
        if not self.enabled:
            return
        width = 24
        filled = width * (self.done - 1 if finished is None else finished) // self.total
        bar = "#" * filled + "." * (width - filled)
        line = f"[{bar}] {self.done}/{self.total} {time.perf_counter() - self.start:4.0f}s {label}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:150])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.done = self.total
            self.label("done", finished=self.total)
            if self.tty:
                self.stream.write("\n")


def block(tree) -> None:
    jax.block_until_ready(tree)


_WIDTH = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_COPY = re.compile(r"=\s*(\w+)\[([\d,]*)\](?:\{[^}]*\})?\s+copy(?:-start)?\(")


def big_copies(hlo: str, min_bytes: int = 1 << 20) -> int:
    """Copy instructions of at least ``min_bytes`` in a compiled module (a cache copied)."""
    count = 0
    for dtype, dims in _COPY.findall(hlo):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        count += n * _WIDTH.get(dtype, 4) >= min_bytes
    return count


def _plain(hlo: str) -> str:
    """HLO text without comments: long tuple types carry ``/*index=5*/`` markers."""
    return re.sub(r"/\*.*?\*/", "", hlo)


def _entry(hlo: str) -> tuple[str, str]:
    """(the module's entry computation, everything else)."""
    hlo = _plain(hlo)
    start = hlo.find("\nENTRY")
    if start < 0:
        return "", hlo
    end = hlo.find("\n}", start)
    end = len(hlo) if end < 0 else end + 2
    return hlo[start:end], hlo[:start] + hlo[end:]


# "call": a command buffer the timed loop may sit in.
_PLUMBING_ENTRY = {"parameter", "constant", "tuple", "get-tuple-element", "while", "bitcast",
                   "call"}


def entry_work(hlo: str) -> int:
    """Bytes computed once per call outside the loop (e.g. a layout change of the whole carry
    that XLA puts before and after the loop): a fixed cost that a single loop length would spread
    over the iterations and count as the op's."""
    entry, _ = _entry(hlo)
    total = 0
    for result, opcode in _RESULT.findall(entry):
        if opcode not in _PLUMBING_ENTRY:
            for dtype, dims in _ARRAY.findall(result):
                n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
                total += n * _WIDTH.get(dtype, 4)
    return total


def _computations(hlo: str) -> tuple[dict[str, str], str | None]:
    """(computation name -> its text, the entry's name), for a compiled module's text."""
    comps, name, lines, entry = {}, None, [], None
    for line in _plain(hlo).splitlines():
        head = re.match(r"(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            name, lines = head.group(1), []
            entry = name if line.startswith("ENTRY") else entry
        elif name and line.startswith("}"):
            comps[name] = "\n".join(lines)
            name = None
        elif name:
            lines.append(line)
    return comps, entry


# An instruction's result type (an array or a tuple of them) and opcode.
_RESULT = re.compile(r"=\s*(\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+([\w\-]+)\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
# Not the op's work: plumbing, and copies (a hoisted result is copied into the carry; copies
# are counted on their own by big_copies).
_NO_WORK = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "broadcast", "iota",
            "copy", "copy-start", "copy-done"}


def _closure(comps: dict[str, str], roots: list[str]) -> set[str]:
    """The computations ``roots`` run, with every computation they call."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += [n for n in re.findall(r"%([\w.\-]+)", comps[name]) if n in comps]
    return seen


def _timed_loops(comps: dict[str, str]) -> list[tuple[str, int | None]]:
    """(body, known trip count or None) of each outermost while loop: the timed loop, wherever
    XLA put it (in the entry, or inside a command buffer the entry calls)."""
    loops = []
    for name, text in comps.items():
        for line in text.splitlines():
            body = re.search(r"\swhile\(.*body=%([\w.\-]+)", line)
            if body:
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                loops.append((name, body.group(1), int(trip.group(1)) if trip else None))
    inner = set().union(*(_closure(comps, [body]) for _, body, _ in loops))
    return [(body, trip) for where, body, trip in loops if where not in inner]


def jaxkv_calls(hlo: str, n: int) -> float:
    """jaxkv custom calls executed per loop iteration: those outside the loop (run once, e.g. an
    op XLA hoisted out of the loop, or a loop XLA unrolled completely) and those in the loop body
    times its trip count, over the ``n`` iterations asked for (so a partly unrolled loop counts
    right too)."""
    comps, entry = _computations(hlo)
    call = 'custom_call_target="jaxkv_'
    loops = _timed_loops(comps)
    bodies = set().union(*(_closure(comps, [body]) for body, _ in loops))
    total = sum(comps[c].count(call) for c in _closure(comps, [entry]) - bodies)
    for body, trip in loops:
        per_trip = sum(comps[c].count(call) for c in _closure(comps, [body]))
        total += per_trip * (trip if trip is not None else n)
    return total / n


def loop_work(hlo: str) -> int:
    """Bytes of the largest array computed inside the timed loop (its body and every computation
    the body calls). XLA hoists loop-invariant work out of a loop: an op that did not depend on
    the loop counter or the carry would run once per call, and this would drop below the size of
    the op's output. A loop XLA unrolled completely has no body: then the whole module counts
    (``jaxkv_calls`` still tells whether each iteration kept its op)."""
    comps, _ = _computations(hlo)
    bodies = [body for body, _ in _timed_loops(comps)]
    names = _closure(comps, bodies) if bodies else set(comps)
    largest = 0
    for name in names:
        for result, opcode in _RESULT.findall(comps[name]):
            if opcode in _NO_WORK:
                continue
            for dtype, dims in _ARRAY.findall(result):
                size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
                largest = max(largest, size * _WIDTH.get(dtype, 4))
    return largest


def loop(step: Step, n: int):
    """jit of ``n`` applications of ``step`` to a donated carry."""

    def run(carry, consts):
        return jax.lax.fori_loop(0, n, lambda i, c: step(i, c, consts), carry)

    return jax.jit(run, donate_argnums=0)


def time_loop(step: Step, carry, consts, n: int, reps: int, per_step: int = 1,
              memory: bool = False, budget_s: float | None = None):
    """(carry, per-op seconds of each repetition, compiled HLO text, memory) after a warm-up call.

    With ``memory`` the warm-up call doubles as the memory probe: ``(measured, static)`` extra
    bytes (see ``peak_extra``); a loop holds one application's buffers, and its carry is the op's
    cache or output, so that is what one op needs beyond its inputs and outputs.
    ``budget_s``: stop after two repetitions once the timed calls have taken that long (a
    formulation 50x slower than the kernel needs no five calls to show it).
    """
    compiled = loop(step, n).lower(carry, consts).compile()
    static = None
    try:
        ma = compiled.memory_analysis()  # temporaries and outputs not aliased to a donated input
        static = int(ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes)
    except Exception:  # not every backend reports it
        pass
    # Warm-up: module load, autotuning, first touch.
    if memory:
        carry, measured = peak_extra(lambda: compiled(carry, consts), static)
    else:
        carry, measured = compiled(carry, consts), None
    block(carry)
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        carry = compiled(carry, consts)
        block(carry)
        seconds.append((time.perf_counter() - start) / (n * per_step))
        if budget_s is not None and len(seconds) >= 2 and sum(seconds) * n * per_step > budget_s:
            break
    return carry, seconds, compiled.as_text(), (measured, static)


# Kernels that do an op's work: jaxkv's own, and cuDNN's attention where jaxkv.attention hands a
# call to it (its generated kernels' names carry "cudnn" or "sdpa").
_OP_KERNELS = ("jaxkv", "cudnn", "sdpa")


def _gpu_planes(trace_dir: str) -> list:
    """The GPU planes of the profiler trace written to ``trace_dir`` (none off a GPU)."""
    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not paths:
        return []
    data = jax.profiler.ProfileData.from_file(paths[0])
    return [p for p in data.planes if p.name.startswith("/device:GPU")]


def jaxkv_kernel_durations(trace_dir: str) -> list[list[float]]:
    """Seconds of every kernel of a jaxkv op in a profiler trace, per GPU, in start order (CUPTI's
    timestamps: device time, no launch or loop cost in it)."""
    devices = []
    for plane in _gpu_planes(trace_dir):
        events = [(e.start_ns, e.duration_ns * 1e-9)
                  for line in plane.lines for e in line.events
                  if any(k in e.name.lower() for k in _OP_KERNELS)]
        if events:
            devices.append([d for _, d in sorted(events)])
    return devices


def stream_durations(trace_dir: str) -> list[tuple[int, float]]:
    """(start ns, seconds) of every device activity on the first GPU's stream lines of a
    profiler trace: kernels and copies, whoever launched them (torch's too: CUPTI records the
    whole process), without the lines the profiler derives from them."""
    for plane in _gpu_planes(trace_dir):
        events = [(e.start_ns, e.duration_ns * 1e-9) for line in plane.lines
                  if line.name.startswith("Stream") for e in line.events]
        if events:
            return sorted(events)
    return []


def kernel_seconds(step: Step, carry, consts, per_step: int = 1, n: int = 4):
    """(carry, median device time of one op's jaxkv kernels or None, launches seen, expected):
    ``n`` iterations of ``step`` run once under the profiler (after a warm-up call). An op of
    several launches (a split-KV attention and its combine) counts all of them: its launches are
    consecutive, so the trace is cut into ``expected`` groups of equal count and each summed.
    Sharded over several GPUs: each GPU's own median, the slowest GPU's time (a step waits for
    it); the launches seen are those of one GPU."""
    compiled = loop(step, n).lower(carry, consts).compile()
    carry = compiled(carry, consts)
    block(carry)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            carry = compiled(carry, consts)
            block(carry)
        devices = jaxkv_kernel_durations(d)
    if not devices:
        return carry, None, 0, n * per_step
    times = [per_op_seconds(seconds, n * per_step) for seconds in devices]
    worst = None if None in times else max(times)
    return carry, worst, len(devices[0]), n * per_step


def per_op_seconds(launches: list[float], ops: int) -> float | None:
    """Median over ops of the summed durations of each op's launches (in trace order); None when
    the launches do not split evenly into ``ops`` ops (a kernel missing from the trace)."""
    if not launches or len(launches) % ops:
        return None
    k = len(launches) // ops
    return statistics.median(sum(launches[i:i + k]) for i in range(0, len(launches), k))


def memory_stats() -> dict | None:
    try:
        return jax.devices()[0].memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None


PAD_PIECE = 1 << 30  # the pad's largest buffer (see pad_device_memory)


def pad_device_memory(nbytes: int) -> list | None:
    """Live device buffers of ``nbytes`` in all, in pieces of at most PAD_PIECE bytes, or None
    where the allocator cannot place them. One buffer of the whole gap (98.7 GiB after a full
    run's largest cases) found no hole that large in the H200's fragmented pool, though the free
    bytes sufficed (2026-11-29); pieces fill the holes."""
    try:
        pad = [jnp.zeros((min(PAD_PIECE, nbytes - at),), jnp.uint8)
               for at in range(0, nbytes, PAD_PIECE)]
        block(pad)
        return pad
    except jax.errors.JaxRuntimeError:  # RESOURCE_EXHAUSTED: the pieces freed, no measurement
        return None


def peak_extra(call, expected: int | None):
    """(``call()``'s result, the device memory it allocated beyond what was live, or None).

    The device's ``peak_bytes_in_use`` only ever grows, so before the call we allocate a pad that
    brings the bytes in use up to the current peak: the call then raises the peak by exactly what
    it allocates, whatever ran before it in this process. None where the backend keeps no
    statistics (CPU), or where the pad and ``expected`` bytes would not fit together.
    """
    gc.collect()
    stats = memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        gap = stats["peak_bytes_in_use"] - stats["bytes_in_use"]
        room = stats.get("bytes_limit", 1 << 62) - stats["bytes_in_use"] - gap
        pad = pad_device_memory(gap) if room >= (expected or 0) + (1 << 30) else None
        if pad is not None:
            before = memory_stats()
            out = call()
            block(out)
            measured = max(memory_stats()["peak_bytes_in_use"] - before["bytes_in_use"], 0)
            del pad
            return out, measured
    out = call()
    block(out)
    return out, None


def copy_bandwidth(nbytes: int, n: int, reps: int) -> dict:
    """Bytes read + written per second of two plain device copies of ``nbytes``.

    ``stream``: ``x ^ i`` over a uint32 buffer in one loop, in place: every byte read once and
    written once per iteration, one elementwise kernel (the counter stops XLA from folding it).
    ``memcpy``: a jitted ``jnp.copy`` of a non-donated buffer, which XLA compiles to one ``copy``
    (a device-to-device memcpy), dispatched ``n`` times back to back (each call is long enough
    that dispatch hides behind the previous one).
    """
    words = nbytes // 4
    x = jax.random.bits(jax.random.key(1), (words,), jnp.uint32)
    step = lambda i, c, _: c ^ i.astype(jnp.uint32)
    x, stream, _, _ = time_loop(step, x, (), n, reps)
    copy = jax.jit(jnp.copy)
    block(copy(x))
    memcpy = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(n):
            y = copy(x)
        block(y)
        memcpy.append((time.perf_counter() - start) / n)
    del x, y
    moved = 2 * words * 4
    return {
        "bytes": moved,
        "stream_gbps": moved / statistics.median(stream) / 1e9,
        "memcpy_gbps": moved / statistics.median(memcpy) / 1e9,
    }


def loop_overhead(n: int, reps: int) -> float:
    """Seconds per iteration of a loop whose body is one scalar add: included in every op time."""
    step = lambda i, c, _: c + i
    _, seconds, _, _ = time_loop(step, jnp.int32(0), (), n, reps)
    return statistics.median(seconds)


_HLO_NAMES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int8": "s8", "uint8": "u8",
              "int32": "s32", "uint32": "u32", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2"}
_INSTR = re.compile(r"%([\w.\-]+) = (\w+\[[\d,]*\])(?:\{[^}]*\})? ([\w\-]+)\((.*)")
_PLUMBING = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
             "opt-barrier", "call"}  # call: a command buffer (what it runs is checked too)


def hlo_type(x) -> str:
    return f"{_HLO_NAMES[np.dtype(x.dtype).name]}[{','.join(map(str, x.shape))}]"


def touches(hlo: str, x) -> list[str]:
    """Instructions of a compiled module that compute on an array of x's type (not just pass it)."""
    t = hlo_type(x)
    typed = {}
    hits = []
    for line in _plain(hlo).splitlines():
        m = _INSTR.search(line)
        if not m:
            continue
        name, ty, opcode, args = m.groups()
        typed[name] = ty
        if opcode in _PLUMBING:
            continue
        operands = re.findall(r"%([\w.\-]+)", args.split("), ")[0])
        if ty == t or any(typed.get(o) == t for o in operands):
            hits.append(opcode)
    return hits
