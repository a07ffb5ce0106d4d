"""Sharded caches: ``CacheSharding`` and the one mechanism every sharded op goes through.

A ``CacheSharding`` names the mesh axis that splits KV heads (tensor parallelism) and the one that
splits the batch (data parallelism). A cache created with one keeps it as static configuration;
each of its methods then runs its ordinary, unsharded body once per device on the local shards,
through ``per_shard`` (``jax.shard_map``): the kernels only ever see local buffers, nothing is
gathered, and donation keeps every op in place. See docs/sharding.md for what each op means per
shard and which ops use a (small, metadata-only) collective.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _checks
from ._checks import check
from ._shard_map import explicit, mark_varying, placed_as, shard_map

# Where the split dimensions sit in each leaf: "batch", "heads" or None (not split).
LINEAR_BUFFER = (None, "batch", None, "heads", None, None)  # [L, B, 2, H, S, D]
LAYER = ("batch", None, "heads", None, None)  # [B, 2, H, S, D]
ROWS = ("batch",)  # [B] and [B, ...]: lengths, mappings, page tables, counts per shard
KV = ("batch", "heads", None, None)  # new tokens [B, H, T, D]
KV_LAYERS = (None, "batch", "heads", None, None)  # new tokens of every layer [L, B, H, T, D]
SAVED = (None, "heads", None, None)  # a saved prompt's layer [2, H, T, D]
POOL = {  # pages split by batch (each shard owns a share), heads by heads
    "HND": (None, "heads", "batch", None, None),  # [L, H, P, S, D]
    "NHD": (None, "batch", None, "heads", None),  # [L, P, S, H, D]
}
REPLICATED = ()


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
    >>> sharding.spec(*LAYER) == P("dp", None, "tp", None, None)  # a layer [B, 2, H, S, D]
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

    def shards(self, role: str) -> int:
        """Devices along the axis of ``role`` ("batch" or "heads"); 1 when it is not split."""
        axis = getattr(self, role)
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
        """The ``PartitionSpec`` of a leaf whose dimensions play ``roles``."""
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

    # Inside ``per_shard``.
    def shard_index(self) -> jax.Array:
        """This device's index along the batch axis (0 when the batch is not split)."""
        if self.batch is None:
            return jnp.zeros((), jnp.int32)
        return jax.lax.axis_index(self.batch).astype(jnp.int32)

    def local_rows(self, rows: jax.Array, local_count: int):
        """Global row ids -> (local ids, owned): a row of another shard gets ``local_count``,
        which the kernels skip."""
        local = rows - self.shard_index() * local_count
        owned = (local >= 0) & (local < local_count)
        return jnp.where(owned, local, local_count), owned

    def psum_batch(self, x: jax.Array) -> jax.Array:
        """Sum over the batch shards: the metadata collective of the ops that need a global
        answer (an int32 per shard)."""
        return x if self.batch is None else jax.lax.psum(x, self.batch)

    def from_owner(self, x: jax.Array, owned: jax.Array) -> jax.Array:
        """The batch shard where ``owned`` holds gives ``x`` to every batch shard, bit for bit
        (an all-reduce of ``x``'s size over the bits, zeros elsewhere)."""
        if self.batch is None:
            return x
        bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
        word = jax.lax.bitcast_convert_type(x, bits)
        word = jax.lax.psum(jnp.where(owned, word, jnp.zeros((), bits)), self.batch)
        return jax.lax.bitcast_convert_type(word, x.dtype)


def per_shard(sharding: CacheSharding, fn, args: tuple, in_specs: tuple, out_specs):
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
        check(jnp.ones((), bool), "jaxkv.sharding.per_shard")
    return out


def abstract(tree):
    """``tree`` with every array replaced by an unplaced ``ShapeDtypeStruct``: validating an
    op's arguments at their global shapes (``jax.eval_shape``) never meets a sharding rule."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, tree
    )
