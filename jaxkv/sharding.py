"""Sharded caches: ``CacheSharding`` and the one mechanism every sharded op goes through.

A ``CacheSharding`` names the mesh axis that splits KV heads (tensor parallelism) and the one that
splits the batch (data parallelism). A cache created with one keeps it as static configuration.
Its methods, and the functional ops given ``sharding=``, are written once, for one device: the
``per_shard`` decorator runs that body once per device on the local shards (``jax.shard_map``),
so the kernels only ever see local buffers, nothing is gathered, and donation keeps every op in
place. The decorator learns how to split the cache from its leaves' roles (``layout.py``) and how
to split the other arguments from the roles it is given; the few things a shard sees differently
(global row and page ids become local ones, a count per shard, a global answer made of one int per
shard) are roles too, defined here. See docs/sharding.md.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _checks
from . import _validate as validate
from ._checks import check
from ._eager import compiled_when_eager
from ._shard_map import explicit, mark_varying, placed_as, shard_map
from .layout import COUNT, REPLICATED, ROWS


@dataclasses.dataclass(frozen=True)
class CacheSharding:
    """How a cache is split over a device mesh.

    **Arguments:**
    - ``mesh``: a ``jax.sharding.Mesh`` (Auto or Explicit axes).
    - ``heads``: the mesh axis that splits KV heads, or None. Changes no result.
    - ``batch``: the mesh axis that splits the batch, or None. Each batch shard is a cache of its
      own rows, with its own active batch size (and, paged, its own pages and allocator).

    Frozen and hashable: it is a static field of the cache pytrees.

    >>> mesh = jax.make_mesh((1, 1), ("dp", "tp"))
    >>> sharding = CacheSharding(mesh, heads="tp", batch="dp")
    >>> sharding.spec("batch", None, "heads") == P("dp", None, "tp")
    True
    """

    mesh: Mesh
    heads: str | None = None
    batch: str | None = None

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(
                f"CacheSharding: mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}"
            )
        names = tuple(self.mesh.axis_names)
        for role in ("heads", "batch"):
            axis = getattr(self, role)
            if axis is not None and axis not in names:
                raise ValueError(
                    f"CacheSharding: {role}={axis!r} is not an axis of the mesh {names}"
                )
        if self.heads is not None and self.heads == self.batch:
            raise ValueError(f"CacheSharding: heads and batch both name mesh axis {self.heads!r}")

    def shards(self, role: str | None) -> int:
        """Devices along the axis of ``role`` ("batch" or "heads"); 1 when it is not split."""
        axis = None if role is None else getattr(self, "batch" if role == "count" else role)
        return 1 if axis is None else self.mesh.shape[axis]

    @property
    def batch_shards(self) -> int:
        """Devices along the batch axis (1 when the batch is not split)."""
        return self.shards("batch")

    @property
    def heads_shards(self) -> int:
        """Devices along the heads axis (1 when the heads are not split)."""
        return self.shards("heads")

    def spec(self, *roles) -> P:
        """The ``PartitionSpec`` of a leaf whose dimensions play ``roles`` (``layout.py``)."""
        if tuple(roles) == COUNT:
            return P(self.batch) if self.batch else P()
        return P(*(None if r is None else getattr(self, r) for r in roles))

    def named(self, *roles) -> NamedSharding:
        """The ``NamedSharding`` of a leaf whose dimensions play ``roles``."""
        return NamedSharding(self.mesh, self.spec(*roles))

    def require_divides(self, op: str, name: str, size: int, role: str) -> None:
        """``ValueError`` naming the dimension when the axis of ``role`` does not divide it."""
        n = self.shards(role)
        if size % n:
            raise ValueError(
                f"{op}: {name} = {size} is not divisible by the {n} devices of mesh axis "
                f"{getattr(self, role)!r} ({role})"
            )

    def full(self, shape, fill, dtype, roles) -> jax.Array:
        """An array created already placed: each device fills only its shard."""
        make = jax.jit(lambda: jnp.full(shape, fill, dtype), out_shardings=self.named(*roles))
        return make()

    # Inside a per-shard body.
    def shard_index(self) -> jax.Array:
        """This device's index along the batch axis (0 when the batch is not split)."""
        if self.batch is None:
            return jnp.zeros((), jnp.int32)
        return jax.lax.axis_index(self.batch).astype(jnp.int32)

    def local_ids(self, ids: jax.Array, share: int):
        """Global ids of rows or pages -> (local ids, owned by this shard), ``share`` per shard."""
        local = ids - self.shard_index() * share
        return local, (local >= 0) & (local < share)

    def combine(self, x: jax.Array, how: str) -> jax.Array:
        """One int per batch shard -> the global answer: "sum", "max", "all" or "any"."""
        if self.batch is None:
            return x
        if how == "max":
            return jax.lax.pmax(x, self.batch)
        if how == "sum":
            return jax.lax.psum(x, self.batch)
        hits = jax.lax.psum(x.astype(jnp.int32), self.batch)
        return hits == self.batch_shards if how == "all" else hits > 0

    def from_owner(self, x: jax.Array, owned: jax.Array) -> jax.Array:
        """The batch shard where ``owned`` holds gives ``x`` to every batch shard, bit for bit
        (an all-reduce of ``x``'s size over the bits, zeros elsewhere)."""
        if self.batch is None:
            return x
        bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
        word = jax.lax.bitcast_convert_type(x, bits)
        word = jax.lax.psum(jnp.where(owned, word, jnp.zeros((), bits)), self.batch)
        return jax.lax.bitcast_convert_type(word, x.dtype)


