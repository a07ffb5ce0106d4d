"""The few JAX SPMD entry points jaxkv uses, across JAX versions (0.10: ``jax.shard_map`` with
``check_vma``, varying axes in ``aval.mat.varying``; older: ``jax.experimental.shard_map`` with
``check_rep``; ``lax.pcast(..., to="varying")`` or, before it, ``lax.pvary``)."""

from __future__ import annotations

import jax


def shard_map(f, *, mesh, in_specs, out_specs):
    """``f`` run once per device on its shards, with the varying-axes check on."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)
    from jax.experimental.shard_map import shard_map as legacy  # jax < 0.7

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=True)


def varying_axes(x) -> frozenset:
    """Mesh axes along which ``x`` differs between shards (empty outside ``shard_map``)."""
    aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)  # type: ignore[attr-defined]
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(vma or ())


def mark_varying(x, axes):
    """``x`` typed as varying along ``axes`` (a no-op for the axes it already varies along)."""
    have = varying_axes(x)
    missing = tuple(a for a in axes if a not in have)
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def explicit(mesh) -> bool:
    """Some axis of ``mesh`` is Explicit (shard_map then wants its inputs placed as specified)."""
    types = getattr(mesh, "axis_types", None) or ()
    return any("Explicit" in str(t) for t in types)


def placed_as(mesh, args, specs):
    """``args`` resharded to ``specs`` (a prefix of them): a no-op for what already matches."""
    from jax.sharding import NamedSharding, PartitionSpec

    def leaf(spec, sub):
        return jax.tree.map(lambda x: jax.sharding.reshard(x, NamedSharding(mesh, spec)), sub)

    return jax.tree.map(leaf, specs, args, is_leaf=lambda x: isinstance(x, PartitionSpec))
