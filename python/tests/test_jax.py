"""DLPack with JAX (CPU), both ways, next to numpy: JAX imports with the
legacy protocol (`__dlpack__(stream=None)`), which has no read-only flag,
so it gets a copy or, asked for explicitly, a write mapping; it exports
its immutable arrays."""

import gc

import numpy as np
import pytest

import tdrv

jax = pytest.importorskip(
    "jax", reason="no jax here: the host venv has it (scripts/setup); guest images leave it out for size"
)
jnp = jax.numpy


def _host(values):
    return tdrv.from_buffer(np.asarray(values, dtype=np.float32))


def test_jax_gets_a_copy_and_numpy_a_read_only_view():
    # JAX asks with the legacy protocol, which cannot say "read-only": it
    # gets a copy of its own, and holds no guard of the tensor.
    t = _host(np.arange(6))
    j = jnp.from_dlpack(t)
    n = np.from_dlpack(t)
    assert j.unsafe_buffer_pointer() != t.address
    assert n.ctypes.data == t.address and not n.flags.writeable
    assert j.tolist() == n.tolist() == [0, 1, 2, 3, 4, 5]
    # numpy's view excludes a writer while it lives; JAX's copy does not.
    with pytest.raises(tdrv.BusyError):
        t.write(np.zeros(6, np.float32))
    del n
    gc.collect()
    t.write(np.full(6, 7, np.float32))
    assert j.tolist() == [0, 1, 2, 3, 4, 5]
    assert jnp.from_dlpack(t).tolist() == [7.0] * 6


def test_jax_borrows_a_write_mapping_without_a_copy():
    t = _host([1, 2, 3])
    j = jnp.from_dlpack(t.map_write())
    assert j.unsafe_buffer_pointer() == t.address
    with pytest.raises(tdrv.BusyError):
        t.read()
    del t
    gc.collect()
    # The capsule's mapping keeps the storage: the bytes are intact.
    assert (j * 2).tolist() == [2.0, 4.0, 6.0]


def test_tdrv_imports_a_jax_array():
    x = jnp.arange(4, dtype=jnp.float32) + 1
    u = tdrv.from_dlpack(x)
    assert u.shape == (4,) and u.dtype == "float32"
    assert np.frombuffer(u.read(), np.float32).tolist() == [1, 2, 3, 4]
    if u.kind == "user":
        # Zero-copy: the tensor borrows JAX's buffer and keeps it alive.
        assert u.address == x.unsafe_buffer_pointer()
        del x
        gc.collect()
        assert np.frombuffer(u.read(), np.float32).tolist() == [1, 2, 3, 4]
    else:
        # JAX flagged its (immutable) buffer read-only: tdrv tensors are
        # writable, so it was copied.
        assert u.kind == "malloc"