# Trees whose leaves have roles: the caches and a saved prompt state them (``leaf_roles``).
def _has_roles(x) -> bool:
    return hasattr(type(x), "leaf_roles")


def _count_fields(tree) -> list[str]:
    return [name for name, roles in tree.leaf_roles().items() if tuple(roles) == COUNT]


def leaf_specs(tree, s: CacheSharding | None = None):
    """``tree`` (a cache, a saved prompt) with the ``PartitionSpec`` of each leaf in its place.
    A field's roles are one role tuple for all its leaves, or a dict naming the fields of a
    dataclass field (a cache's host tier) and their role tuples (None: an absent field)."""
    s = s or tree.sharding
    placed = {"sharding": s} if hasattr(tree, "sharding") else {}

    def specs(value, roles):
        if isinstance(roles, dict):
            return None if value is None else dataclasses.replace(
                value, **{n: specs(getattr(value, n), r) for n, r in roles.items()})
        return jax.tree.map(lambda _: s.spec(*roles), value)

    return dataclasses.replace(tree, **placed, **{
        name: specs(getattr(tree, name), roles) for name, roles in tree.leaf_roles().items()})


def _local(tree, s: CacheSharding):
    """A shard of a sharded cache as an ordinary cache (its per-shard counts scalars)."""
    if not hasattr(tree, "sharding"):
        return tree
    counts = {n: getattr(tree, n).reshape(()) for n in _count_fields(tree)} if s.batch else {}
    return dataclasses.replace(tree, sharding=None, **counts)


def _global(tree, s: CacheSharding):
    """A shard's cache typed back as its shard of the sharded cache."""
    if not hasattr(tree, "sharding"):
        return tree
    counts = {n: getattr(tree, n).reshape((1,)) for n in _count_fields(tree)} if s.batch else {}
    return dataclasses.replace(tree, sharding=s, **counts)


def create(cls, op: str, sharding, leaves: dict, divides: dict, **static):
    """A ``cls`` made of ``leaves`` (name -> (shape, dtype, fill), a list of them for a tuple
    field, or a function ``make(full)`` of a pytree field calling ``full(shape, dtype, fill)``
    for each of its leaves). With ``sharding`` every leaf is created already placed, after
    checking that its mesh axis divides each of ``divides`` (argument name -> (size, role))."""
    if sharding is not None and not isinstance(sharding, CacheSharding):
        raise TypeError(f"{op}: sharding must be a jaxkv.CacheSharding, got "
                        f"{type(sharding).__name__}")
    sds = lambda spec: jax.ShapeDtypeStruct(spec[0], spec[1])  # noqa: E731
    def abstract(v):
        if callable(v):
            return v(lambda shape, dtype, fill: jax.ShapeDtypeStruct(shape, dtype))
        return tuple(map(sds, v)) if isinstance(v, list) else sds(v)

    roles = cls(**{n: abstract(v) for n, v in leaves.items()}, **static).leaf_roles()
    if sharding is not None:
        for name, (size, role) in divides.items():
            sharding.require_divides(op, name, size, role)

    def make(spec, role):
        if callable(spec):
            return spec(lambda shape, dtype, fill: make((shape, dtype, fill), role))
        if isinstance(spec, list):
            return tuple(make(x, role) for x in spec)
        shape, dtype, fill = spec
        if sharding is None:
            return jnp.full(shape, fill, dtype)
        if tuple(role) == COUNT and sharding.batch:
            shape = (sharding.batch_shards,)
        return sharding.full(shape, fill, dtype, role)

    fields = {n: make(spec, roles[n]) for n, spec in leaves.items()}
    return cls(**fields, **static, sharding=sharding)


