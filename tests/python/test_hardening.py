"""Misuse from Python: buffer lifetimes, freed pinned buffers, foreign handles, hostile
arrays and one swapper shared by threads."""

import _thread
import errno
import gc
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest
import torch
import torch.utils.dlpack

import tensormem
from tensormem.torch import ContiguousMemoryAllocator


# ----------------------------------------------------------------------------- swapper buffers

def test_swap_in_keeps_a_temporary_buffer_alive_until_wait(tmp_path):
    pool = tensormem.PinnedPool(slab_bytes=8 << 20)
    s = tensormem.TensorSwapper(pool, staging_buffers=2)
    data = np.arange(1 << 18, dtype=np.float64)
    path = str(tmp_path / "t")
    assert s.wait(s.swap_out([data], [path]))[0]["error"] == 0
    # The only reference to the target is the swapper's: it must hold it until wait().
    ticket = s.swap_in([path], [np.empty(data.size)])
    gc.collect()
    junk = [np.full(data.size, 7.0) for _ in range(8)]  # would reuse freed memory
    assert s.wait(ticket)[0]["error"] == 0
    assert all(np.all(j == 7.0) for j in junk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
def test_cpu_torch_tensors_of_any_dtype_round_trip(tmp_path, dtype):
    pool = tensormem.PinnedPool(slab_bytes=8 << 20)
    s = tensormem.TensorSwapper(pool, staging_buffers=2)
    source = (torch.arange(30_001) % 101).to(dtype).reshape(1, 30_001)
    weights = torch.nn.Parameter(source.clone().float()) if dtype == torch.float32 else source
    path = str(tmp_path / "t")
    assert s.wait(s.swap_out([weights], [path]))[0] == {"path": path, "bytes": weights.numel() *
                                                         weights.element_size(), "error": 0, "message": ""}
    # The only reference to the target is the swapper's: it is held until wait().
    target = torch.empty_like(weights.detach())
    alive = weakref.ref(target)
    ticket = s.swap_in([path], [target])
    del target
    gc.collect()
    assert alive() is not None
    assert s.wait(ticket)[0]["error"] == 0
    gc.collect()
    assert alive() is None
    back = torch.empty_like(weights.detach())
    assert s.wait(s.swap_in([path], [back]))[0]["error"] == 0
    assert torch.equal(back, weights.detach())


def test_what_is_neither_a_buffer_nor_a_cpu_tensor_is_refused(tmp_path):
    pool = tensormem.PinnedPool(slab_bytes=8 << 20)
    s = tensormem.TensorSwapper(pool, staging_buffers=2)
    path = str(tmp_path / "t")
    with pytest.raises(TypeError, match="a tensor must be a buffer .* or a CPU torch tensor, not int"):
        s.swap_out([5], [path])
    with pytest.raises(ValueError, match="tensor is not contiguous"):
        s.swap_out([torch.zeros(8, 8).t()], [path])
    with pytest.raises(ValueError, match="tensor on meta"):
        s.swap_out([torch.zeros(8, device="meta")], [path])
    # An object that answers only some of a tensor's questions is no tensor: refused by type,
    # before any of its answers is used.
    answers = {"data_ptr": lambda: 0, "element_size": lambda: 4, "numel": lambda: 1, "device": "cpu",
               "is_contiguous": lambda: True}
    for missing in answers:
        partial = type("Partial", (), {k: staticmethod(v) if callable(v) else v
                                       for k, v in answers.items() if k != missing})()
        with pytest.raises(TypeError, match="a tensor must be a buffer .* or a CPU torch tensor, not Partial"):
            s.swap_out([partial], [path])
    assert list(tmp_path.iterdir()) == []  # nothing queued


def test_a_held_buffer_cannot_be_resized_until_wait(tmp_path):
    pool = tensormem.PinnedPool(slab_bytes=8 << 20)
    s = tensormem.TensorSwapper(pool, staging_buffers=2)
    target = bytearray(1 << 20)
    path = str(tmp_path / "t")
    assert s.wait(s.swap_out([bytes(range(256)) * 4096], [path]))[0]["error"] == 0
    ticket = s.swap_in([path], [target])
    with pytest.raises(BufferError):
        target.extend(b"x")  # the view held by the ticket forbids it
    assert s.wait(ticket)[0]["error"] == 0
    target.extend(b"x")  # released by wait()
    assert target[:256] == bytes(range(256))


def test_unknown_engine_is_refused_by_every_entry_point(tmp_path):
    from tensormem import _tensormem
    from tensormem.offload import OffloadedAdam

    assert tensormem.IO_ENGINES == ("uring", "threads")
    pool = tensormem.PinnedPool(slab_bytes=1 << 20)
    message = "engine must be 'uring' or 'threads', not 'bogus'"
    with pytest.raises(ValueError, match=message):
        tensormem.TensorSwapper(pool, engine="bogus")
    with pytest.raises(ValueError, match=message):
        _tensormem.AsyncFileIO(engine="bogus")
    with pytest.raises(ValueError, match=message):
        _tensormem.OffloadedOptimizer([16], swap_dirs=[str(tmp_path)], engine="bogus")
    with pytest.raises(ValueError, match=message):
        OffloadedAdam([torch.nn.Parameter(torch.zeros(16))], swap_dirs=[str(tmp_path)], engine="bogus")
    for engine in tensormem.IO_ENGINES:  # and every name it lists is taken
        tensormem.TensorSwapper(pool, engine=engine)
        _tensormem.AsyncFileIO(engine=engine)
    assert list(tmp_path.iterdir()) == []


def test_one_swapper_shared_by_four_threads(tmp_path):
    pool = tensormem.PinnedPool(slab_bytes=16 << 20)
    s = tensormem.TensorSwapper(pool, queue_depth=4, staging_buffers=2)
    errors = []

    def work(k):
        try:
            for r in range(15):
                a = np.random.default_rng(k * 100 + r).integers(0, 255, 300_000 + k, dtype=np.uint8)
                p = str(tmp_path / f"t{k}-{r % 2}")
                assert s.wait(s.swap_out([a], [p]))[0]["error"] == 0
                b = np.zeros_like(a)
                assert s.wait(s.swap_in([p], [b]))[0]["error"] == 0
                assert np.array_equal(a, b)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert errors == []
    assert s.stats()["tensors_out"] == 60


def test_same_path_twice_in_one_batch_is_refused(tmp_path):
    pool = tensormem.PinnedPool(slab_bytes=4 << 20)
    s = tensormem.TensorSwapper(pool, staging_buffers=2)
    a = np.ones(1000)
    with pytest.raises(ValueError, match="appears twice"):
        s.swap_out([a, a], [str(tmp_path / "p"), str(tmp_path / "p")])


@pytest.mark.parametrize("make", [
    lambda: np.array([object(), object()]),
    lambda: np.zeros(2, dtype=[("O", "<i8"), ("b", "O")]),  # an object field named after a real one
    lambda: np.zeros((2,), dtype=("O", (2,))),
])
def test_buffers_of_python_objects_are_refused_both_ways(tmp_path, make):
    pool = tensormem.PinnedPool(slab_bytes=4 << 20)
    s = tensormem.TensorSwapper(pool, staging_buffers=2)
    path = str(tmp_path / "o")
    with pytest.raises(TypeError, match="Python objects"):
        s.swap_out([make()], [path])
    assert not os.path.exists(path)
    # A file of 16 bytes read into object pointers would crash the interpreter.
    assert s.wait(s.swap_out([np.full(2, 12345678, dtype=np.int64)], [path]))[0]["error"] == 0
    target = make()
    before = [repr(v) for v in target.flat]  # object addresses: unchanged if untouched
    with pytest.raises(TypeError, match="Python objects"):
        s.swap_in([path], [target])
    assert [repr(v) for v in target.flat] == before
    # Fields named with an O hold no objects: they swap.
    plain = np.zeros(2, dtype=[("O", "<i8"), ("OO", "<f8")])
    plain["O"] = [3, 4]
    assert s.wait(s.swap_out([plain], [path]))[0]["error"] == 0
    back = np.zeros_like(plain)
    assert s.wait(s.swap_in([path], [back]))[0]["error"] == 0
    assert back.tobytes() == plain.tobytes()


def test_memory_a_swap_in_writes_is_in_no_other_unwaited_transfer(tmp_path):
    pool = tensormem.PinnedPool(slab_bytes=8 << 20)
    s = tensormem.TensorSwapper(pool, staging_buffers=2, checksums=False)
    p1, p2, p3 = (str(tmp_path / n) for n in ("1", "2", "3"))
    s.wait(s.swap_out([np.ones(1 << 16), np.full(1 << 16, 2.0)], [p1, p2]))
    x = np.zeros(3 << 15)
    # Overlapping views: with checksums off both reads used to report success, one lost.
    with pytest.raises(ValueError, match=r"tensors for .*1 and .*2 overlap in memory"):
        s.swap_in([p1, p2], [x[:1 << 16], x[1 << 15:]])
    y = np.zeros(1 << 16)
    t = torch.zeros(1 << 16, dtype=torch.float64)
    ticket = s.swap_in([p1], [y])
    # The refusal names the transfer that holds the memory: its path and ticket.
    with pytest.raises(ValueError, match=r"overlaps a swap-in not yet waited for \(the tensor for .*1, ticket %d: "
                                         r"wait\(%d\) or synchronize\(\) collects it\)$" % (ticket, ticket)):
        s.swap_out([y[100:200]], [p3])
    out = s.swap_out([t], [p3])
    with pytest.raises(ValueError, match=r"overlaps a swap-out not yet waited for \(the tensor for .*3, ticket %d: "
                                         % out):
        s.swap_in([p2], [t[5:]])
    assert s.wait(ticket)[0]["error"] == 0 and s.wait(out)[0]["error"] == 0
    assert np.all(y == 1.0)
    assert s.wait(s.swap_in([p2], [t]))[0]["error"] == 0
    assert torch.all(t == 2.0)


# ----------------------------------------------------------------------------- pinned buffers

def test_freed_pinned_buffer_raises_instead_of_aborting():
    pool = tensormem.PinnedPool(slab_bytes=1 << 20)
    buf = pool.allocate(4096)
    assert buf.nbytes == 4096 and not buf.freed
    buf.free()
    assert buf.freed and buf.nbytes == 0
    with pytest.raises(BufferError, match="already freed"):
        buf.free()  # a double free is refused, and gives back nothing the pool handed out again
    with pytest.raises(BufferError, match="no address"):
        buf.address
    with pytest.raises(BufferError):
        np.frombuffer(buf, dtype=np.uint8)
    with pytest.raises(BufferError):
        memoryview(buf)
    with pytest.raises(BufferError):
        bytes(buf)
    with pytest.raises(BufferError):
        torch.utils.dlpack.from_dlpack(buf)


def test_free_with_live_views_raises_and_never_aliases():
    pool = tensormem.PinnedPool(slab_bytes=1 << 20)
    buf = pool.allocate(4096)
    view = np.frombuffer(buf, dtype=np.uint8)
    view[:] = 1
    assert buf.exports == 1
    with pytest.raises(BufferError, match="view"):
        buf.free()
    other = pool.allocate(4096)  # must not be the memory the view still sees
    np.frombuffer(other, dtype=np.uint8)[:] = 2
    assert np.all(view == 1)
    del view
    gc.collect()
    assert buf.exports == 0
    buf.free()
    t = torch.utils.dlpack.from_dlpack(other)
    with pytest.raises(BufferError):
        other.free()
    del t
    gc.collect()
    other.free()


def test_a_freed_buffer_dying_later_leaves_its_memory_alone_when_handed_out_again():
    pool = tensormem.PinnedPool(slab_bytes=1 << 20)
    first = pool.allocate(4096)
    address = first.address
    first.free()
    second = pool.allocate(4096)
    assert second.address == address  # the same bytes, handed out again
    del first
    gc.collect()
    assert pool.stats()["in_use_bytes"] == 4096
    third = pool.allocate(4096)
    assert third.address != second.address
    assert pool.stats()["in_use_bytes"] == 8192


def test_a_dlpack_capsule_dropped_unconsumed_gives_its_export_back():
    pool = tensormem.PinnedPool(slab_bytes=1 << 20)
    buf = pool.allocate(4096)
    capsule = buf.__dlpack__()  # taken by no consumer
    assert buf.exports == 1
    with pytest.raises(BufferError, match="view"):
        buf.free()
    del capsule
    gc.collect()
    assert buf.exports == 0
    buf.free()
    assert buf.freed


# ----------------------------------------------------------------------------- foreign handles

def test_tlsf_allocator_refuses_another_allocators_handle():
    a = tensormem.TlsfAllocator(1 << 20)
    b = tensormem.TlsfAllocator(1 << 20)
    mine = a.allocate(1000)
    theirs = b.allocate(1000)
    with pytest.raises(ValueError, match="another allocator"):
        a.deallocate(theirs)
    assert a.used == 1024
    a.deallocate(mine)
    b.deallocate(theirs)


def test_arena_refuses_another_arenas_id():
    a = tensormem.ContiguousArena(1 << 16)
    b = tensormem.ContiguousArena(1 << 16)
    mine, _ = a.allocate(1000)
    theirs, _ = b.allocate(1000)
    with pytest.raises(ValueError, match="another arena"):
        a.release(theirs)
    assert a.stats()["used_bytes"] == 1024
    a.release(mine)
    b.release(theirs)


def test_arena_refuses_a_number_no_arena_handed_out():
    a = tensormem.ContiguousArena(1 << 16)
    mine, _ = a.allocate(1000)
    for bogus in (0, 99):
        with pytest.raises(ValueError, match="no arena handed out"):
            a.release(bogus)
    assert a.stats()["used_bytes"] == 1024
    a.release(mine)


def test_contiguous_memory_allocator_refuses_another_allocators_tensor():
    a = ContiguousMemoryAllocator(64, torch.float32)
    b = ContiguousMemoryAllocator(64, torch.float32)
    ta = a.allocate_tensor(16)
    tb = b.allocate_tensor(16)
    with pytest.raises(ValueError):
        a.release_tensor(tb)
    assert a.stats()["used_bytes"] == 64
    a.release_tensor(ta)
    b.release_tensor(tb)


# ----------------------------------------------------------------------------- hostile arrays

def test_plan_refuses_negative_float_and_multidimensional_arrays():
    lower, upper, size = np.array([0, 1]), np.array([2, 3]), np.array([10, 10])
    assert tensormem.plan(lower, upper, size)["arena_bytes"] == 20  # int64 is fine
    with pytest.raises(ValueError, match=r"size\[1\] is -1"):
        tensormem.plan(lower, upper, np.array([10, -1]))
    with pytest.raises(ValueError, match="must hold integers"):
        tensormem.plan(lower, upper, np.array([10.0, 1.5]))
    with pytest.raises(ValueError, match="one-dimensional"):
        tensormem.plan(lower, upper, np.array([[10, 10]]))
    with pytest.raises(ValueError, match="time limit"):
        tensormem.plan(lower, upper, size, time_limit=float("nan"))


def test_arrays_of_different_lengths_are_refused_by_every_call_that_takes_them(tmp_path):
    lower, upper, size = [0, 1], [2, 3], [10]
    calls = [lambda: tensormem.plan(lower, upper, size), lambda: tensormem.lower_bound(lower, upper, size),
             lambda: tensormem.validate(lower, upper, size, [0, 10], 20),
             lambda: tensormem.write_plan_picture(tmp_path / "p.svg", lower, upper, size, [0, 10], 20, 20)]
    for call in calls:
        with pytest.raises(ValueError, match="^lower, upper and size must have the same length$"):
            call()
    assert not (tmp_path / "p.svg").exists()


def test_an_arena_policy_that_is_neither_minimal_nor_full_is_refused():
    for policy in ("minimal", "full"):
        assert tensormem.ContiguousArena(1 << 16, policy=policy).stats()["capacity_bytes"] == 1 << 16
    with pytest.raises(ValueError, match="^policy must be 'minimal' or 'full', not 'Full'$"):
        tensormem.ContiguousArena(1 << 16, policy="Full")


def test_lists_of_integers_that_no_numpy_integer_type_holds_are_read_one_by_one():
    # numpy turns [0, 2**64 - 6] into float64 (rounding the large value) and [2**64] into
    # objects; each element is read as the Python integer it is, or refused by name.
    top = 2**64 - 6
    assert tensormem.validate([0, 1], [2, 3], [10, 5], [0, top], 2**64 - 1) == ""
    assert tensormem.validate([0, 1], [2, 3], [10, 5], (0, top), 2**64 - 1) == ""
    assert "'1' at offset 18446744073709551610 with 20 bytes ends past 2^64 - 1" in tensormem.validate(
        [0, 1], [2, 3], [10, 20], [0, top], 2**64 - 1)
    assert tensormem.lower_bound([0, 1], [1, 2], [2**64 - 1, 2**63]) == 2**64 - 1
    # 2**64 - 1 read one by one (numpy makes [0, 2**64 - 1] floats) is a value, not the error
    # mark of the conversion; the element refused after it is named.
    assert tensormem.lower_bound([0, 1], [1, 2], [0, 2**64 - 1]) == 2**64 - 1
    with pytest.raises(ValueError, match=r"size\[1\] is 18446744073709551616, which does not fit in 64 bits"):
        tensormem.lower_bound([0, 1], [1, 2], [2**64 - 1, 2**64])
    with pytest.raises(ValueError, match=r"size\[0\] is 18446744073709551616, which does not fit in 64 bits"):
        tensormem.lower_bound([0, 1], [1, 2], [2**64, 2])
    with pytest.raises(ValueError, match=r"size\[0\] is -1; values must be >= 0"):
        tensormem.lower_bound([0, 1], [1, 2], [-1, 2**63])
    with pytest.raises(ValueError, match=r"size\[1\] is 1\.5, not an integer"):
        tensormem.lower_bound([0, 1], [1, 2], [2**63, 1.5])
    with pytest.raises(ValueError, match=r"upper\[0\] is 'x', not an integer"):
        tensormem.lower_bound([0], ["x"], [2**64 - 1])
    with pytest.raises(ValueError, match="must hold integers, not float64"):
        tensormem.lower_bound([0, 1], [1, 2], np.array([1.0, 2.0]))  # an array is not a list


def test_plan_of_no_buffers_from_empty_lists_and_bad_alignments():
    # numpy makes float64 arrays of empty lists: no buffers is still a plan.
    p = tensormem.plan([], [], [])
    assert p["arena_bytes"] == 0 and len(p["offsets"]) == 0
    assert tensormem.lower_bound([], [], []) == 0
    assert tensormem.validate([], [], [], [], 0) == ""
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"alignment {bad} is not a power of two"):
            tensormem.lower_bound([0], [1], [10], alignment=bad)
        with pytest.raises(ValueError, match=f"alignment {bad} is not a power of two"):
            tensormem.plan([0], [1], [10], alignment=bad)


