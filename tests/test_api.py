"""The package's face: what it exports, its docstrings and their examples, its metadata."""

import doctest
import importlib
import importlib.metadata
import inspect
import pathlib

import pytest

import jaxkv

PUBLIC_MODULES = ["jaxkv.linear", "jaxkv.manager", "jaxkv.paged", "jaxkv.ops", "jaxkv.paged_ops",
                  "jaxkv.reuse", "jaxkv.reference", "jaxkv.attention", "jaxkv.sharding"]


def public_names():
    return [name for name in jaxkv.__all__
            if any(test(getattr(jaxkv, name))
                   for test in (inspect.isclass, inspect.isfunction, inspect.ismodule))]


def test_all_lists_every_export_and_dir_shows_no_private_module():
    assert sorted(set(jaxkv.__all__)) == sorted(jaxkv.__all__)
    for name in jaxkv.__all__:
        assert hasattr(jaxkv, name), name
    assert not [n for n in dir(jaxkv) if n.startswith("_") and n != "__version__"]


def test_the_package_is_typed():
    assert (pathlib.Path(jaxkv.__file__).parent / "py.typed").is_file()


@pytest.mark.parametrize("name", public_names())
def test_every_public_name_and_method_has_a_docstring(name):
    obj = getattr(jaxkv, name)
    assert inspect.getdoc(obj), name
    if inspect.isclass(obj):
        for attr, member in vars(obj).items():
            if attr.startswith("_"):
                continue
            func = member.__func__ if isinstance(member, classmethod) else member
            if inspect.isfunction(func) or isinstance(func, property):
                assert inspect.getdoc(func), f"{name}.{attr} has no docstring"


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_docstring_examples_run(module):
    """Every ``>>>`` example in the public modules runs and prints what it shows."""
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module} shows no example"
    assert result.failed == 0


def test_package_metadata_is_complete():
    meta = importlib.metadata.metadata("jaxkv")
    assert meta["Summary"] and meta["Requires-Python"] and meta["Author"]
    assert "Typing :: Typed" in meta.get_all("Classifier")
    assert any(r.startswith("jax") for r in meta.get_all("Requires-Dist"))


