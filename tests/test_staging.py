"""Unit tests of flagos_shm.staging (single process, no shared memory involved)."""

import pytest
import torch

from flagos_shm import staging


def _write_through(buf, values):
    """Write ``values`` into the buffer the way the core would (through the raw flat view)."""
    buf.flat.copy_(values)
    buf.finish()


def test_contiguous_tensor_is_used_in_place_at_any_offset():
    base = torch.arange(10, dtype=torch.float32)
    t = base[3:8]
    buf = staging.stage(t, "t", write=True)
    assert buf.ptr == t.data_ptr() == base.data_ptr() + 3 * 4
    assert (buf.numel, buf.nbytes, buf.dtype) == (5, 20, "float32")
    _write_through(buf, torch.full((5,), -1.0))
    assert torch.equal(base, torch.tensor([0, 1, 2, -1, -1, -1, -1, -1, 8, 9], dtype=torch.float32))


@pytest.mark.parametrize("read", [True, False])
def test_non_contiguous_tensor_goes_through_a_copy_and_back(read):
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()  # shape (4, 3), strided
    before = t.clone()
    buf = staging.stage(t, "t", read=read, write=True)
    assert buf.ptr != t.data_ptr() and buf.numel == 12
    if read:
        assert torch.equal(buf.flat, before.reshape(-1))
    new = torch.arange(100, 112, dtype=torch.int64)
    _write_through(buf, new)
    assert torch.equal(t, new.reshape(4, 3))


def test_input_only_copy_is_not_written_back():
    t = torch.arange(6.0)[::2]
    buf = staging.stage(t, "t", read=True, write=False)
    _write_through(buf, torch.zeros(3))
    assert torch.equal(t, torch.tensor([0.0, 2.0, 4.0]))


def test_complex_is_viewed_as_real_pairs():
    t = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    buf = staging.stage(t, "t", write=True)
    assert (buf.numel, buf.dtype, buf.torch_dtype) == (4, "float32", torch.complex64)
    assert torch.equal(buf.flat, torch.tensor([1.0, 2.0, 3.0, -4.0]))
    nc = torch.zeros(2, 2, dtype=torch.complex128).t()[0]  # strided complex
    buf = staging.stage(nc, "nc", read=False, write=True)
    _write_through(buf, torch.tensor([5.0, 6.0, 7.0, 8.0], dtype=torch.float64))
    assert torch.equal(nc, torch.tensor([5 + 6j, 7 + 8j], dtype=torch.complex128))


def test_conjugate_view_is_resolved_and_written_back():
    base = torch.tensor([1 + 1j, 2 - 3j])
    view = base.conj()
    buf = staging.stage(view, "view", write=True)
    assert torch.equal(buf.flat, torch.tensor([1.0, -1.0, 2.0, 3.0]))
    _write_through(buf, torch.tensor([4.0, 5.0, 6.0, 7.0]))
    assert torch.equal(view.resolve_conj(), torch.tensor([4 + 5j, 6 + 7j]))
    assert torch.equal(base, torch.tensor([4 - 5j, 6 - 7j]))


def test_empty_and_zero_dim_tensors():
    assert staging.stage(torch.empty(0, 3), "e").numel == 0
    assert staging.stage(torch.tensor(2.5), "s").numel == 1


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.float8_e4m3fn])
def test_unsupported_dtype_raises_type_error(dtype):
    with pytest.raises(TypeError, match=r"^x: dtype .* is not supported"):
        staging.stage(torch.zeros(2, dtype=dtype), "x")


def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match=r"^out\[1\]: tensor is on the meta device"):
        staging.stage(torch.zeros(2, device="meta"), "out[1]")
    with pytest.raises(TypeError, match=r"^t: expected a torch.Tensor, got list"):
        staging.stage([1.0], "t")
    with pytest.raises(TypeError, match=r"^t: expected a dense"):
        staging.stage(torch.zeros(2).to_sparse(), "t")
    with pytest.raises(ValueError, match=r"^t: output tensor has overlapping elements"):
        staging.stage(torch.zeros(1).expand(3), "t", write=True)
    staging.stage(torch.zeros(1).expand(3), "t", write=False)  # reading an expanded tensor is fine


def test_pack_pads_blocks_and_unpack_inverts_it():
    parts = [torch.tensor([1, 2], dtype=torch.int32), torch.tensor([], dtype=torch.int32),
             torch.tensor([[3, 4], [5, 6]], dtype=torch.int32).t()]
    buf = staging.pack(parts, 4)
    assert buf.numel == 12 and buf.dtype == "int32"
    assert buf.flat[0:2].tolist() == [1, 2] and buf.flat[8:12].tolist() == [3, 5, 4, 6]
    outs = [torch.zeros(2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32)]
    staging.unpack(buf, outs, 4)
    assert outs[0].tolist() == [1, 2] and torch.equal(outs[2], parts[2])