# What each argument of a sharded op is, and what a shard sees of it.
class Role:
    """An argument split by ``dims`` (a role tuple, per array leaf); a shard sees its block."""

    def __init__(self, dims=REPLICATED):
        self.dims = tuple(dims)

    def spec(self, s: CacheSharding) -> P:
        return s.spec(*self.dims)

    def validation(self, x):
        """What the checks at global shapes see of ``x``."""
        return x

    def prepare(self, s: CacheSharding, op: str, name: str, x, args: dict):
        """``x`` as the shard_map receives it; ``ValueError`` for a dimension the mesh axis does
        not divide."""
        for leaf in jax.tree.leaves(x):
            for i, role in enumerate(self.dims):
                if role is not None and _is_array(leaf):
                    whose = name + ("'" if name.endswith("s") else "'s")
                    what = f"{whose} length" if leaf.ndim == 1 else f"{whose} dimension {i}"
                    s.require_divides(op, what, leaf.shape[i], role)
        return x

    def local(self, s: CacheSharding, x, ctx: dict, args: dict):
        """What the body sees of its shard of ``x`` (``args``: the body's other arguments)."""
        return x

    def result(self, s: CacheSharding, x, ctx: dict):
        """A result of the body as the shard's part of the global result."""
        return x


class Count(Role):
    """A count per batch shard (``set_active_batch_size``): an int for every shard, an int32
    scalar, or int32 ``[batch_shards]``; each shard sees its own as a scalar. ``rows``: the
    argument that holds the rows counted."""

    def __init__(self, rows: str):
        super().__init__(COUNT)
        self.rows = rows

    def validation(self, x):
        return jax.ShapeDtypeStruct((), jnp.int32) if _is_array(x) else x

    def prepare(self, s, op, name, x, args):
        if s.batch is None:
            return x
        if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
            validate.static_int(op, name, x, 0, _rows(args[self.rows]) // s.batch_shards)
        if not _is_array(x) or x.ndim == 0:
            return jnp.full((s.batch_shards,), validate.int_scalar(op, name, x), jnp.int32)
        validate.array(op, name, x)
        validate.int32(op, name, x)
        validate.shape(op, name, x, (s.batch_shards,), "[batch_shards]")
        return x

    def local(self, s, x, ctx, args):
        return x.reshape(()) if s.batch and _is_array(x) else x


class Ids(Role):
    """Global ids of rows or pages (``share(args)``: how many a shard owns): a shard sees its own
    as local ids, another shard's as ``foreign``, an id of no shard as -1 (out of range: reported
    by the body). ``ctx["owned"]`` says which ids this shard answers for: its own, and on the
    first batch shard the ids of no shard (so that a result ``FromOwner`` is the unsharded op's
    answer to a bad id, not zeros from every shard)."""

    def __init__(self, share: Callable[[dict], int], foreign: int, dims=REPLICATED):
        super().__init__(dims)
        self.share, self.foreign = share, foreign

    def prepare(self, s, op, name, x, args):
        return super().prepare(s, op, name, jnp.asarray(x, jnp.int32), args)

    def local(self, s, x, ctx, args):
        share = self.share(args)
        local, owned = s.local_ids(x, share)
        somewhere = (x >= 0) & (x < share * s.batch_shards)
        ctx["owned"] = owned | (~somewhere & (s.shard_index() == 0))
        return jnp.where(owned, local, jnp.where(somewhere, self.foreign, -1))


class Destinations(Role):
    """A ``batch_mapping`` (split by rows, values global row ids, -1 evicts): a survivor sent to
    another batch shard's row is reported and evicted, since rows never move across shards.
    Shorter than the rows, it is padded with evictions, as the unsharded ops read it."""

    def __init__(self, rows: str):
        super().__init__(ROWS)
        self.rows = rows

    def prepare(self, s, op, name, x, args):
        extra = _rows(args[self.rows]) - x.shape[0]
        if extra > 0:
            x = jnp.concatenate([x, jnp.full((extra,), -1, jnp.int32)])
        return super().prepare(s, op, name, x, args)

    def local(self, s, x, ctx, args):
        share = _rows(args[self.rows])
        local, here = s.local_ids(x, share)
        survivor = (x >= 0) & (x < share * s.batch_shards)
        # The body sees in-range local rows only, so the range is checked here, as unsharded.
        check((x >= -1) & (x < share * s.batch_shards),
              f"{ctx['op']}: batch_mapping entries outside [-1, rows) (they count as evictions)")
        check(~survivor | here, f"{ctx['op']}: batch_mapping sends a row to another batch shard: "
              "it is evicted (compaction never moves data across shards)")
        return jnp.where(here, local, -1)


class Combined(Role):
    """A result of one int per batch shard combined into the global answer (``CacheSharding
    .combine``): the one kind of collective a sharded op makes, on metadata only."""

    def __init__(self, how: str):
        super().__init__(REPLICATED)
        self.how = how

    def result(self, s, x, ctx):
        return s.combine(x, self.how)


class FromOwner(Role):
    """A result that the shard owning the (one) id argument computed, handed to every batch
    shard; ``dims``: None for a tree that states its leaves' roles."""

    def __init__(self, dims=None):
        super().__init__(REPLICATED if dims is None else dims)
        self.derived = dims is None

    def result(self, s, x, ctx):
        return jax.tree.map(lambda leaf: s.from_owner(leaf, ctx["owned"]), x)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _rows(x) -> int:
    """Rows of a cache, of a list of layers or of an array."""
    if hasattr(x, "max_batch"):
        return x.max_batch
    return (x[0] if isinstance(x, (list, tuple)) else x).shape[0]


def rows_of(name: str) -> Callable[[dict], int]:
    """The rows of argument ``name`` (what ``Ids`` of rows count)."""
    return lambda args: _rows(args[name])


def row_ids(name: str) -> Ids:
    """Global ids of rows of argument ``name``; another shard's become ``ELSEWHERE``."""
    return Ids(rows_of(name), _checks.ELSEWHERE)


def same_shard(a: str, b: str, share: Callable[[dict], int], what: str):
    """A rule: a pair of ids ``args[a][i]``, ``args[b][i]`` owned by two batch shards is reported
    as ``what`` (each shard sees the other's id as foreign, so the pair is skipped)."""

    def rule(s: CacheSharding, op: str, args: dict):
        n = share(args)
        x, y = args[a], args[b]
        valid = (x >= 0) & (x < n * s.batch_shards) & (y >= 0) & (y < n * s.batch_shards)
        check(~valid | (x // n == y // n), f"{op}: {what}")

    return rule


# The decorator.
def per_shard(op: str | None = None, *, out=None, rule=None, defaults=None, **roles):
    """Runs the decorated method (or op) once per device when its cache is sharded (or when it is
    given ``sharding=``); otherwise calls it as it is (outside any trace, compiled whole:
    ``_eager``).

    ``roles``: argument name -> ``Role`` (or a function of the arguments returning one); a cache
    or saved prompt states its own, another array argument is replicated, anything else is
    static. ``out``: the result's role (a tuple of them for a tuple), None for a cache, or a
    function of the arguments returning that.
    ``rule(s, op, args)``: checks on the global ids, run in every shard before they are made
    local. ``defaults``: argument values a shard uses in place of None.

    The arguments are first checked at their global shapes (the body under ``jax.eval_shape``),
    so trace-time errors name global shapes.
    """

    def wrap(fn):
        sig = inspect.signature(fn)
        name = op or fn.__qualname__
        # A call's TypeError shows the names it takes, without their annotations.
        shown = sig.replace(return_annotation=sig.empty, parameters=[
            p.replace(annotation=p.empty) for p in sig.parameters.values()])

        compiled = compiled_when_eager(fn)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as e:  # inspect's message names neither the op nor its arguments
                raise TypeError(f"{name}{shown}: {e}") from None
            s = _sharding_in(bound.arguments)
            if s is None:
                return compiled(*args, **kwargs)
            bound.apply_defaults()
            return _sharded_call(fn, name, s, dict(bound.arguments), roles, out, rule,
                                 defaults or {})

        return run

    return wrap


def _sharding_in(arguments: dict):
    for x in arguments.values():
        if isinstance(x, CacheSharding):
            return x
        if _has_roles(x) and isinstance(getattr(x, "sharding", None), CacheSharding):
            return x.sharding
    return None


def _unsharded(x):
    """``x`` as the unsharded op sees it at global shapes."""
    if _has_roles(x) and hasattr(x, "sharding"):
        counts = {n: jax.ShapeDtypeStruct((), jnp.int32) for n in _count_fields(x)}
        x = dataclasses.replace(x, sharding=None, **counts)
    return x


def _eval_shape(fn, kwargs: dict):
    """``fn(**kwargs)`` traced abstractly with only the arrays as tracers (Python ints stay
    static): its trace-time checks run at global shapes, and the result's structure shows."""
    leaves, treedef = jax.tree.flatten(kwargs)
    is_arr = [_is_array(x) for x in leaves]
    # Arrays in host memory (a host tier's pool) stay there: ops check memory spaces.
    host = [a and getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host
            for x, a in zip(leaves, is_arr)]

    def call(*arrays):
        it = iter(arrays)
        placed = [jax.device_put(next(it), jax.memory.Space.Host) if h else next(it) if a else x
                  for x, a, h in zip(leaves, is_arr, host)]
        return fn(**jax.tree.unflatten(treedef, placed))

    # Unplaced: the global shapes must never meet a sharding rule.
    return jax.eval_shape(call, *[jax.ShapeDtypeStruct(x.shape, x.dtype)
                                  for x, a in zip(leaves, is_arr) if a])


def _out_specs(s, out, result):
    if isinstance(out, tuple):
        return tuple(_out_specs(s, o, r) for o, r in zip(out, result))
    if out is None or getattr(out, "derived", False):
        return leaf_specs(result, s)
    return jax.tree.map(lambda _: out.spec(s), result)


def _out_values(s, out, result, ctx):
    if isinstance(out, tuple):
        return tuple(_out_values(s, o, r, ctx) for o, r in zip(out, result))
    return _global(result, s) if out is None else out.result(s, result, ctx)


def _sharded_call(fn, op, s, args, roles, out, rule, defaults):
    args = {k: (None if isinstance(v, CacheSharding) else v) for k, v in args.items()}
    args.update({k: v for k, v in defaults.items() if args.get(k) is None})
    roles = {k: r if isinstance(r, Role) else r(args) for k, r in roles.items()}
    if callable(out) and not isinstance(out, Role):
        out = out(args)
    result = _eval_shape(fn, {k: roles[k].validation(v) if k in roles else _unsharded(v)
                              for k, v in args.items()})
    args = {k: roles[k].prepare(s, op, k, v, args) if k in roles else v for k, v in args.items()}

    def spec_of(k, v):
        if k in roles:
            return jax.tree.map(lambda _: roles[k].spec(s), v)
        return leaf_specs(v, s) if _has_roles(v) else jax.tree.map(lambda _: P(), v)

    # Operands: what holds arrays. A zero-size array stays out (as an operand of a shard_map it
    # crashes jax 0.11's XLA compiler): each shard makes its own.
    passed = [k for k, v in args.items()
              if any(_is_array(x) for x in jax.tree.leaves(v))
              and not (_is_array(v) and v.size == 0)]
    empty = {k: v for k, v in args.items() if _is_array(v) and v.size == 0}

    def body(*values):
        local = dict(args, **dict(zip(passed, values)))
        for k, v in empty.items():
            local[k] = jnp.zeros(_local_shape(s, v.shape, roles[k].dims if k in roles else ()),
                                 v.dtype)
        local = {k: _local(v, s) if _has_roles(v) else v for k, v in local.items()}
        ctx: dict[str, Any] = {"op": op}
        if rule is not None:
            rule(s, op, local)
        for k, role in roles.items():
            if local[k] is not None:
                local[k] = role.local(s, local[k], ctx, local)
        return _out_values(s, out, fn(**local), ctx)

    return run_per_shard(s, body, tuple(args[k] for k in passed),
                         tuple(spec_of(k, args[k]) for k in passed), _out_specs(s, out, result))


def _local_shape(s, shape, dims) -> tuple:
    return tuple(n // s.shards(dims[i]) if i < len(dims) else n for i, n in enumerate(shape))


def run_per_shard(sharding: CacheSharding, fn, args: tuple, in_specs: tuple, out_specs):
    """``fn(*local_args)`` once per device (``jax.shard_map`` over the whole mesh).

    ``in_specs`` / ``out_specs``: ``PartitionSpec`` prefixes of ``args`` / the result. The
    ``checkify`` checks that ``fn`` makes are evaluated per shard and reported outside the
    ``shard_map``, one global check per message (free without checkify: XLA drops them).
    """
    axes = tuple(sharding.mesh.axis_names)
    messages: list[str] = []

    def body(*local):
        with _checks.collected() as found:
            out = fn(*local)
        messages[:] = [msg for _, msg in found]
        flags = [mark_varying(jnp.reshape(pred, (1,)), axes) for pred, _ in found]
        return out, flags

    # jit: called eagerly, shard_map would run the body one primitive at a time.
    run = jax.jit(shard_map(body, mesh=sharding.mesh, in_specs=tuple(in_specs),
                            out_specs=(out_specs, P(axes))))
    if explicit(sharding.mesh):
        args = placed_as(sharding.mesh, tuple(args), tuple(in_specs))
    out, flags = run(*args)
    for flag, msg in zip(flags, messages):
        check(flag, msg)
    if not messages:  # never fails; under checkify it merges the error the shard_map left
        check(jnp.ones((), bool), "jaxkv.sharding.run_per_shard")
    return out