def test_a_static_layer_index_out_of_range_is_a_trace_time_error_everywhere():
    import jax.numpy as jnp

    linear = jaxkv.LinearKVCache.create(2, 2, 1, 8, 4, dtype=jnp.float32)
    k = jnp.ones((2, 1, 1, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"LinearKVCache.append: layer_idx must be in \[0, 1\], got 5"):
        linear.append(5, k, k)
    manager = jaxkv.KVCacheManager.create([jaxkv.KVLayerConfig(1, 4)] * 2, 2, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"KVCacheManager.append: layer_idx must be in \[0, 1\]"):
        manager.append(5, k, k)
    paged = jaxkv.PagedKVCache.create(2, 4, 4, 1, 4, 2, 2, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"PagedKVCache.append: layer_idx must be in \[0, 1\], got -1"):
        paged.append(-1, k, k)
    with pytest.raises(ValueError, match=r"PagedKVCache.gather: layer_idx must be in \[0, 1\], got 2"):
        paged.gather(2, 4)
    for accessor in (linear.layer, linear.keys, linear.values):
        with pytest.raises(ValueError, match=r"LinearKVCache.\w+: layer_idx must be in \[0, 1\], got 5"):
            accessor(5)
    with pytest.raises(ValueError, match=r"PagedKVCache.cache_length: b must be in \[0, 1\], got 9"):
        paged.cache_length(9)


def test_a_traced_accessor_index_out_of_range_is_reported():
    import jax
    import jax.numpy as jnp
    from jax.experimental import checkify

    linear = jaxkv.LinearKVCache.create(2, 2, 1, 8, 4, dtype=jnp.float32)
    paged = jaxkv.PagedKVCache.create(2, 4, 4, 1, 4, 2, 2, dtype=jnp.float32)
    for fn, bad, good, what in ((linear.keys, 2, 1, "LinearKVCache.keys: layer_idx"),
                                (paged.cache_length, -1, 0, "PagedKVCache.cache_length: b")):
        checked = checkify.checkify(jax.jit(fn))
        err, _ = checked(jnp.int32(bad))
        assert what in str(err.get())
        err, _ = checked(jnp.int32(good))
        assert err.get() is None
    with pytest.raises(TypeError, match="PagedKVCache.gather: max_len must be a Python int"):
        paged.gather(0, 4.0)
    with pytest.raises(TypeError, match="PagedKVCache.copy_pages: src_pages must be int32"):
        paged.copy_pages(jnp.zeros((2,), jnp.float32), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"PagedKVCache.copy_pages: src_pages \(2,\) and dst_pages"):
        paged.copy_pages(jnp.zeros((2,), jnp.int32), jnp.zeros((3,), jnp.int32))


def test_commit_names_what_it_accepts():
    import jax.numpy as jnp

    linear = jaxkv.LinearKVCache.create(2, 2, 1, 8, 4, dtype=jnp.float32)
    with pytest.raises(TypeError, match="new_lengths must be an int or an int32 array, got float"):
        linear.commit(1.5)
    paged = jaxkv.PagedKVCache.create(2, 4, 4, 1, 4, 2, 2, dtype=jnp.float32)
    with pytest.raises(TypeError, match="num_new_tokens must be an int or an int32 array"):
        paged.commit(1.5)
    with pytest.raises(ValueError, match=r"PagedKVCache.commit: num_new_tokens must have shape"):
        paged.commit(jnp.ones((3,), jnp.int32))


def test_commit_takes_an_int32_scalar_for_every_row():
    import jax
    import jax.numpy as jnp
    import numpy as np

    linear = jaxkv.LinearKVCache.create(2, 3, 1, 8, 4, dtype=jnp.float32)
    linear = linear.reset(jnp.zeros((2,), jnp.int32))
    step = jax.jit(lambda c, n: c.commit(n))  # n traced: one compile for every count
    assert step(linear, jnp.int32(3)).lengths.tolist() == [3, 3, 0]
    assert step(linear, jnp.int32(2)).lengths.tolist() == [2, 2, 0]
    manager = jaxkv.KVCacheManager.from_linear(linear)
    assert manager.commit(jnp.int32(4)).lengths.tolist() == [4, 4, 0]
    paged = jaxkv.PagedKVCache.create(2, 4, 4, 1, 4, 3, 2, dtype=jnp.float32)
    paged, _ = paged.reserve(jnp.asarray([4, 8, 0], jnp.int32))
    assert paged.commit(jnp.int32(5)).lengths.tolist() == [4, 5, 0]  # stops at its pages
    total = jaxkv.increment_lengths(jnp.asarray([1, 2], jnp.int32), np.int32(3))
    assert total.tolist() == [4, 5]


def test_a_misspelt_argument_names_the_op_and_its_arguments():
    import jax.numpy as jnp

    paged = jaxkv.PagedKVCache.create(2, 4, 4, 1, 4, 2, 2, dtype=jnp.float32)
    with pytest.raises(TypeError, match=r"PagedKVCache.gather\(self, layer_idx, max_len, \*, "
                       r"split=False, dtype=None\): got an unexpected keyword argument 'splt'"):
        paged.gather(0, 4, splt=True)
    with pytest.raises(TypeError, match=r"PagedKVCache.commit\(self, num_new_tokens.*missing"):
        paged.commit(new_lengths=1)
    q = jnp.ones((2, 4, 4), jnp.float32)
    with pytest.raises(TypeError, match=r"attention.decode\(q, cache.*'kv_length'"):
        jaxkv.attention.decode(q, paged, 0, kv_length=paged.lengths)


def test_an_append_names_new_lengths_of_the_wrong_shape():
    import jax.numpy as jnp

    paged = jaxkv.PagedKVCache.create(2, 4, 4, 1, 4, 2, 2, dtype=jnp.float32)
    k = jnp.ones((2, 1, 3, 4), jnp.float32)
    for append in (lambda n: paged.append(0, k, k, n),
                   lambda n: paged.append_layers(k[None].repeat(2, 0), k[None].repeat(2, 0), n)):
        with pytest.raises(ValueError, match=r"PagedKVCache.append(_layers)?: new_lengths must "
                           r"have shape \(2,\)"):
            append(jnp.ones((3,), jnp.int32))