def test_overlap_detection():
    base = torch.zeros(10)
    a = staging.stage(base[0:5], "a")
    assert a.overlaps(staging.stage(base[4:6], "b"))
    assert not a.overlaps(staging.stage(base[5:10], "c"))
    assert not a.overlaps(staging.stage(base[2:2], "empty"))


def test_pinned_pool_release_under_its_own_lock_does_not_deadlock():
    """``release`` runs from ``HostBuffer.__del__``, hence from the garbage collector at any
    allocation, also inside ``acquire`` on a thread that holds the pool's lock: it must not
    wait for that lock (it used to: the rank hung in test_alltoallv_coalesced), and the
    buffer must still come back for reuse."""
    import threading

    pool = staging.PinnedPool(1 << 20)
    buf = torch.zeros(staging.PinnedPool.MIN_BYTES, dtype=torch.uint8)  # plain memory is enough here

    def give_back_while_holding_the_lock() -> None:
        with pool._lock:
            pool.release(buf)
    t = threading.Thread(target=give_back_while_holding_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "release() waited for the lock its own thread holds"
    assert pool.idle_bytes == buf.numel()
    assert pool.acquire(16) is buf and pool.idle_bytes == 0


def test_pinned_pool_keeps_at_most_its_limit_smallest_freed_first():
    pool = staging.PinnedPool(3 << 16)
    bufs = [torch.zeros(k << 16, dtype=torch.uint8) for k in (1, 2, 1)]
    for b in bufs:
        pool.release(b)
    assert pool.idle_bytes == 3 << 16  # the first 64 KiB one went: over the limit, smallest first
    assert pool.acquire(1 << 17) is bufs[1] and pool.acquire(1) is bufs[2]


@pytest.fixture
def torch_copies():
    """Records the element count of every ``Tensor.copy_`` of a CPU tensor while active."""
    seen = []
    real = torch.Tensor.copy_

    def counting(self, src, *args, **kwargs):
        if self.is_cpu:
            seen.append(self.numel())
        return real(self, src, *args, **kwargs)
    torch.Tensor.copy_ = counting
    try:
        yield seen
    finally:
        torch.Tensor.copy_ = real


def test_copy_into_copies_large_contiguous_tensors_itself(torch_copies):
    """From torch's parallel grain (32768 elements) on, contiguous CPU pairs are copied by
    the core (``_core.copy_bytes``), not by torch's intra-op thread pool; the values match
    torch's own copy, also between different shapes of one element count."""
    n = staging._TORCH_GRAIN
    for dtype in (torch.float32, torch.float64, torch.int8, torch.bfloat16):
        src = (torch.arange(n + 3) % 251).to(dtype).reshape(-1, 1)
        dst = torch.zeros(n + 3, dtype=dtype)
        staging.copy_into(dst, src)
        assert torch.equal(dst, src.reshape(-1)), dtype
    assert torch_copies == []
    with pytest.raises(ValueError, match="dst has"):
        staging.copy_into(torch.zeros(n), torch.zeros(n + 1))


def test_copy_into_leaves_other_cases_to_torch(torch_copies):
    """Small tensors (torch copies them on the calling thread), strided ones and lazily
    negated ones still go through ``copy_``, with correct values."""
    n = staging._TORCH_GRAIN
    small = torch.zeros(5)
    staging.copy_into(small, torch.arange(5.0))
    strided = torch.zeros(2 * n)[::2]
    staging.copy_into(strided, torch.arange(float(n)))
    neg = torch.zeros(n)
    staging.copy_into(neg, torch.arange(float(n))._neg_view())
    assert torch_copies == [5, n, n]
    assert small.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(strided, torch.arange(float(n)))
    assert torch.equal(neg, -torch.arange(float(n)))


def test_copy_bytes_checks_its_addresses():
    from flagos_shm import _core

    src = torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="dst: null"):
        _core.copy_bytes(0, src.data_ptr(), 16)
    with pytest.raises(ValueError, match="src: .* wrap around"):
        _core.copy_bytes(src.data_ptr(), 2**64 - 8, 16)
    _core.copy_bytes(0, 0, 0)  # nothing to copy: nothing checked beyond the range
    buf = torch.arange(8, dtype=torch.int32)
    _core.copy_bytes(buf.data_ptr() + 4, buf.data_ptr(), 16)  # overlapping ranges: a memmove
    assert buf.tolist() == [0, 0, 1, 2, 3, 5, 6, 7]