def test_plan_of_the_largest_buffer_and_of_sizes_past_two_to_the_64():
    biggest = np.array([2**64 - 1], dtype=np.uint64)
    p = tensormem.plan(np.array([0]), np.array([1]), biggest)
    assert list(p["offsets"]) == [0] and p["arena_bytes"] == 2**64 - 1
    with pytest.raises(ValueError, match="2\\^64"):
        tensormem.plan(np.array([0, 1]), np.array([2, 3]), np.array([2**63, 2**63], dtype=np.uint64))
    with pytest.raises(OverflowError):
        tensormem.lower_bound(np.array([0, 1]), np.array([2, 3]), np.array([2**63, 2**63], dtype=np.uint64))


def test_sizes_counts_and_ids_out_of_range_are_value_errors_not_signature_mismatches():
    # pybind11 answered these with "incompatible function arguments" (a TypeError listing the
    # signature); they are values out of range, named as such.
    u64 = "expected a whole number from 0 to 18446744073709551615, not "
    u32 = "expected a whole number from 0 to 4294967295, not "
    pool = tensormem.PinnedPool()
    g = tensormem.OperatorGraph()
    cases = [
        (lambda: tensormem.BestFitAllocator().allocate(-1), u64 + "-1"),
        (lambda: tensormem.TlsfAllocator().allocate(2**64), u64 + "18446744073709551616"),
        (lambda: tensormem.TlsfAllocator().free(-256, 1), u64 + "-256"),
        (lambda: tensormem.BestFitAllocator(capacity=-1), u64 + "-1"),
        (lambda: tensormem.ContiguousArena(-4096), u64 + "-4096"),
        (lambda: tensormem.ContiguousArena(4096).release(-1), u64 + "-1"),
        (lambda: tensormem.ContiguousArena(4096).print_allocation(-1), u64 + "-1"),
        (lambda: tensormem.ContiguousArena(4096).print_allocation(2**63), "9223372036854775808 cells; at most 1000000"),
        (lambda: tensormem.PinnedPool(slab_bytes=-1), u64 + "-1"),
        (lambda: pool.allocate(2**64), u64 + "18446744073709551616"),
        (lambda: tensormem.TensorSwapper(pool, queue_depth=2**32), u32 + "4294967296"),
        (lambda: g.add_tensor("t", -8), u64 + "-8"),
        (lambda: tensormem.make_transformer_step(layers=2**32), u32 + "4294967296"),
        (lambda: tensormem.lower_bound([0], [1], [8], alignment=-1), u64 + "-1"),
        (lambda: tensormem.plan([0], [1], [8], seed=-1), u64 + "-1"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    # Floats, bools and strings stay type errors; numpy integers are whole numbers.
    a = tensormem.BestFitAllocator()
    for wrong_type in (2.5, True, "8", None):
        with pytest.raises(TypeError):
            a.allocate(wrong_type)
    assert a.allocate(np.int64(300)).bytes == 512 and a.allocate(np.uint64(256)).offset == 512
    with pytest.raises(TypeError):
        ContiguousMemoryAllocator(10.5, torch.float32)  # DeepSpeed's torch.zeros(10.5) refuses it too
    with pytest.raises(ValueError, match="size must be >= 0 elements, not -1"):
        ContiguousMemoryAllocator(-1, torch.float32)
    with pytest.raises(ValueError, match=r"size 4611686018427387904 elements of 4 bytes \(torch.float32\) is "
                                         r"18446744073709551616 bytes, more than 2\^64 - 1"):
        ContiguousMemoryAllocator(2**62, torch.float32)  # the byte count was refused as if it were the size
    with pytest.raises(MemoryError):
        ContiguousMemoryAllocator(2**62 - 1, torch.float32)  # 2^64 - 4 bytes: passed on, and too many
    with pytest.raises(TypeError):
        ContiguousMemoryAllocator(16, torch.float32).allocate_tensor(2.5)


def test_model_sizes_past_two_to_the_64_and_bad_weight_alignments_are_refused():
    # hidden x sequence = 2^80 bytes of activations used to wrap around to 0.
    with pytest.raises(OverflowError, match="the activations .* need more than 2\\^64 - 1 bytes"):
        tensormem.make_transformer_step(layers=1, hidden=2**40, heads=1, sequence=2**40)
    g = tensormem.OperatorGraph()
    w = g.add_tensor("w", 1000, role="weight")
    x = g.add_tensor("x", 8, role="input")
    y = g.add_tensor("y", 8)
    g.add_op("mm", [x, w], [y])
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"alignment {bad} is not a power of two"):
            tensormem.derive_lifetimes(g, weight_alignment=bad)
    assert tensormem.derive_lifetimes(g, weight_alignment=1)["weight_bytes"] == 1000
    g.add_tensor("w2", 2**64 - 1000, role="weight")
    with pytest.raises(OverflowError, match="weight 'w2'"):
        tensormem.derive_lifetimes(g, weight_alignment=1)


# ----------------------------------------------------------------------------- asynchronous

def test_a_torch_tensor_given_other_memory_before_the_wait_keeps_its_old_memory_alive(tmp_path):
    """The swapper holds a torch tensor's storage, not the tensor alone: `t.set_(...)` or
    `p.data = ...` before wait() used to free the memory the transfer was reading or writing
    (EFAULT from the kernel at best; bytes written into memory PyTorch had handed out again,
    or read from it into the file). Now a swap-out writes the bytes the tensor had, and a
    swap-in into a tensor given other memory fails its result with EFAULT and says why (the
    memory it had got the bytes and is let go with the ticket). Slow transfers (4 KiB requests, one at a time) make the
    change come while the transfer is in flight."""
    s = tensormem.TensorSwapper(tensormem.PinnedPool(), queue_depth=1, block_bytes=4096, direct=False)
    n = 8 << 20  # 32 MiB of float32
    src = torch.randn(n)
    assert s.wait(s.swap_out([src], [str(tmp_path / "src")]))[0]["error"] == 0

    # swap-out, then the tensor takes other memory: the file holds what it had
    out = src.clone()
    ticket = s.swap_out([out], [str(tmp_path / "out")])
    out.set_(torch.empty(0))
    gc.collect()
    reuse = [torch.full((1 << 18,), 7.0) for _ in range(64)]  # memory handed out again meanwhile
    assert s.wait(ticket)[0]["error"] == 0
    back = torch.zeros(n)
    assert s.wait(s.swap_in([str(tmp_path / "out")], [back]))[0]["error"] == 0
    assert torch.equal(back, src)
    assert all(bool((r == 7.0).all()) for r in reuse)

    # swap-in, then `p.data = ...`: refused at the wait, the new memory untouched
    p = torch.nn.Parameter(torch.zeros(n))
    ticket = s.swap_in([str(tmp_path / "src")], [p])
    p.data = torch.full((4,), 3.0)
    gc.collect()
    r = s.wait(ticket)[0]
    assert r["error"] == errno.EFAULT
    assert "given other memory (set_, .data =) before the wait" in r["message"]
    assert torch.equal(p.data, torch.full((4,), 3.0))

    # an untouched tensor is still read back as before
    t = torch.zeros(n)
    assert s.wait(s.swap_in([str(tmp_path / "src")], [t]))[0]["error"] == 0 and torch.equal(t, src)

    # tensormem.torch.AsyncTensorSwapper: the same refusal at synchronize(), its other
    # tensors read back
    a = tensormem.torch.AsyncTensorSwapper(queue_depth=1, block_bytes=4096, engine="threads")
    moved, kept = torch.zeros(n), torch.zeros(n)
    assert s.wait(s.swap_out([src], [str(tmp_path / "src2")]))[0]["error"] == 0
    a.swap_in_tensors([str(tmp_path / "src"), str(tmp_path / "src2")], [moved, kept])
    moved.data = torch.full((4,), 3.0)
    with pytest.raises(OSError, match="the tensor was given other memory") as e:
        a.synchronize()
    assert e.value.errno == errno.EFAULT
    assert [r["error"] for r in a.results] == [errno.EFAULT, 0]
    assert torch.equal(kept, src) and torch.equal(moved, torch.full((4,), 3.0))


def _refused_growth(t: torch.Tensor):
    """Tries to resize ``t`` in place to twice its elements (PyTorch would take new memory and
    free the old), expects the refusal, and puts the shape back: PyTorch sets the new sizes
    before it resizes the storage, so a refused resize leaves them over the old memory."""
    shape = t.shape
    with pytest.raises(RuntimeError, match="not resizable"):
        t.resize_(2 * t.numel())
    t.resize_(shape)


def _grow(t: torch.Tensor):
    t.resize_(2 * t.numel())


@pytest.mark.skipif(bool(tensormem.torch.size_hold_problem()), reason=tensormem.torch.size_hold_problem())
def test_a_torch_tensor_in_flight_cannot_be_resized_in_place(tmp_path):
    """`t.resize_()` to more bytes than its storage has frees the memory a transfer of `t` in
    flight reads or writes (holding the storage cannot stop PyTorch from swapping its
    memory). Until the wait, every swapper now holds the storage's size: such a resize raises
    RuntimeError (PyTorch leaves the new sizes over the old memory: resizing back mends
    it) and the transfer completes with the tensor's memory; a resize within the storage is
    let through; after the wait the tensor resizes again. Holds on one storage
    nest (a tensor and a view of it in two tickets), and a storage that was not resizable
    (numpy's) stays so."""
    s = tensormem.TensorSwapper(tensormem.PinnedPool(), queue_depth=1, block_bytes=4096, direct=False)
    n = 8 << 20
    src = torch.randn(n)
    path = str(tmp_path / "src")

    out = src.clone()
    ticket = s.swap_out([out], [path])
    _refused_growth(out)
    out.resize_(10)  # within the storage: no memory moves
    out.resize_(n)
    assert s.wait(ticket)[0]["error"] == 0
    back = torch.zeros(n)
    ticket = s.swap_in([path], [back])
    _refused_growth(back)
    assert s.wait(ticket)[0]["error"] == 0 and torch.equal(back, src)
    _grow(back)  # the wait let go of it
    assert back.numel() == 2 * n

    # nested holds: a tensor and a view of its storage in two tickets
    whole, part = src.clone(), None
    part = whole[: n // 2]
    first = s.swap_out([whole], [str(tmp_path / "whole")])
    second = s.swap_out([part], [str(tmp_path / "part")])
    s.wait(first)
    _refused_growth(whole)
    s.wait(second)
    _grow(whole)

    # a storage that was not resizable stays so
    from_numpy = torch.from_numpy(np.zeros(1 << 20, dtype=np.uint8))
    s.wait(s.swap_out([from_numpy], [str(tmp_path / "np")]))
    _refused_growth(from_numpy)

    # tensormem.torch.AsyncTensorSwapper and DeepSpeed's aio_handle hold it too
    a = tensormem.torch.AsyncTensorSwapper(queue_depth=1, block_bytes=4096, engine="threads")
    t = torch.zeros(n)
    a.swap_in_tensors([path], [t])
    _refused_growth(t)
    a.synchronize()
    assert torch.equal(t, src)
    _grow(t)
    from tensormem.deepspeed import aio_handle
    h = aio_handle(block_size=4096, queue_depth=1)
    t = torch.zeros(n)
    h.async_pread(t, str(tmp_path / "whole"), 4096)  # past the swapper's header page
    _refused_growth(t)
    assert h.wait() == 1
    _grow(t)


@pytest.mark.skipif(bool(tensormem.torch.size_hold_problem()), reason=tensormem.torch.size_hold_problem())
def test_a_size_hold_takes_a_storage_and_nothing_else():
    """StorageSizeHold reads the StorageImpl's address from a storage's `_cdata`; a tensor's
    `_cdata` is a TensorImpl's address, and writing a flag there would corrupt it: a tensor,
    or anything else that is not a torch storage, is refused with a TypeError. Holds on one
    storage count up and down, and the last one gone lets the storage grow again."""
    from tensormem import _tensormem_torch
    t = torch.zeros(16)
    for wrong in (t, object(), np.zeros(4)):
        with pytest.raises(TypeError, match="expected a torch storage"):
            _tensormem_torch.StorageSizeHold(wrong)
    storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    first = _tensormem_torch.StorageSizeHold(storage)
    second = _tensormem_torch.StorageSizeHold(t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage())
    assert first.holds == 2 and second.holds == 2
    del second
    assert first.holds == 1
    _refused_growth(t)
    del first
    _grow(t)
    assert t.numel() == 32


def test_without_the_pytorch_extension_a_transfer_of_a_torch_tensor_warns_once(tmp_path):
    """Where tensormem's PyTorch extension cannot be imported, nothing holds a tensor's size:
    size_hold_problem() says why, and the first transfer of a torch tensor warns it (a
    RuntimeWarning), the next ones not; the transfers themselves work."""
    code = textwrap.dedent(f"""
        import sys, warnings
        sys.modules["tensormem._tensormem_torch"] = None  # import raises ImportError
        import torch, tensormem, tensormem.torch
        problem = tensormem.torch.size_hold_problem()
        assert "not built" in problem and "not refused" in problem, problem
        s = tensormem.TensorSwapper(tensormem.PinnedPool())
        t = torch.arange(1000.0)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for i in range(3):
                assert s.wait(s.swap_out([t], [{str(tmp_path)!r} + "/t%d" % i]))[0]["error"] == 0
        messages = [str(w.message) for w in seen if w.category is RuntimeWarning]
        assert messages == [problem], messages
        back = torch.zeros(1000)
        assert s.wait(s.swap_in([{str(tmp_path)!r} + "/t0"], [back]))[0]["error"] == 0
        assert torch.equal(back, t)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_swap_out_progresses_while_python_sleeps(tmp_path):
    pool = tensormem.PinnedPool(slab_bytes=32 << 20)
    s = tensormem.TensorSwapper(pool, staging_buffers=4)
    arrays = [np.full(1 << 20, i, dtype=np.uint8) for i in range(16)]
    paths = [str(tmp_path / f"t{i}") for i in range(16)]
    ticket = s.swap_out(arrays, paths)
    # No call into the swapper until every file is in place (files appear once complete).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(p) and os.path.getsize(p) == 4096 + (1 << 20) for p in paths):
        time.sleep(0.02)
    assert all(os.path.exists(p) for p in paths)
    assert s.done(ticket)
    assert [r["error"] for r in s.wait(ticket)] == [0] * 16


def test_swap_paths_that_are_not_regular_files_are_refused(tmp_path):
    s = tensormem.TensorSwapper(tensormem.PinnedPool())
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "keep").write_text("the user's file")
    src = np.arange(1024, dtype=np.float32)
    [r] = s.wait(s.swap_out([src], [str(folder)]))
    assert r["error"] == errno.EISDIR and "is a directory" in r["message"]
    assert folder.is_dir() and (folder / "keep").read_text() == "the user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]
    for bad in ("", str(tmp_path / "a\0b")):
        with pytest.raises(ValueError, match="empty path|NUL byte"):
            s.swap_out([src], [bad])
        with pytest.raises(ValueError, match="empty path|NUL byte"):
            s.swap_in([bad], [src])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]
    # DeepSpeed's interface raises the per-tensor error once everything has completed.
    from tensormem.torch import AsyncTensorSwapper
    a = AsyncTensorSwapper()
    a.swap_out_tensors([torch.zeros(1024)], [str(folder)])
    with pytest.raises(IsADirectoryError):
        a.synchronize()
    assert (folder / "keep").exists()
    # A pipe is not opened (the open would wait for a writer, with the swapper's lock held).
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    [r] = s.wait(s.swap_in([str(pipe)], [src]))
    assert r["error"] == errno.EINVAL and "it is a pipe; swap files are regular files" in r["message"]


def test_unknown_tickets_are_value_errors(tmp_path):
    pool = tensormem.PinnedPool(slab_bytes=4 << 20)
    s = tensormem.TensorSwapper(pool, staging_buffers=2)
    with pytest.raises(ValueError, match="unknown or already waited ticket 12345"):
        s.done(12345)
    with pytest.raises(ValueError, match="unknown or already waited ticket 12345"):
        s.wait(12345)
    t = s.swap_out([np.ones(10)], [str(tmp_path / "x")])
    s.wait(t)
    with pytest.raises(ValueError, match="already waited"):
        s.wait(t)


def test_a_path_held_by_a_dropped_ticket_names_it_and_the_ticket_is_still_waited_for(tmp_path):
    # A ticket (an int) the caller dropped keeps its paths in flight: the refusal says which
    # ticket, and waiting for that number collects it and frees the path.
    s = tensormem.TensorSwapper(tensormem.PinnedPool(slab_bytes=4 << 20), staging_buffers=2)
    x = np.arange(1000, dtype=np.float32)
    path = str(tmp_path / "x")
    s.swap_out([x], [path])  # ticket dropped
    with pytest.raises(ValueError) as refused:
        s.swap_in([path], [np.zeros_like(x)])
    m = re.search(r"is in a transfer not yet waited for \(ticket (\d+): wait\(\1\) or synchronize\(\) collects it\)",
                  str(refused.value))
    assert m, str(refused.value)
    with pytest.raises(ValueError, match=r"\(ticket " + m.group(1) + ":"):
        s.discard(path)
    assert s.wait(int(m.group(1)))[0]["error"] == 0
    y = np.zeros_like(x)
    assert s.wait(s.swap_in([path], [y]))[0]["error"] == 0 and (y == x).all()


def test_synchronize_keeps_holding_a_ticket_another_thread_started_meanwhile(tmp_path):
    """synchronize() lets go of the buffers of the tickets it collected, the ones another
    thread started while it ran included, and of no other: a ticket still outstanding may be
    reading its buffer."""
    s = tensormem.TensorSwapper(tensormem.PinnedPool(), engine="threads")
    big = s.swap_out([np.ones(512 << 20, dtype=np.uint8)], [str(tmp_path / "big")])  # about a second
    entered = threading.Event()

    def sync():
        entered.set()
        s.synchronize()

    helper = threading.Thread(target=sync)
    helper.start()
    entered.wait()
    time.sleep(0.1)  # the helper is inside synchronize, waiting for the big write
    small = bytearray(range(256)) * 256
    ticket = s.swap_out([small], [str(tmp_path / "small")])
    try:
        running = not s.done(big)
    except ValueError:  # already collected by the helper's synchronize
        running = False
    if not running:
        helper.join()
        pytest.skip("the big write ended before the second ticket started: nothing to check")
    # While the ticket is outstanding its buffer is held (a bytearray with an export cannot grow).
    if s.outstanding(ticket):
        with pytest.raises(BufferError):
            small.extend(b"x")
    helper.join()
    # The helper's synchronize waited for every ticket, the second one too, and let both go.
    assert not s.outstanding(ticket)
    small.extend(b"x")
    with pytest.raises(ValueError, match="unknown or already waited"):
        s.wait(ticket)
    (tmp_path / "big").unlink()


def test_outstanding_answers_for_any_ticket_and_refuses_what_is_not_one(tmp_path):
    s = tensormem.TensorSwapper(tensormem.PinnedPool(slab_bytes=1 << 20), engine="threads")
    ticket = s.swap_out([np.ones(4096, np.uint8)], [str(tmp_path / "t")])
    assert s.outstanding(ticket)
    assert not s.outstanding(ticket + 1) and not s.outstanding(2**64 - 1)  # never started
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="expected a whole number"):
            s.outstanding(bad)
    with pytest.raises(TypeError):
        s.outstanding(1.5)
    s.wait(ticket)
    assert not s.outstanding(ticket)


def test_paths_with_a_nul_byte_or_empty_are_value_errors_and_touch_no_file(tmp_path):
    """The system reads a path up to its first NUL: "kept\\0x" would name "kept". Every entry
    point that takes a path refuses such a path, and an empty one, before touching a file."""
    import tensormem.deepspeed as ds
    from tensormem.offload import OffloadedAdam

    kept = tmp_path / "kept"
    kept.write_text("id,lower,upper,size\na,0,2,8\n")
    before = kept.read_bytes()
    nul = str(kept) + "\0x"
    handle = ds.aio_handle()
    swapper = tensormem.TensorSwapper(tensormem.PinnedPool())
    one = np.zeros(1, dtype=np.uint64)
    for bad in (nul, ""):
        with pytest.raises(ValueError, match="empty path|NUL byte"):
            handle.sync_pwrite(torch.ones(4), bad)
        with pytest.raises(ValueError, match="empty path|NUL byte"):
            handle.read(torch.ones(4), bad, False)
        with pytest.raises(ValueError, match="empty path|NUL byte"):
            swapper.discard(bad)
        with pytest.raises(ValueError, match="empty path|NUL byte"):
            tensormem.read_trace(bad)
        with pytest.raises(ValueError, match="empty path|NUL byte"):
            tensormem.write_plan_picture(bad, one, one + 2, one + 8, one, 8, 8)
        with pytest.raises(ValueError, match="empty path|NUL byte"):
            OffloadedAdam([torch.nn.Parameter(torch.zeros(8))], swap_dirs=[str(tmp_path) + "\0x" if bad else ""])
    assert handle.wait() == 0
    assert kept.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_file_names_may_be_bytes_that_are_not_utf8_or_path_like_and_come_back_as_os_fsdecode_makes_them(tmp_path):
    """A Linux file name is bytes. Every entry point takes str (names from os.listdir, whose
    undecodable bytes are lone surrogates), bytes and os.PathLike; names come back as
    os.fsdecode makes them, and a message naming such a file says \\xNN instead of failing."""
    import pathlib
    import tensormem.deepspeed as ds

    folder = os.fsencode(tmp_path)
    raw = folder + b"/t\xff\xfe"  # not UTF-8
    name = os.fsdecode(raw)       # '...t\udcff\udcfe', as os.listdir(str) gives it
    swapper = tensormem.TensorSwapper(tensormem.PinnedPool(slab_bytes=8 << 20), staging_buffers=2)
    data = np.arange(4096, dtype=np.float32)
    for given in (raw, name, pathlib.Path(name)):
        result = swapper.wait(swapper.swap_out([data], [given]))
        assert result == [{"path": name, "bytes": data.nbytes, "error": 0, "message": ""}]
        back = np.zeros_like(data)
        assert swapper.wait(swapper.swap_in([given], [back]))[0]["error"] == 0
        assert np.array_equal(back, data)
    # A key given as the str of a name is that name's bytes: the default key of the path.
    assert swapper.wait(swapper.swap_out([data], [raw], keys=[name]))[0]["error"] == 0
    back = np.zeros_like(data)
    assert swapper.wait(swapper.swap_in([raw], [back]))[0]["error"] == 0 and np.array_equal(back, data)
    assert swapper.wait(swapper.swap_in([raw], [back], keys=[b"other"]))[0]["error"] == errno.EINVAL
    with pytest.raises(TypeError):
        swapper.swap_out([data], [raw], keys=[pathlib.Path(name)])  # a key is text, not a path
    assert os.path.exists(raw)
    swapper.discard(pathlib.Path(name))
    assert not os.path.exists(raw)
    # A failure names the file: the result's path opens it again, its message says \xff.
    missing = folder + b"/no\xff/t"
    failed = swapper.wait(swapper.swap_out([data], [missing]))[0]
    assert failed["error"] == errno.ENOENT and failed["path"] == os.fsdecode(missing)
    assert "no\\xff/t" in failed["message"]

    # Traces and pictures.
    trace = folder + b"/tr\xff.csv"
    with open(trace, "w") as f:
        f.write("id,lower,upper,size\na,0,2,8\nb,1,3,8\n")
    for given in (trace, os.fsdecode(trace), pathlib.Path(os.fsdecode(trace))):
        assert list(tensormem.read_trace(given)["id"]) == ["a", "b"]
    with pytest.raises(FileNotFoundError, match=re.escape("no\\xff.csv")):
        tensormem.read_trace(folder + b"/no\xff.csv")
    with open(trace, "a") as f:
        f.write("c,0,1,x\n")
    with pytest.raises(ValueError, match=re.escape("tr\\xff.csv:4:")):
        tensormem.read_trace(trace)
    one = np.zeros(1, dtype=np.uint64)
    picture = pathlib.Path(os.fsdecode(folder + b"/p\xff.svg"))
    assert tensormem.write_plan_picture(picture, one, one + 2, one + 8, one, 8, 8) == ""
    assert os.path.getsize(os.fsencode(picture)) > 0

    # DeepSpeed's handle: a write and its failure, named the same way.
    handle = ds.aio_handle()
    assert handle.sync_pwrite(torch.arange(1024.0), folder + b"/h\xff") == 1
    got = torch.zeros(1024)
    assert handle.sync_pread(got, pathlib.Path(os.fsdecode(folder + b"/h\xff"))) == 1
    assert torch.equal(got, torch.arange(1024.0))
    with pytest.raises(FileNotFoundError, match=re.escape("h\\xffmissing for reading")):
        handle.sync_pread(got, folder + b"/h\xffmissing")
    # A failure found by the I/O (past the file-size limit): AIOError's filename and errors.
    from file_limits import file_size_limit
    with file_size_limit(4096), pytest.raises(ds.AIOError) as e:
        handle.sync_pwrite(torch.arange(4096.0), folder + b"/big\xff")
    assert e.value.errno == errno.EFBIG and e.value.filename == os.fsdecode(folder + b"/big\xff")
    assert [(p, code) for p, code, _ in e.value.errors] == [(e.value.filename, errno.EFBIG)]
    assert "big\\xff" in e.value.errors[0][2]
    # Names that no bytes stand for (a lone surrogate of a code point below 128) are refused.
    with pytest.raises(UnicodeEncodeError):
        swapper.swap_out([data], [name[:-1] + "\udc41"])
    with pytest.raises(TypeError):
        tensormem.read_trace(42)


def test_aio_handle_sizes_and_offsets_are_whole_numbers(tmp_path):
    """DeepSpeed's handle takes integers: a float offset is a TypeError there, and was read
    here as the offset truncated (bytes from the wrong place)."""
    import tensormem.deepspeed as ds

    path = str(tmp_path / "f")
    handle = ds.aio_handle()
    handle.sync_pwrite(torch.arange(8, dtype=torch.uint8), path)
    target = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(TypeError):
        handle.sync_pread(target, path, 1.5)
    with pytest.raises(TypeError):
        handle.pread(target, path, False, False, 2.0)
    with pytest.raises(TypeError):
        handle.read(target, path, False, 1.0)
    assert handle.wait() == 0 and target.tolist() == [0, 0, 0, 0]
    for name in ("block_size", "queue_depth", "intra_op_parallelism"):
        with pytest.raises(TypeError):
            ds.aio_handle(**{name: 8.5})
        with pytest.raises(TypeError):
            ds.aio_handle(**{name: "8"})
    handle.sync_pread(target, path, np.int64(2))
    assert target.tolist() == [2, 3, 4, 5]


# ----------------------------------------------------------------------------- numpy 2 and old pybind11

def test_a_build_that_would_misread_numpy2_arrays_refuses_them(tmp_path):
    """pybind11 before 2.12 reads numpy 2's arrays wrongly (every plan came back overlapping
    under numpy 2.5). Such a build refuses them with a RuntimeError naming both versions and
    the remedy; a build with a newer pybind11 reads them. A stand-in numpy 2 (whose asarray
    must never be reached) checks the refusal under any installed numpy."""
    fake = tmp_path / "numpy"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "__version__ = '2.5.2'\n"
        "def asarray(*a, **k):\n    raise AssertionError('an array was read')\n")
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import tensormem
        major, minor = map(int, tensormem._tensormem.PYBIND11_VERSION.split(".")[:2])
        print("old" if (major, minor) < (2, 12) else "new", tensormem._tensormem.PYBIND11_VERSION)
        print("problem:", tensormem._tensormem.numpy_abi_problem())
        try:
            tensormem.lower_bound([0], [1], [4])
        except RuntimeError as e:
            print("refused:", e)
        except AssertionError as e:
            print("read:", e)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    version = lines[0].split()[1]
    if lines[0].startswith("old"):
        assert f"pybind11 {version}" in lines[1] and "numpy 2.5.2" in lines[1] and "rebuild" in lines[1]
        assert lines[2].startswith("refused: lower: ") and "pybind11 >= 2.12" in lines[2]
    else:
        assert lines[1] == "problem: " and lines[2] == "read: an array was read"
    # With the real numpy, this build reads arrays correctly.
    assert tensormem._tensormem.numpy_abi_problem() == "" or np.__version__.startswith("2")


# ----------------------------------------------------------------------------- pinned pool

def test_a_pool_registered_with_cuda_needs_a_device():
    why = tensormem.cuda_unavailable_reason()
    if not why:
        pytest.skip("a CUDA device is here: the C++ device tests cover registration")
    with pytest.raises(RuntimeError, match=re.escape("register_with_cuda needs a CUDA device: " + why)):
        tensormem.PinnedPool(slab_bytes=1 << 20, register_with_cuda=True)
    pool = tensormem.PinnedPool(slab_bytes=1 << 20)
    buffer = pool.allocate(4096)
    assert pool.stats()["registered_bytes"] == 0
    assert pool.stats()["locked_bytes"] == 1 << 20
    buffer.free()


# ----------------------------------------------------------------------------- stopping a plan

def _long_plan_arrays(n=100_000, seed=1):
    # The synthetic family of `tensormem plan --synthetic`: starts uniform over n steps,
    # lifetimes 2^U(0, 12) steps, sizes 2^U(10, 24) bytes; far from solved in 600 s.
    rng = np.random.default_rng(seed)
    lower = rng.integers(0, n, n, dtype=np.uint64)
    upper = lower + np.ceil(2.0 ** rng.uniform(0, 12, n)).astype(np.uint64)
    size = np.ceil(2.0 ** rng.uniform(10, 24, n)).astype(np.uint64)
    return lower, upper, size


def _plan_stopped_by(signal_from_a_timer, expected):
    lower, upper, size = _long_plan_arrays()
    timer = threading.Timer(1.0, signal_from_a_timer)
    start = time.monotonic()
    timer.start()
    try:
        with pytest.raises(expected):
            tensormem.plan(lower, upper, size, time_limit=600)
    finally:
        timer.cancel()
    assert time.monotonic() - start < 30  # stopped, not ended by its limit
    # The planner's thread has ended: the module plans again at once.
    assert tensormem.plan([0, 1], [2, 3], [10, 10])["arena_bytes"] == 20


def test_ctrl_c_stops_a_plan_with_keyboard_interrupt():
    _plan_stopped_by(_thread.interrupt_main, KeyboardInterrupt)


class _Stop(Exception):
    pass


def test_an_exception_from_a_signal_handler_stops_a_plan():
    def handler(signum, frame):
        raise _Stop(f"signal {signum}")

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        _plan_stopped_by(lambda: os.kill(os.getpid(), signal.SIGUSR1), _Stop)
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_a_signal_handler_that_returns_lets_the_plan_run_on():
    seen = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    lower, upper, size = _long_plan_arrays()
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        p = tensormem.plan(lower, upper, size, time_limit=3)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)
    assert seen == [signal.SIGUSR1]  # the handler ran during the plan
    assert tensormem.validate(lower, upper, size, p["offsets"], p["arena_bytes"]) == ""
    # It ran on well past the signal (0.5 s), towards its limit: it does not reach the bound,
    # and a placement starts only where it can end in time, so it may end before 3 s.
    assert p["stopped"] is False and p["seconds"] > 1.0


def test_an_event_stops_a_plan_and_the_best_plan_so_far_comes_back():
    lower, upper, size = _long_plan_arrays()
    first = tensormem.plan(lower, upper, size, time_limit=0)  # the first plan alone
    assert first["stopped"] is False
    for where in ("main", "worker"):
        stop = threading.Event()
        timer = threading.Timer(1.5, stop.set)
        out = {}

        def run():
            out["plan"] = tensormem.plan(lower, upper, size, time_limit=600, stop=stop)

        start = time.monotonic()
        timer.start()
        if where == "main":
            run()
        else:  # a thread other than the main one: the event is seen there too
            t = threading.Thread(target=run)
            t.start()
            t.join(60)
            assert not t.is_alive()
        took = time.monotonic() - start
        timer.cancel()
        p = out["plan"]
        assert p["stopped"] is True, where
        assert took < 30, where  # stopped, not ended by its limit
        assert tensormem.validate(lower, upper, size, p["offsets"], p["arena_bytes"]) == "", where
        assert p["arena_bytes"] <= first["arena_bytes"], where
    # Set before the call: the first plan, at once.
    stop = threading.Event()
    stop.set()
    p = tensormem.plan(lower, upper, size, time_limit=600, stop=stop)
    assert p["stopped"] is True and p["arena_bytes"] == first["arena_bytes"]
    assert p["strategy"] == "online O(1) allocator"


def test_a_stop_that_is_not_an_event_is_refused_and_one_that_raises_stops_the_plan():
    with pytest.raises(TypeError, match="stop must be None or have is_set\\(\\).*not int"):
        tensormem.plan([0], [1], [10], stop=1)

    class Broken:
        def __init__(self):
            self.calls = 0

        def is_set(self):
            self.calls += 1
            if self.calls == 3:
                raise _Stop("is_set failed")
            return False

    lower, upper, size = _long_plan_arrays()
    start = time.monotonic()
    with pytest.raises(_Stop, match="is_set failed"):
        tensormem.plan(lower, upper, size, time_limit=600, stop=Broken())
    assert time.monotonic() - start < 30

    class NotABool:
        def is_set(self):
            return object()  # no truth value pybind11 can read: a C++ cast error, not a Python one

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Unable to cast"):
        tensormem.plan(lower, upper, size, time_limit=600, stop=NotABool())
    assert time.monotonic() - start < 30


def test_progress_comes_on_the_calling_thread_and_an_exception_from_it_stops_the_plan():
    lower, upper, size = _long_plan_arrays()
    calls = []
    caller = threading.get_ident()

    def progress(p):
        calls.append((threading.get_ident(), dict(p)))

    plan = tensormem.plan(lower, upper, size, time_limit=3, progress=progress)
    assert calls  # the first plan's report, then one for each better plan (ten a second at most)
    assert {ident for ident, _ in calls} == {caller}
    reports = [p for _, p in calls]
    assert set(reports[0]) == {"seconds", "best_arena_bytes", "lower_bound", "phase"}
    assert all(p["lower_bound"] == plan["lower_bound"] for p in reports)
    assert all(isinstance(p["phase"], str) and p["phase"] for p in reports)
    seconds = [p["seconds"] for p in reports]
    assert seconds == sorted(seconds) and seconds[-1] <= plan["seconds"]
    best = [p["best_arena_bytes"] for p in reports]
    assert best == sorted(best, reverse=True)  # never worse than an earlier report
    assert best[-1] == plan["arena_bytes"] >= plan["lower_bound"]  # the last report is the plan returned
    # The times of the plan, as `tensormem plan --json` gives them.
    assert 0 < plan["first_plan_seconds"] <= plan["best_plan_seconds"] <= plan["seconds"]
    assert 0 < plan["greedy_seconds"] <= plan["seconds"]

    with pytest.raises(TypeError, match="progress must be None or callable, not int"):
        tensormem.plan([0], [1], [10], progress=1)

    def failing(p):
        if p["seconds"] > 0.5:
            raise _Stop("enough")

    start = time.monotonic()
    with pytest.raises(_Stop, match="enough"):
        tensormem.plan(lower, upper, size, time_limit=600, progress=failing)
    assert time.monotonic() - start < 30


# ------------------------------------------------------------------- Ctrl-C in a wait for I/O

# Transfers slow enough to interrupt on any disk, tmpfs included: 128 MiB in requests of 4 KiB,
# one at a time (at least 0.7 s in memory, seconds on a disk); Ctrl-C comes 50 ms in.
_SLOW = dict(queue_depth=1, block_bytes=4096, direct=False)
_SLOW_BYTES = 128 << 20


def _interrupted(call, after=0.05):
    """Runs call() with Ctrl-C `after` seconds in; returns the seconds until KeyboardInterrupt.
    Where the call returns first, the test fails here: a Ctrl-C sent as it returned comes out
    inside this function, never later in the test's own code or pytest's (which it would end)."""
    timer = threading.Timer(after, _thread.interrupt_main)
    start = time.monotonic()
    returned = False
    try:
        timer.start()
        call()
        returned = True
        timer.cancel()
        timer.join()
        time.sleep(0.01)  # (a Ctrl-C sent before the cancel comes out here)
    except KeyboardInterrupt:
        if not returned:
            return time.monotonic() - start
    finally:
        timer.cancel()
    pytest.fail(f"the call returned before Ctrl-C, {after} s in")


def test_ctrl_c_interrupts_a_swapper_wait_and_the_ticket_is_waited_for_again(tmp_path):
    s = tensormem.TensorSwapper(tensormem.PinnedPool(), **_SLOW)
    big = np.random.default_rng(3).integers(0, 256, _SLOW_BYTES, dtype=np.uint8)
    path = str(tmp_path / "big")
    t = s.swap_out([big], [path])
    _interrupted(lambda: s.wait(t))
    # Nothing was collected: the transfer goes on and its buffer stays held.
    assert s.outstanding(t) and not s.done(t)
    with pytest.raises(ValueError, match="cannot resize"):
        big.resize(1)
    [r] = s.wait(t)
    assert r["error"] == 0 and r["bytes"] == _SLOW_BYTES
    back = np.zeros_like(big)
    assert s.wait(s.swap_in([path], [back]))[0]["error"] == 0
    assert np.array_equal(back, big)

    # synchronize: the tickets it collected before Ctrl-C stay collected, the rest outstanding.
    small = np.arange(1024, dtype=np.uint8)
    first = s.swap_out([small], [str(tmp_path / "small")])
    second = s.swap_out([big], [path])
    _interrupted(s.synchronize)
    assert s.outstanding(second)
    s.synchronize()
    assert not s.outstanding(first) and not s.outstanding(second)
    big.resize(1)  # no longer held


def test_a_wait_keeps_its_ticket_from_other_threads_between_its_slices(tmp_path):
    # The wait looks for signals every 50 ms; between those slices its ticket stays its own:
    # a synchronize on another thread waits for it to be collected, and takes nothing.
    s = tensormem.TensorSwapper(tensormem.PinnedPool(), **_SLOW)
    big = np.ones(_SLOW_BYTES, dtype=np.uint8)
    t = s.swap_out([big], [str(tmp_path / "big")])
    got, failed = [], []

    def waiter():
        try:
            got.extend(s.wait(t))
        except Exception as e:  # noqa: BLE001 - reported below
            failed.append(e)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.2)  # several slices in
    s.synchronize()
    thread.join()
    assert failed == [] and len(got) == 1 and got[0]["error"] == 0
    assert not s.outstanding(t)


def test_ctrl_c_interrupts_the_torch_swapper_and_synchronize_goes_on(tmp_path):
    from tensormem.torch import AsyncTensorSwapper
    a = AsyncTensorSwapper(queue_depth=1, block_bytes=4096)
    small = torch.arange(256, dtype=torch.float32)
    big = torch.from_numpy(np.random.default_rng(4).integers(0, 256, _SLOW_BYTES, dtype=np.uint8))
    a.swap_out_tensors([small], [str(tmp_path / "small")])
    a.swap_out_tensors([big], [str(tmp_path / "big")])
    _interrupted(a.synchronize)
    # The first ticket was collected before Ctrl-C; the next call returns both results.
    results = a.synchronize()
    assert [r["path"] for r in results] == [str(tmp_path / "small"), str(tmp_path / "big")]
    assert all(r["error"] == 0 for r in results)
    back = torch.zeros_like(big)
    a.swap_in_tensors([str(tmp_path / "big")], [back])
    a.synchronize()
    assert torch.equal(back, big)


class _InterruptedOnce:
    """An aio_handle whose first wait is interrupted (KeyboardInterrupt) before the writes end."""

    def __init__(self, inner):
        self.inner = inner
        self.interrupted = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def wait(self):
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return self.inner.wait()


def test_ctrl_c_interrupts_an_aio_handle_wait_without_losing_its_operations(tmp_path):
    from tensormem.deepspeed import aio_handle
    h = aio_handle(block_size=4096, queue_depth=1)
    # Not contiguous: the handle writes from a copy of its own, which only it holds (freed
    # during the write, its pages would fail the write or reach the file as other bytes).
    big = torch.from_numpy(np.random.default_rng(5).integers(0, 256, _SLOW_BYTES, dtype=np.uint8)).view(2, -1).t()
    want = big.contiguous().numpy().reshape(-1)
    path = str(tmp_path / "queued")
    assert h.async_pwrite(big, path) == 0
    _interrupted(h.wait)
    gc.collect()
    assert h.wait() == 1  # collected by the next wait, its copy held until then
    assert np.array_equal(np.fromfile(path, dtype=np.uint8), want)

    # A synchronous write whose wait is interrupted (at once, so that the copy the handle makes
    # is certainly queued first): the next synchronous call collects it too.
    h._sync_io = _InterruptedOnce(tensormem._tensormem.AsyncFileIO(block_bytes=4096, queue_depth=1))
    other = str(tmp_path / "sync")
    with pytest.raises(KeyboardInterrupt):
        h.write(big, other, False)
    assert h._sync_io.interrupted
    gc.collect()
    back = torch.zeros(4096, dtype=torch.uint8)
    assert h.read(back, other, False) == 0
    assert np.array_equal(back.numpy(), want[:4096])
    assert np.array_equal(np.fromfile(other, dtype=np.uint8), want)


def test_an_interrupted_wait_leaves_the_deepspeed_swappers_buffers_in_flight(tmp_path):
    from tensormem import deepspeed as ds
    handle = _InterruptedOnce(ds.aio_handle())
    swapper = ds.AsyncTensorSwapper(handle, numel_alignment=256, timers=None)
    buffers = [ds.new_cpu_locked_tensor(4096, torch.zeros(1)) for _ in range(2)]
    swapper.add_buffers(buffers)
    tensors = [torch.full((4096,), float(i)) for i in range(3)]
    paths = [str(tmp_path / f"g{i}") for i in range(3)]
    # Two full buffers, then a third tensor that waits for a free one: that wait is interrupted.
    with pytest.raises(KeyboardInterrupt):
        swapper.swap_out_tensors(tensors, paths)
    assert handle.interrupted
    # The buffers were not handed back while their writes were in flight: the next wait
    # collects those writes, and every file holds its tensor.
    swapper.swap_out_tensors(tensors[2:], paths[2:])
    assert swapper.release_buffers() == buffers
    for t, p in zip(tensors, paths):
        assert torch.equal(torch.from_file(p, size=4096, dtype=torch.float32), t)


@pytest.mark.parametrize("master", [True, False])
def test_ctrl_c_interrupts_an_offloaded_step_and_undoes_it_while_it_can(tmp_path, master):
    # 16 Mi parameters in sub-groups of 1 MiB: a step of a few tenths of a second, 64
    # sub-groups. Ctrl-C 5 ms in (without the master copy a whole step takes 60-110 ms on an
    # idle 2-core host: 50 ms in, it had sometimes ended first): with the master copy
    # offloaded the step is undone (the
    # parameters, the state and the step count as before it, and the next step equal to an
    # uninterrupted one); without it, a step whose first sub-group changed its parameters
    # finishes first.
    from tensormem.offload import OffloadedAdamW

    values = torch.randn(16 << 20, generator=torch.Generator().manual_seed(5))
    grad = torch.randn(16 << 20, generator=torch.Generator().manual_seed(6))

    def make(folder):
        p = torch.nn.Parameter(values.clone())
        p.grad = grad.clone()
        folder.mkdir()
        return p, OffloadedAdamW([p], lr=1e-2, swap_dirs=[str(folder)], group_bytes=1 << 20,
                                 pinned_budget=16 << 20, offload_master=master)

    p, opt = make(tmp_path / "ours")
    before = p.detach().clone()
    _interrupted(opt.step, after=0.005)  # (how soon: bench/wait_interrupt_bench.py)
    if master:
        assert opt._core.steps == [0]
    # Without the master copy: undone only if no sub-group had changed a parameter yet (a
    # machine slow to read the first one), else finished. Never half of a step.
    assert opt._core.steps in ([0], [1])
    if opt._core.steps == [0]:
        assert torch.equal(p.detach(), before) and opt.totals["steps"] == 0
        opt.step()
    assert opt._core.steps == [1]
    ref_p, ref = make(tmp_path / "reference")
    ref.step()
    assert torch.equal(p.detach(), ref_p.detach())


def test_discard_removes_only_regular_files(tmp_path):
    # A swap file is a regular file. A device node (as root, discarding "/dev/null" deleted
    # the machine's), a pipe, a symbolic link or a folder at the path, or at its spare's, is
    # refused with ValueError naming it, and nothing is removed.
    s = tensormem.TensorSwapper(tensormem.PinnedPool())
    target = tmp_path / "target"
    target.write_text("kept")
    (tmp_path / "link").symlink_to(target)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    cases = {"link": "a symbolic link", "fifo": "a pipe", "dir": "a directory"}
    if os.geteuid() == 0:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        cases["null"] = "a device"
    real = tmp_path / "real"
    assert s.wait(s.swap_out([np.arange(100, dtype=np.uint8)], [str(real)]))[0]["error"] == 0
    os.mkfifo(str(real) + ".tensormem-spare")
    for name, kind in cases.items():
        path = tmp_path / name
        with pytest.raises(ValueError, match=re.escape(f"{path} is {kind}; only swap files")):
            s.discard(str(path))
        assert os.path.lexists(path)
    with pytest.raises(ValueError, match=re.escape(f"{real}.tensormem-spare is a pipe")):
        s.discard(str(real))
    assert real.exists() and target.read_text() == "kept"
    os.unlink(str(real) + ".tensormem-spare")
    s.discard(str(real))
    assert not real.exists()


# ----------------------------------------------------------------------------- fork

# Put before a forking script: `not_refused(calls)`, in a child, lists each (name, call) that
# does not raise ForkedChildError naming the parent (a RuntimeError), with what it did instead.
NOT_REFUSED = textwrap.dedent("""
    import os as _os
    import tensormem as _tensormem

    def not_refused(calls):
        wrong = []
        for name, call in calls:
            try:
                call()
                wrong.append(name + ": no error")
            except _tensormem.ForkedChildError as e:
                if "was made by process " + str(_os.getppid()) not in str(e) or not isinstance(e, RuntimeError):
                    wrong.append(name + ": " + str(e))
        return wrong
""")

# Put before a forking script: `release = held_by_a_thread(*locks)` returns once a thread of
# this process holds every lock (as a thread inside a long wait would); `release()` lets it go.
HELD_BY_A_THREAD = textwrap.dedent("""
    import threading as _threading

    def held_by_a_thread(*locks):
        taken, release = _threading.Event(), _threading.Event()

        def hold():
            for lock in locks:
                lock.acquire()
            taken.set()
            release.wait()
            for lock in reversed(locks):
                lock.release()

        t = _threading.Thread(target=hold)
        t.start()
        taken.wait()

        def let_go():
            release.set()
            t.join()
        return let_go
""")



def test_a_forked_child_is_refused_and_leaves_the_parents_objects_and_files_alone(tmp_path):
    # A script that forks while a swap-out and a write are in flight, as a data-loader worker
    # or a multiprocessing child would be forked. The child tries each object, then ends as
    # a script does (sys.exit: every object is dropped by the interpreter's teardown).
    script = NOT_REFUSED + textwrap.dedent(f"""
        import gc, os, sys
        import numpy as np, torch
        import tensormem
        from tensormem.deepspeed import aio_handle
        from tensormem.offload import OffloadedAdamW
        d = {str(tmp_path)!r}
        swapper = tensormem.TensorSwapper(tensormem.PinnedPool(slab_bytes=16 << 20), staging_buffers=4)
        big = np.random.default_rng(1).random(4 << 20)  # 32 MiB
        ticket = swapper.swap_out([big], [d + "/big"])
        handle = aio_handle(block_size=1 << 20, queue_depth=8)
        written = torch.arange(1 << 22, dtype=torch.float32)
        handle.async_pwrite(written, d + "/written")
        os.mkdir(d + "/state")
        p = torch.nn.Parameter(torch.randn(10000, generator=torch.Generator().manual_seed(2)))
        opt = OffloadedAdamW([p], swap_dirs=[d + "/state"], pinned_budget=1 << 22)
        p.grad = torch.ones_like(p)
        opt.step()
        files = sorted(opt.swap_files())
        pid = os.fork()
        if pid == 0:
            refused = not_refused([("swap_out", lambda: swapper.swap_out([big], [d + "/child"])),
                                   ("wait", lambda: swapper.wait(ticket)),
                                   ("done", lambda: swapper.done(ticket)),
                                   ("stats", lambda: swapper.stats()),
                                   ("aio", lambda: handle.async_pread(torch.empty(4), d + "/written")),
                                   ("step", lambda: opt.step())])
            print("child:", refused, flush=True)
            del swapper, handle, opt
            gc.collect()
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print("child status", status)
        print("swap", [r["error"] for r in swapper.wait(ticket)])
        back = np.empty_like(big)
        print("swap in", [r["error"] for r in swapper.wait(swapper.swap_in([d + "/big"], [back]))],
              np.array_equal(back, big))
        print("aio", handle.wait())
        print("files", all(os.path.exists(f) for f in files), os.path.exists(d + "/child"))
        p.grad = torch.ones_like(p)
        opt.step()
        print("stepped", int(opt.state_dict()["state"][0]["step"]))
        check = torch.empty_like(written)
        handle.async_pread(check, d + "/written")
        handle.wait()
        print("written", torch.equal(check, written))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "child: []" in lines, r.stdout
    assert "child status 0" in lines, r.stdout  # no crash, no hang in the child's teardown
    assert "swap [0]" in lines and "swap in [0] True" in lines, r.stdout
    assert "aio 1" in lines and "written True" in lines, r.stdout
    assert "files True False" in lines, r.stdout  # the child removed none of the parent's files
    assert "stepped 2" in lines, r.stdout


def test_a_forked_child_is_refused_even_while_a_parent_thread_held_the_aio_handles_locks(tmp_path):
    # A thread of the parent is inside the handle (its locks taken, as during a long wait)
    # when another thread forks. The child's copies of those locks stay taken: each call in
    # the child must be refused before it waits on one, not hang.
    script = NOT_REFUSED + HELD_BY_A_THREAD + textwrap.dedent(f"""
        import os, signal
        import torch
        import tensormem
        from tensormem.deepspeed import aio_handle
        d = {str(tmp_path)!r}
        handle = aio_handle(block_size=1 << 20, queue_depth=8)
        let_go = held_by_a_thread(handle._lock, handle._sync_lock)
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a hang ends the child by SIGALRM
            b = torch.zeros(1024)
            refused = not_refused([("wait", lambda: handle.wait()),
                                   ("async_pwrite", lambda: handle.async_pwrite(b, d + "/child")),
                                   ("sync_pread", lambda: handle.sync_pread(b, d + "/child")),
                                   ("write", lambda: handle.write(b, d + "/child", False)),
                                   ("read", lambda: handle.read(b, d + "/child", False))])
            print("child:", refused, os.path.exists(d + "/child"), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child status", status)
        let_go()
        x = torch.arange(4096, dtype=torch.float32)
        handle.async_pwrite(x, d + "/parent")
        print("parent", handle.wait())
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "child: [] False" in lines, r.stdout
    assert "child status 0" in lines, r.stdout  # 14 (SIGALRM) when a call waited on a lock
    assert "parent 1" in lines, r.stdout


def test_a_forked_child_frees_what_a_pinned_pool_gave_before_and_is_refused_new_allocations():
    # fork() passes no memory lock on: in a child the pool's slabs are not locked. The child
    # frees a buffer from before the fork, is refused a new one (ForkedChildError, not an
    # unlocked buffer called pinned), sees no locked bytes in the stats, and can make a pool
    # of its own. (The pool's lock across a fork while another thread is inside it:
    # pinned_pool_fork.* in the C++ tests.)
    script = NOT_REFUSED + textwrap.dedent("""
        import os, signal
        import tensormem
        pool = tensormem.PinnedPool(slab_bytes=1 << 20)
        mine = pool.allocate(4096)
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)  # a hang ends the child by SIGALRM
            mine.free()
            refused = not_refused([("allocate", lambda: pool.allocate(4096))])
            s = pool.stats()
            fresh = tensormem.PinnedPool(slab_bytes=1 << 20)
            b = fresh.allocate(4096)
            print("child:", refused, s["allocations"], s["locked_bytes"], fresh.stats()["locked_bytes"], flush=True)
            os._exit(0)
        print("child status", os.waitpid(pid, 0)[1])
        print("parent", pool.stats()["allocations"], mine.freed, pool.allocate(4096).freed,
              pool.stats()["locked_bytes"])
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert f"child: [] 0 0 {1 << 20}" in lines, r.stdout
    assert "child status 0" in lines, r.stdout
    assert f"parent 1 False False {1 << 20}" in lines, r.stdout


def test_deepspeeds_locked_tensors_work_in_a_forked_child():
    # DeepSpeed's pinned tensors are per process: a child forked from a process that made some
    # gets locked memory of its own (a new pool), even while a parent thread held the
    # manager's lock at the fork, and can free what it inherited. Where the parent's tensors
    # started CUDA (registered with it), the child cannot use CUDA: a new one is refused with
    # RuntimeError saying so (as torch's pin_memory is there), and the inherited one is freed.
    script = HELD_BY_A_THREAD + textwrap.dedent("""
        import os, signal
        import torch
        from tensormem import deepspeed as ds
        example = torch.empty(0, dtype=torch.float32)
        inherited = ds.new_cpu_locked_tensor(1024, example)
        inherited.fill_(3)
        let_go = held_by_a_thread(ds._PINNED._lock)
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)  # a hang ends the child by SIGALRM
            try:
                mine = ds.new_cpu_locked_tensor(1 << 20, example)
            except RuntimeError as e:
                print("child refused", "initialised CUDA" in str(e), ds.free_cpu_locked_tensor(inherited),
                      flush=True)
                os._exit(0)
            mine.fill_(1)
            s = ds._PINNED.stats()
            print("child", float(inherited.sum()), ds.free_cpu_locked_tensor(inherited),
                  ds.is_pinned(mine), s["locked_bytes"] > 0, s["allocations"], flush=True)
            os._exit(0)
        print("child status", os.waitpid(pid, 0)[1])
        let_go()
        print("parent", float(inherited.sum()), ds.is_pinned(inherited), ds._PINNED.stats()["allocations"])
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    child = "child refused True True" if torch.cuda.is_available() else "child 3072.0 True True True 1"
    assert child in lines, r.stdout + r.stderr
    assert "child status 0" in lines, r.stdout  # 14 (SIGALRM) when the child waited on the lock
    assert "parent 3072.0 True 1" in lines, r.stdout


def test_tensors_whose_memory_is_not_their_values_are_refused_by_the_swapper(tmp_path):
    # A conjugate or negative view reads its memory through an operation, a sparse tensor has
    # no one block: swapping the memory would save or fill other values than the tensor's.
    s = tensormem.TensorSwapper(tensormem.PinnedPool(slab_bytes=1 << 20))
    z = torch.complex(torch.arange(256.0), torch.ones(256))
    path = str(tmp_path / "t")
    for tensor, message in [(z.conj(), r"a conjugate view \(is_conj\(\).*resolve_conj"),
                            (torch._neg_view(torch.arange(256.0)), r"a negative view \(is_neg\(\).*resolve_neg"),
                            (torch.arange(256.0).to_sparse(), r"layout torch\.sparse_coo has no one block")]:
        with pytest.raises(ValueError, match=message):
            s.swap_out([tensor], [path])
        assert not os.path.exists(path)
    assert s.wait(s.swap_out([z], [path]))[0]["error"] == 0
    target = torch.zeros_like(z)
    for view, message in [(target.conj(), "a conjugate view"), (torch._neg_view(target), "a negative view")]:
        with pytest.raises(ValueError, match=message):
            s.swap_in([path], [view])
    assert torch.equal(target, torch.zeros_like(z))  # nothing was read into it
    assert s.wait(s.swap_in([path], [target]))[0]["error"] == 0 and torch.equal(target, z)


def test_the_swappers_threads_survive_an_address_space_limit(tmp_path):
    # Under RLIMIT_AS set just above what the process maps (4 KiB steps), allocations fail on
    # the swapper's own threads. They throw std::bad_alloc and handle it (a pack's committer
    # frees a slot by walking its blocks when the index cannot be made); a thread's first throw
    # used to need memory of its own (the C++ runtime's thread-local state, loaded with this
    # module after the interpreter started), and the C library ended the process with "cannot
    # allocate memory for thread-local data" (exit 127). Every version read back is the last
    # one whose swap-out succeeded.
    script = textwrap.dedent(f"""
        import resource
        import numpy as np
        import tensormem
        d = {str(tmp_path)!r}
        sw = tensormem.TensorSwapper(tensormem.PinnedPool(), pack_below=1 << 20)
        xs = [np.arange(20000, dtype=np.float32) + i for i in range(8)]
        paths = [f"{{d}}/t{{i}}" for i in range(8)]
        assert all(r["error"] == 0 for r in sw.wait(sw.swap_out(xs, paths)))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        def mapped():
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
        version = [0] * 8
        failed = 0
        for k in range(0, 400, 3):
            ys = [np.zeros(20000, dtype=np.float32) for _ in range(8)]
            zs = [x + np.float32(k + 1) for x in xs]
            resource.setrlimit(resource.RLIMIT_AS, (mapped() + k * 4096, hard))
            try:
                results = sw.wait(sw.swap_out(zs, paths))
            except MemoryError:
                results = None
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            for i, r in enumerate(results or []):
                if r["error"] == 0:
                    version[i] = k + 1
                else:
                    assert r["error"] == 12 and r["message"], r
                    failed += 1
            assert all(r["error"] == 0 for r in sw.wait(sw.swap_in(paths, ys)))
            for i in range(8):
                assert (ys[i] == xs[i] + np.float32(version[i])).all(), (k, i)
        print("ok", failed)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.startswith("ok"), r.stdout


def test_a_torch_extension_that_could_not_be_loaded_for_memory_is_loaded_again(monkeypatch):
    # Under a tight address-space limit the loader cannot map the extension ("failed to map
    # segment from shared object"): that transfer goes without a size hold (and says so), and
    # the next one loads it and holds again. A missing extension stays missing, asked once.
    from tensormem import _storage_hold, model
    extension, why = model.torch_extension()
    if extension is None:
        pytest.skip(why)
    calls = []

    def out_of_memory_once():
        calls.append(1)
        if len(calls) == 1:
            return None, "tensormem's PyTorch extension is not built (...: failed to map segment from shared object)"
        return extension, ""

    monkeypatch.setattr(model, "torch_extension", out_of_memory_once)
    monkeypatch.setattr(_storage_hold, "_factory", None)
    monkeypatch.setattr(_storage_hold, "_problem", None)
    monkeypatch.setattr(_storage_hold, "_warned", "")
    storage = torch.zeros(16).untyped_storage() if hasattr(torch.Tensor, "untyped_storage") else \
        torch.zeros(16).storage()
    with pytest.warns(RuntimeWarning, match="failed to map segment"):
        assert _storage_hold.hold(storage) is storage  # nothing held this time
    held = _storage_hold.hold(storage)
    assert held is not storage and isinstance(held, extension.StorageSizeHold)
    assert _storage_hold.problem() == "" and len(calls) == 2

    monkeypatch.setattr(model, "torch_extension", lambda: (calls.append(1), (None, "not built"))[1])
    monkeypatch.setattr(_storage_hold, "_factory", None)
    monkeypatch.setattr(_storage_hold, "_problem", None)
    with pytest.warns(RuntimeWarning, match="not built"):
        assert _storage_hold.hold(storage) is storage
    assert _storage_hold.hold(storage) is storage and len(calls) == 3  # kept: not asked again


def test_plan_without_a_thread_to_start_plans_on_the_calling_thread(tmp_path):
    # With an address-space limit too small for a thread's stack, neither the module's
    # planner thread nor the planner's own helpers can start: the plan is made on the calling
    # thread, valid, and "fallback" says so. Before, plan() raised BlockingIOError
    # "[Errno 11] Resource temporarily unavailable".
    script = textwrap.dedent("""
        import os, resource
        import numpy as np
        import tensormem
        rng = np.random.default_rng(1)
        lower = rng.integers(0, 3000, 300)
        upper = lower + rng.integers(1, 300, 300)
        size = rng.integers(1, 1 << 20, 300)
        with open("/proc/self/status") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (2 << 20), hard))  # no room for an 8 MiB stack
        try:
            r = tensormem.plan(lower, upper, size, time_limit=0.5)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        print(repr(tensormem.validate(lower, upper, size, r["offsets"], r["arena_bytes"])))
        print(r["fallback"])
        print(os.cpu_count())
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    valid, fallback, cpus = r.stdout.splitlines()
    assert valid == "''", valid
    assert fallback.startswith("the planner's thread could not be started (Resource temporarily unavailable)"), \
        fallback
    if int(cpus) > 1:  # the planner asks for helper threads only where there are cores for them
        assert "a planner thread could not be started: Resource temporarily unavailable; planned on the " \
               "calling thread alone" in fallback, fallback

