"""tensormem from Python: numpy and PyTorch without copies, DeepSpeed-style scenarios,
error mapping, the planner and the swapper."""

import builtins
import errno
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
import torch.utils.dlpack

import tensormem
from tensormem.torch import AsyncTensorSwapper, ContiguousMemoryAllocator

TRACES = pathlib.Path(__file__).resolve().parents[1] / "data" / "traces"


# ----------------------------------------------------------------------------- allocators

@pytest.mark.parametrize("cls", [tensormem.BestFitAllocator, tensormem.TlsfAllocator])
def test_allocators_reuse_and_report_misuse(cls):
    a = cls()
    x = a.allocate(1000)
    y = a.allocate(3000)
    assert (x.offset, x.bytes, y.offset) == (0, 1024, 1024)
    a.free(y.offset, 3000)
    assert a.allocate(3000).offset == 1024
    with pytest.raises(ValueError, match="cannot free offset 5"):
        a.free(5, 10)
    # The largest offset holds nothing, even with the size of the block at offset 0.
    with pytest.raises(ValueError, match="cannot free offset 18446744073709551615"):
        a.free(2**64 - 1, 1024)
    assert a.stats()["live_allocations"] == 2
    fixed = cls(4096, 256)
    assert fixed.allocate(8192) is None
    assert a.check_invariants() == ""
    assert a.stats()["used_bytes"] == 1024 + 3072


@pytest.mark.parametrize("cls", [tensormem.BestFitAllocator, tensormem.TlsfAllocator])
def test_allocator_reserve(cls):
    a = cls()
    x = a.allocate(1000)
    a.reserve(1000)
    a.reserve(10)  # never shrinks; nothing changes
    held = [a.allocate(256 * (1 + i % 7)) for i in range(400)]
    for h in held[::2]:
        a.deallocate(h)
    assert a.stats()["live_allocations"] == 201
    for bad in (2**32 - 18, 2**64 - 1):
        with pytest.raises(ValueError, match="too many blocks"):
            a.reserve(bad)
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="expected a whole number"):
            a.reserve(bad)
    for bad in (1.5, True, "8"):
        with pytest.raises(TypeError):
            a.reserve(bad)
    assert a.check_invariants() == ""
    assert a.stats()["live_allocations"] == 201 and a.stats()["used_bytes"] == x.bytes + sum(
        h.bytes for h in held[1::2])


@pytest.mark.parametrize("cls", [tensormem.BestFitAllocator, tensormem.TlsfAllocator])
def test_a_reserve_past_the_process_memory_is_refused_and_a_fixed_arena_caps_it(cls):
    # The nodes are made (their pages touched) by reserve: past the process's memory the
    # out-of-memory killer would end the interpreter, so such a count is refused first.
    a = cls()
    x = a.allocate(1000)
    blocks = tensormem.physical_memory_bytes() // cls.reserve_bytes_per_block + 1
    if blocks <= 2**32 - 19:
        t0 = time.monotonic()
        with pytest.raises(MemoryError, match=r"\.reserve: %d blocks need about \d+ bytes of memory \(about %d a block\), more than the %d "
                           r"bytes this process can have" % (blocks, cls.reserve_bytes_per_block,
                                                               tensormem.physical_memory_bytes())):
            a.reserve(blocks)
        assert time.monotonic() - t0 < 1.0
    most = 2**32 - 19  # the largest count taken: checked against the memory too
    if most * cls.reserve_bytes_per_block > tensormem.physical_memory_bytes():
        with pytest.raises(MemoryError, match=r"\.reserve: %d blocks need about" % most):
            a.reserve(most)
    with pytest.raises(ValueError):
        a.reserve(most + 1)
    a.reserve(1000)
    assert a.check_invariants() == "" and a.stats()["live_allocations"] == 1
    a.deallocate(x)
    # A fixed capacity holds one block per alignment unit at most: a larger count is cut to
    # that (no error, no memory beyond it), and the arena can then be tiled with its
    # smallest blocks.
    fixed = cls(16 * 4096, 4096)
    fixed.reserve(2**32 - 18)
    fixed.reserve(2**40)
    held = [fixed.allocate(1) for _ in range(16)]
    assert all(h is not None for h in held) and fixed.allocate(1) is None
    for h in held[::2]:
        fixed.deallocate(h)
    assert fixed.stats()["free_blocks"] == 8 and fixed.check_invariants() == ""


# ----------------------------------------------------------------------------- planner

def test_plan_and_validate_with_numpy():
    t = tensormem.read_trace(str(TRACES / "minimalloc_C.csv"))
    assert len(t["id"]) == 203 and t["size"].dtype == np.uint64
    p = tensormem.plan(t["lower"], t["upper"], t["size"], time_limit=5)
    assert p["arena_bytes"] == p["lower_bound"] == tensormem.lower_bound(t["lower"], t["upper"], t["size"])
    assert p["optimal"] is True
    assert tensormem.validate(t["lower"], t["upper"], t["size"], p["offsets"], p["arena_bytes"]) == ""
    bad = p["offsets"].copy()
    bad[:] = 0
    assert "overlap" in tensormem.validate(t["lower"], t["upper"], t["size"], bad, int(t["size"].max()))


def test_an_optimum_above_the_lower_bound_is_proven_and_returned_before_the_limit():
    t = tensormem.read_trace(str(pathlib.Path(__file__).parent.parent / "data" / "above_lower_bound_trace.csv"))
    p = tensormem.plan(t["lower"], t["upper"], t["size"], time_limit=10)
    assert p["lower_bound"] == 4 << 20 and p["arena_bytes"] == 5 << 20
    assert p["optimal"] is True and p["seconds"] < 5
    assert tensormem.validate(t["lower"], t["upper"], t["size"], p["offsets"], p["arena_bytes"]) == ""
    assert tensormem.plan(t["lower"], t["upper"], t["size"], time_limit=0)["optimal"] is False  # no search run


def test_a_trace_that_cannot_be_opened_is_an_os_error_with_its_errno(tmp_path):
    missing = tmp_path / "missing.csv"
    with pytest.raises(FileNotFoundError, match=r"missing\.csv:0: cannot open: No such file or directory") as e:
        tensormem.read_trace(str(missing))
    assert e.value.errno == errno.ENOENT
    with pytest.raises(ValueError, match=r":0: not a regular file or a pipe"):  # (a folder: no trace at all)
        tensormem.read_trace(str(tmp_path))


def test_malformed_trace_is_a_value_error(tmp_path):
    f = tmp_path / "bad.csv"
    f.write_text("id,lower,upper,size\na,3,3,10\n")
    with pytest.raises(ValueError, match=r"bad\.csv:2: lower 3 is not below upper 3"):
        tensormem.read_trace(str(f))


def test_trace_ids_are_text_exactly_when_python_decodes_them(tmp_path):
    """Random byte ids against Python's own UTF-8 decoder: an id is read back as the same str
    exactly when Python decodes it and it holds no control character; otherwise the error
    names the file and line, in a message Python can show (a byte 0xFF in it used to give a
    ValueError with an empty message)."""
    import random
    rng = random.Random(11)
    alphabet = [bytes([b]) for b in range(256) if b not in b",\n\r \t"] + \
        ["é".encode(), "€".encode(), "😀".encode(), b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80"]
    f = tmp_path / "t.csv"
    accepted = refused = 0
    for _ in range(1500):
        raw = b"x" + b"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        f.write_bytes(b"id,lower,upper,size\nfirst,0,1,4\n" + raw + b",0,1,4\n")
        try:
            text = raw.decode("utf-8")
            expected = None if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text) else text
        except UnicodeDecodeError:
            expected = None
        if expected is None:
            with pytest.raises(ValueError, match=r"t\.csv:3: the id '.*' is not UTF-8 text without control characters"):
                tensormem.read_trace(str(f))
            refused += 1
        else:
            assert tensormem.read_trace(str(f))["id"] == ["first", expected]
            accepted += 1
    assert accepted > 150 and refused > 150


def test_a_trace_is_read_from_a_pipe_that_another_thread_writes(tmp_path):
    """read_trace lets other threads run while it reads: the writer of a pipe may be one
    (it used to keep the interpreter's lock while opening the pipe, and both waited forever)."""
    import threading
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def write():
        with open(fifo, "w") as out:
            out.write("id,lower,upper,size\na,0,2,8\nb,1,3,4\n")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    result = {}
    reader = threading.Thread(target=lambda: result.update(tensormem.read_trace(str(fifo))), daemon=True)
    reader.start()
    reader.join(timeout=30)
    writer.join(timeout=1)
    assert not reader.is_alive(), "read_trace and the pipe's writer wait on each other"
    assert result["id"] == ["a", "b"] and list(result["size"]) == [8, 4]


def test_a_signal_while_a_pipe_waits_for_its_other_end_runs_the_handler_and_the_call_goes_on(tmp_path):
    """A signal to the thread that waits in read_trace for a pipe's writer, or in
    write_plan_picture for its reader: as Python's own calls (PEP 475), the handler runs and
    the wait goes on, and the trace is read (the picture written); a handler that raises ends
    the call with its exception (Ctrl-C: KeyboardInterrupt), not with an InterruptedError. Run
    in a child, whose main thread reads and writes."""
    script = textwrap.dedent(f"""
        import os, signal, threading, time
        import tensormem
        fifo = {str(tmp_path / "fifo")!r}
        os.mkfifo(fifo)
        main = threading.get_ident()
        calls = []
        signal.signal(signal.SIGUSR1, lambda *_: calls.append(time.monotonic()))

        def poke_then_write():
            for _ in range(3):
                time.sleep(0.1)
                signal.pthread_kill(main, signal.SIGUSR1)
            time.sleep(0.1)
            with open(fifo, "w") as out:
                out.write("id,lower,upper,size\\na,0,2,8\\n")

        threading.Thread(target=poke_then_write, daemon=True).start()
        print(tensormem.read_trace(fifo)["id"], len(calls))
        threading.Timer(0.2, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
        try:
            tensormem.read_trace(fifo)  # no writer this time
        except KeyboardInterrupt as e:
            print("KeyboardInterrupt", repr(e.__context__))

        drawn = []

        def poke_then_read():
            for _ in range(2):
                time.sleep(0.1)
                signal.pthread_kill(main, signal.SIGUSR1)
            time.sleep(0.1)
            with open(fifo) as f:
                drawn.append(f.read())

        reader = threading.Thread(target=poke_then_read, daemon=True)
        reader.start()
        print(repr(tensormem.write_plan_picture(fifo, [0], [2], [8], [0], 8, 8)), len(calls))
        reader.join(timeout=10)
        print(drawn[0].startswith("<svg") and drawn[0].rstrip().endswith("</svg>"))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["['a'] 3", "KeyboardInterrupt None", "'' 5", "True"], r.stdout


# ----------------------------------------------------------------------------- pinned pool

def test_pinned_buffers_cross_without_copies():
    pool = tensormem.PinnedPool(slab_bytes=1 << 20)
    buf = pool.allocate(8192)
    writable = np.frombuffer(buf, dtype=np.uint8)        # buffer protocol
    writable[:] = 3
    via_numpy = np.from_dlpack(buf)                       # DLPack (numpy marks it read-only)
    via_torch = torch.utils.dlpack.from_dlpack(buf)       # DLPack
    assert writable.ctypes.data == via_numpy.ctypes.data == via_torch.data_ptr() == buf.address
    via_torch[10] = 99
    assert writable[10] == 99 and via_numpy[10] == 99
    assert buf.address % 4096 == 0
    stats = pool.stats()
    assert stats["allocations"] == 1 and stats["locked_bytes"] >= 1 << 20
    assert stats["current_slab_bytes"] == 1 << 20  # no memory-lock limit refused a slab here
    calls = stats["system_calls"]
    more = [pool.allocate(1000) for _ in range(10)]
    assert pool.stats()["system_calls"] == calls          # fits the slab: no system call
    for m in more:
        m.free()
    assert pool.stats()["allocations"] == 1


def test_a_pinned_pool_reports_its_slabs_and_trims_the_empty_ones():
    pool = tensormem.PinnedPool(slab_bytes=1 << 20)
    keep = pool.allocate(4096)
    big = [pool.allocate((1 << 20) + 4096) for _ in range(2)]  # more than a slab: a slab of its own each
    extra = [pool.allocate(600 << 10) for _ in range(2)]  # one in the first slab, one in a second
    s = pool.stats()
    assert s["total_allocations"] == 5 and s["allocations"] == 5
    assert s["slab_bytes"] == s["locked_bytes"] and s["slab_bytes"] >= 4 << 20
    assert s["peak_in_use_bytes"] >= s["in_use_bytes"] > 2 << 20
    for b in big + extra:
        b.free()
    assert pool.stats()["slabs"] == 2  # the shared slabs stay for reuse
    pool.trim()
    s = pool.stats()
    assert s["slabs"] == 1 and s["slab_bytes"] == s["locked_bytes"] == 1 << 20  # the one `keep` is in
    assert s["peak_in_use_bytes"] > s["in_use_bytes"] == 4096
    keep.free()
    pool.trim()
    assert pool.stats()["slabs"] == 0 and pool.stats()["locked_bytes"] == 0


def test_other_python_threads_run_while_a_pinned_pool_maps_or_unmaps_a_slab_or_a_swapper_is_made():
    # allocate and free let the GIL go while a slab is mapped, populated and locked, or
    # unmapped (0.3 s and 0.06 s for 512 MiB here): a Python thread that notes the time in a
    # loop never stops for as long as such a call lasts. (Holding the GIL, a call would stop
    # it for its whole length.)
    pool = tensormem.PinnedPool(slab_bytes=1 << 20)

    def longest_pause_beside(calls):
        # The thread keeps only its longest pause: growing a list would fault in pages, which
        # waits for the mapping's own kernel lock whatever the GIL does.
        longest, stop = [0.0], threading.Event()

        def note():
            last = time.perf_counter()
            while not stop.is_set():
                now = time.perf_counter()
                longest[0] = max(longest[0], now - last)
                last = now

        t = threading.Thread(target=note)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)
        t.start()
        took = []
        try:
            time.sleep(0.05)  # (the thread is running)
            for call in calls:
                start = time.perf_counter()
                call()
                took.append(time.perf_counter() - start)
        finally:
            stop.set()
            t.join()
            sys.setswitchinterval(interval)
        return longest[0], took

    # A call that held the GIL would stop the thread for all of the call but the switch interval
    # after it (the caller gives the GIL up when the thread has asked for it that long, then waits
    # that long to take it back): here 0.5 ms, so that such a pause is almost the whole call. A
    # pause shorter than three quarters of every call shows that the thread ran while each call
    # lasted. Five tries, for a busy machine (both cores taken by other tests and builds) that
    # holds the thread off on its own; holding the GIL, no try can pass.
    seen = []
    for _ in range(5):
        buffers = []
        allocated = longest_pause_beside([lambda: buffers.append(pool.allocate(512 << 20))] * 2)
        freed = longest_pause_beside([b.free for b in buffers])
        assert pool.stats()["slabs"] == 0
        # A swapper's staging buffers (here 2 x 256 MiB, slabs of their own) are taken the same way,
        # and given back the same way when it is destroyed (each measured apart: a call that held
        # the GIL while the other let it go would otherwise pass for one that never held it).
        swappers = []
        made = longest_pause_beside([lambda: swappers.append(
            tensormem.TensorSwapper(pool, staging_buffers=2, block_bytes=256 << 20))] * 2)
        destroyed = longest_pause_beside([swappers.pop] * 2)  # (each destroyed as its call returns)
        # A swapper also takes a small buffer from a shared slab, which stays, empty, until
        # trim(): given back here so that the next try starts, as the first, with no slab.
        pool.trim()
        seen.append((allocated, freed, made, destroyed))
        if all(pause < 0.75 * min(took) for pause, took in (allocated, freed, made, destroyed)):
            break
    else:
        raise AssertionError(f"another thread waited as long as a call (pause, durations): {seen}")


def test_out_of_memory_is_a_memory_error():
    pool = tensormem.PinnedPool(slab_bytes=1 << 20)
    with pytest.raises(MemoryError):
        pool.allocate(1 << 52)


# ----------------------------------------------------------------------------- DeepSpeed-style arena

def test_deepspeed_scenario_with_half_tensors_and_params():
    cma = ContiguousMemoryAllocator(1024, torch.half, "cpu")
    t1 = cma.allocate_tensor(256)
    t2 = cma.allocate_tensor(256)
    t3 = cma.allocate_tensor(256)
    t4 = cma.allocate_tensor(256)
    for i, t in enumerate([t1, t2, t3, t4]):
        t.copy_(torch.arange(256, dtype=torch.half) + i)
    base = cma.buffer.data_ptr()
    assert t1.data_ptr() == base  # a view of the arena buffer, no copy
    p3 = torch.nn.Parameter(torch.empty(0, dtype=torch.half))
    cma.assign_to_param(t3, p3, 256, (16, 16))
    assert p3.data_ptr() == t3.data_ptr()
    cma.release_tensor(t2)
    cma.release_tensor(t4)
    # 512 elements free in two holes of 256: a 512-element tensor forces a defragmentation.
    t5 = cma.allocate_tensor(512)
    t5.fill_(7)
    assert cma.stats()["defragmentations"] == 1
    assert torch.equal(t1, torch.arange(256, dtype=torch.half))
    assert torch.equal(t3, torch.arange(256, dtype=torch.half) + 2)       # moved, same values
    assert torch.equal(p3.data.flatten(), t3) and p3.data_ptr() == t3.data_ptr()
    assert p3.shape == (16, 16)
    assert cma.max_allocated() == 1024
    with pytest.raises(MemoryError):
        cma.allocate_tensor(1)


def test_tensors_without_params_move_too_and_released_params_are_detached():
    cma = ContiguousMemoryAllocator(64, torch.float32)
    a = cma.allocate_tensor(16)
    b = cma.allocate_tensor(16)
    c = cma.allocate_tensor(16)   # no param bound: DeepSpeed raised KeyError here
    c.fill_(5)
    pb = torch.nn.Parameter(torch.empty(0))
    cma.assign_to_param(b, pb, 16, (4, 4))
    cma.release_tensor(a)
    d = cma.allocate_tensor(32)   # 48 free: 16 + 32 in two holes -> defragment
    assert cma.stats()["defragmentations"] == 1
    assert torch.all(c == 5)
    cma.release_tensor(b)
    assert pb.numel() == 0        # detached, not pointing into memory handed out again
    with pytest.raises(ValueError):
        cma.release_tensor(b)
    with pytest.raises(ValueError):
        cma.release_tensor_with_id(12345)
    assert d.numel() == 32


def test_zero_size_tensors_do_not_corrupt_bookkeeping():
    cma = ContiguousMemoryAllocator(32, torch.half)
    z = cma.allocate_tensor(0)
    x = cma.allocate_tensor(32)
    assert z.numel() == 0 and x.numel() == 32
    cma.release_tensor(z)
    cma.release_tensor(x)
    assert cma.stats()["used_bytes"] == 0


def test_print_allocation(capsys):
    cma = ContiguousMemoryAllocator(100, torch.half)
    cma.allocate_tensor(50)
    cma.print_allocation(resolution=10)
    assert capsys.readouterr().out.strip() == "|||||....."


def test_allocation_svg(tmp_path):
    cma = ContiguousMemoryAllocator(1024, torch.float32)  # 4 KiB
    a = cma.allocate_tensor(100)
    b = cma.allocate_tensor(300)
    cma.release_tensor(a)
    path = tmp_path / "map.svg"
    svg = cma.allocation_svg(str(path))
    assert path.read_text() == svg
    assert svg.startswith("<svg ") and svg.rstrip().endswith("</svg>")
    # One tensor left (b: 1200 bytes after a's 400, element-aligned), the used bytes and the
    # largest hole (4096 - 1600 = 2496 bytes) in the row's label.
    assert svg.count('class="tensor"') == 1
    assert ": offset 400, 1200 bytes (1200 reserved)</title>" in svg
    assert "1 tensors, used 1.17 KiB, free 2.83 KiB, largest hole 2.44 KiB" in svg
    # A picture that cannot be written whole (past the largest file this process may write)
    # leaves the one there.
    import errno
    from file_limits import file_size_limit
    c = cma.allocate_tensor(10)
    with file_size_limit(len(svg) // 2), pytest.raises(OSError) as info:
        cma.allocation_svg(str(path))
    assert info.value.errno == errno.EFBIG and f"cannot write {path}" in str(info.value)
    assert path.read_text() == svg and os.listdir(tmp_path) == ["map.svg"]
    del b, c


# ----------------------------------------------------------------------------- swapper

def test_swapper_round_trip_numpy_and_torch(tmp_path):
    pool = tensormem.PinnedPool(slab_bytes=16 << 20)
    swapper = tensormem.TensorSwapper(pool, queue_depth=8, staging_buffers=4)
    a = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)
    t = torch.randn(100_003)
    paths = [str(tmp_path / "a"), str(tmp_path / "t")]
    results = swapper.wait(swapper.swap_out([a, t.numpy()], paths))
    assert [r["error"] for r in results] == [0, 0]
    a_back = np.zeros_like(a)
    t_back = torch.zeros_like(t)
    results = swapper.wait(swapper.swap_in(paths, [a_back, t_back.numpy()]))
    assert [r["error"] for r in results] == [0, 0]
    assert np.array_equal(a, a_back) and torch.equal(t, t_back)
    missing = swapper.wait(swapper.swap_in([str(tmp_path / "never")], [a_back]))
    assert missing[0]["error"] == errno.ENOENT
    s = swapper.stats()
    assert s["tensors_out"] == 2 and s["checksums"] is True


def test_a_swap_in_counts_as_an_in_place_change_for_autograd(tmp_path):
    """A swap-in into a torch tensor changes its values in place: its version counts it, as
    copy_'s would, so that a backward through values saved before it is refused instead of
    computing with the file's values. A swap-out, a refused swap-in and a numpy array's
    swap-in count nothing; an inference tensor (no version) is swapped into all the same."""
    swapper = tensormem.TensorSwapper(tensormem.PinnedPool(slab_bytes=16 << 20), queue_depth=8, staging_buffers=4)
    path = str(tmp_path / "x")
    saved = torch.arange(1000, dtype=torch.float32)
    assert swapper.wait(swapper.swap_out([saved], [path]))[0]["error"] == 0
    assert saved._version == 0
    w = torch.ones(1000, requires_grad=True)
    x = torch.zeros(1000)
    loss = (w * x).sum()  # saves x (zeros) for w's gradient
    with pytest.raises(ValueError, match="appears twice"):
        swapper.swap_in([path, path], [x, torch.zeros(1000)])
    assert x._version == 0  # refused: nothing counted
    ticket = swapper.swap_in([path], [x])
    assert x._version == 1  # counted once queued, before the wait
    assert swapper.wait(ticket)[0]["error"] == 0 and torch.equal(x, saved)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # Through x.data (an alias with a version of its own), as x.data.copy_ does: x's memory
    # written without autograd's notice, for code that means to.
    x = torch.zeros(1000)
    loss = (w * x).sum()
    assert swapper.wait(swapper.swap_in([path], [x.data]))[0]["error"] == 0
    assert x._version == 0 and torch.equal(x, saved)
    loss.backward()
    assert torch.equal(w.grad, saved)  # (the values there when the backward ran)
    # A leaf that requires grad (a parameter swapped back in) and a view: counted on the
    # tensor they share it with, as an in-place operation under no_grad is.
    p = torch.nn.Parameter(torch.zeros(2000))
    assert swapper.wait(swapper.swap_in([path], [p[1000:]]))[0]["error"] == 0
    assert p._version == 1 and torch.equal(p[1000:].detach(), saved)
    with torch.inference_mode():
        frozen = torch.zeros(1000)
    assert swapper.wait(swapper.swap_in([path], [frozen]))[0]["error"] == 0 and torch.equal(frozen, saved)
    array = np.zeros(1000, dtype=np.float32)
    assert swapper.wait(swapper.swap_in([path], [array]))[0]["error"] == 0 and np.array_equal(array, saved.numpy())


def test_packed_small_tensors_round_trip_without_files(tmp_path):
    pool = tensormem.PinnedPool(slab_bytes=16 << 20)
    swapper = tensormem.TensorSwapper(pool, queue_depth=8, staging_buffers=4, pack_below=1 << 16)
    rng = np.random.default_rng(3)
    small = [torch.from_numpy(rng.standard_normal(int(n)).astype(np.float32)) for n in rng.integers(1, 16384, 50)]
    large = torch.randn(20_000)  # 80,000 bytes: above pack_below, a file of its own
    paths = [str(tmp_path / f"s{i}") for i in range(len(small))] + [str(tmp_path / "large")]
    results = swapper.wait(swapper.swap_out([t.numpy() for t in small] + [large.numpy()], paths))
    assert all(r["error"] == 0 for r in results)
    assert [p for p in paths if os.path.exists(p)] == [paths[-1]]
    back = [torch.zeros_like(t) for t in small] + [torch.zeros_like(large)]
    results = swapper.wait(swapper.swap_in(paths, [t.numpy() for t in back]))
    assert all(r["error"] == 0 for r in results)
    assert all(torch.equal(a, b) for a, b in zip(small + [large], back))
    assert swapper.stats()["packed_tensors"] == len(small)
    swapper.discard(paths[0])
    assert swapper.stats()["packed_tensors"] == len(small) - 1
    missing = swapper.wait(swapper.swap_in([paths[0]], [back[0].numpy()]))
    assert missing[0]["error"] == errno.ENOENT


def test_async_tensor_swapper_deepspeed_api(tmp_path):
    swapper = AsyncTensorSwapper()
    swapper.add_buffers([torch.empty(4 << 20, dtype=torch.uint8)])
    tensors = [torch.randn(1000 + i) for i in range(5)]
    copies = [t.clone() for t in tensors]
    paths = [tmp_path / f"p{i}.swp" for i in range(5)]
    swapper.swap_out_tensors(tensors, paths)
    swapper.synchronize()
    assert swapper.timer("swap_out") > 0 and swapper.timer("swap_in") == 0
    waited = swapper.timer("wait")
    assert waited > 0
    for t in tensors:
        t.zero_()
    swapper.swap_in_tensors(paths, tensors)
    swapper.synchronize()
    assert all(torch.equal(t, c) for t, c in zip(tensors, copies))
    assert set(swapper.get_timer_names()) == {"swap_out", "swap_in", "wait"}
    assert swapper.timer("swap_in") > 0 and swapper.timer("wait") > waited  # seconds summed over calls
    waited = swapper.timer("wait")
    swapper.swap_in_tensors([tmp_path / "absent"], [tensors[0]])
    with pytest.raises(OSError) as info:
        swapper.synchronize()
    assert info.value.errno == errno.ENOENT
    assert swapper.timer("wait") > waited  # a failed wait is timed too
    with pytest.raises(KeyError):
        swapper.timer("swap")
    swapper.release_buffers()


def test_a_swapper_it_cannot_work_with_is_refused_when_made():
    pool = tensormem.PinnedPool(slab_bytes=4 << 20)
    for depth in (0, 32769):
        with pytest.raises(ValueError, match=f"queue_depth must be 1 to 32768, not {depth}"):
            tensormem.TensorSwapper(pool, queue_depth=depth)
    for count in (0, 1):
        with pytest.raises(ValueError, match=f"staging_buffers must be at least 2 .*, not {count}"):
            tensormem.TensorSwapper(pool, staging_buffers=count)
    assert pool.stats()["allocations"] == 0
    tensormem.TensorSwapper(pool, queue_depth=1, block_bytes=4096, staging_buffers=2)


def test_async_tensor_swapper_names_misuse_at_the_call(tmp_path):
    swapper = AsyncTensorSwapper()
    # paths and tensors swapped: named, not "'str' object has no attribute 'device'"
    with pytest.raises(TypeError, match="expected torch tensors, not str .*swap_in_tensors paths then tensors"):
        swapper.swap_in_tensors([torch.empty(4)], [str(tmp_path / "a")])
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        swapper.swap_out_tensors([torch.zeros(4, 4).t()], [str(tmp_path / "b")])
    with pytest.raises(ValueError, match="tensors must be dense \\(strided\\), not torch.sparse_coo"):
        swapper.swap_out_tensors([torch.arange(4.0).to_sparse()], [str(tmp_path / "b")])
    # a queue io_uring cannot have is refused when made, not at the first transfer
    for depth in (0, 32769):
        with pytest.raises(ValueError, match=f"queue_depth must be 1 to 32768, not {depth}"):
            AsyncTensorSwapper(queue_depth=depth)
    # So are staging blocks it cannot use and an unknown engine (add_buffers divided by 0)
    assert tensormem.SWAP_BLOCK_ALIGNMENT == 4096
    for block in (0, -4096, 1000):
        with pytest.raises(ValueError, match=f"block_bytes must be a positive multiple of 4096, not {block}"):
            AsyncTensorSwapper(block_bytes=block)
    with pytest.raises(ValueError, match="engine must be 'uring' or 'threads', not 'aio'"):
        AsyncTensorSwapper(engine="aio")
    with pytest.raises(ValueError, match="numel_alignment must be positive, not 0"):
        AsyncTensorSwapper(numel_alignment=0)
    # and fractional sizes, not truncated
    for name in ("queue_depth", "block_bytes", "numel_alignment"):
        with pytest.raises(TypeError):
            AsyncTensorSwapper(**{name: 8192.5})
    made = AsyncTensorSwapper(queue_depth=np.int32(4), block_bytes=np.int64(8192), engine="threads")
    made.add_buffers([torch.empty(3 * 8192, dtype=torch.uint8)])
    made.swap_out_tensors([torch.arange(5000, dtype=torch.float32)], [str(tmp_path / "made")])
    made.synchronize()
    back = torch.empty(5000, dtype=torch.float32)
    made.swap_in_tensors([str(tmp_path / "made")], [back])
    made.synchronize()
    assert torch.equal(back, torch.arange(5000, dtype=torch.float32))
    assert made.stats()["engine"] == "threads"
    made.release_buffers()
    (tmp_path / "made").unlink()
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- example

def test_example_script_runs():
    example = pathlib.Path(os.environ.get("TENSORMEM_EXAMPLES", pathlib.Path(__file__).resolve().parents[2] / "examples" / "python")) / "deepspeed_style.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "values intact after defragmentation: True" in out.stdout


# ----------------------------------------------------------------------------- type stubs

def _pybind_parameters(function):
    """Parameter names from the signature pybind11 writes as the docstring's first line."""
    first = (function.__doc__ or "").strip().splitlines()[0]
    inside = first[first.index("(") + 1:first.rindex(") ->")]
    names, depth, current = [], 0, ""
    for ch in inside:
        depth += ch in "[(" and 1 or 0
        depth -= ch in "])" and 1 or 0
        if ch == "," and depth == 0:
            names.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        names.append(current)
    return [n.split(":")[0].strip() for n in names]


def test_type_stubs_match_the_module():
    import ast
    stub = pathlib.Path(tensormem.__file__).with_name("__init__.pyi")
    tree = ast.parse(stub.read_text())
    stubbed = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stubbed.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            stubbed.add(node.target.id)
    public = set(tensormem.__all__)
    # Every stubbed name is importable and exported, and every export is stubbed.
    assert sorted(n for n in stubbed if not hasattr(tensormem, n)) == []
    assert sorted(stubbed - public) == [] and sorted(public - stubbed) == []

    def parameters(fn):
        return [a.arg for a in fn.args.posonlyargs + fn.args.args]

    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            assert _pybind_parameters(getattr(tensormem, node.name)) == parameters(node), node.name
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(tensormem, node.name)
        bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
        # A base is one of the module's classes or a built-in one (ForkedChildError(RuntimeError)).
        base = lambda b: getattr(tensormem, b) if hasattr(tensormem, b) else getattr(builtins, b)  # noqa: E731
        assert [b for b in bases if not issubclass(cls, base(b))] == [], node.name
        members = set()
        for item in node.body:
            if isinstance(item, ast.AnnAssign):
                members.add(item.target.id)
            if not isinstance(item, ast.FunctionDef):
                continue
            members.add(item.name)
            member = getattr(cls, item.name)  # AttributeError names a stubbed method that is gone
            if not isinstance(member, property):
                assert _pybind_parameters(member) == parameters(item), f"{node.name}.{item.name}"
        inherited = set().union(*(dir(base(b)) for b in bases if not hasattr(tensormem, b)))  # a built-in's
        missing = sorted(n for n in dir(cls) if not n.startswith("_") and n not in members | inherited)
        assert missing == [], f"{node.name} has members the stub does not declare: {missing}"


def test_every_signature_names_python_types_only():
    """help() and the signatures pybind11 writes name the module's own classes: a C++ name
    ("(anonymous namespace)::pinned_buffer") means a class was registered after a function
    that returns or takes it (PinnedPool.allocate did)."""
    from tensormem import _tensormem
    leaks = []
    for name in dir(_tensormem):
        obj = getattr(_tensormem, name)
        members = [(name, obj)] + [(f"{name}.{m}", getattr(obj, m)) for m in dir(obj) if isinstance(obj, type)]
        for qualified, member in members:
            doc = member.__doc__ if callable(member) else None
            if isinstance(doc, str) and ("::" in doc or "anonymous namespace" in doc):
                leaks.append(f"{qualified}: {doc.splitlines()[0][:160]}")
    assert leaks == []
    assert tensormem.PinnedPool.allocate.__doc__.splitlines()[0].endswith("-> tensormem._tensormem.PinnedBuffer")


def test_write_plan_picture_draws_svg_or_html_and_refuses_bad_input(tmp_path, monkeypatch):
    lower, upper, size = [0, 1], [2, 3], [256, 512]
    p = tensormem.plan(lower, upper, size, time_limit=0)
    args = (lower, upper, size, p["offsets"], p["arena_bytes"], p["lower_bound"])
    assert tensormem.write_plan_picture(str(tmp_path / "p.svg"), *args, ids=["a<b", "c"]) == ""
    svg = (tmp_path / "p.svg").read_text()
    assert svg.startswith("<svg") and "a&lt;b" in svg and "1.0000 x" in svg and "not a valid plan" not in svg
    # A plan that does not validate is drawn, and says what is wrong (as validate does).
    overlapping = np.array([0, 128], dtype=np.uint64)
    problem = tensormem.validate(lower, upper, size, overlapping, 768)
    assert problem and tensormem.write_plan_picture(str(tmp_path / "bad.svg"), lower, upper, size,
                                                    overlapping, 768, 768) == problem
    assert "not a valid plan: " in (tmp_path / "bad.svg").read_text()
    assert tensormem.write_plan_picture(str(tmp_path / "bad.html"), lower, upper, size, overlapping, 768,
                                        768) == problem
    tensormem.write_plan_picture(str(tmp_path / "p.html"), *args, title="t")
    assert "<script" in (tmp_path / "p.html").read_text()
    monkeypatch.chdir(tmp_path)
    tensormem.write_plan_picture(".html", *args)  # the suffix alone is a page too
    assert "<script" in (tmp_path / ".html").read_text()
    with pytest.raises(ValueError, match="ids: one per buffer"):
        tensormem.write_plan_picture(str(tmp_path / "x.svg"), *args, ids=["only one"])
    with pytest.raises(ValueError, match="offsets: one per buffer"):
        tensormem.write_plan_picture(str(tmp_path / "x.svg"), lower, upper, size, [0], 768, 768)
    with pytest.raises(ValueError, match="expected a whole number"):
        tensormem.write_plan_picture(str(tmp_path / "x.svg"), lower, upper, size, p["offsets"], -1, 768)
    with pytest.raises(FileNotFoundError, match="cannot write"):
        tensormem.write_plan_picture(str(tmp_path / "missing" / "x.svg"), *args)
    assert not (tmp_path / "x.svg").exists()


def test_physical_memory_is_the_machines_or_the_cgroups_where_lower():
    # (tests/cli_cgroup_test.sh checks it inside a cgroup of 64 MiB)
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert tensormem.physical_memory_bytes() == min(machine, tensormem.cgroup_memory_limit_bytes())


def test_plan_refuses_more_buffers_than_the_memory_holds_before_making_them():
    """About 160 bytes a buffer: one buffer more than the process's memory holds at that rate
    is a MemoryError at once (arrays that are views of one element, so nothing is held)."""
    n = tensormem.physical_memory_bytes() // 160 + 1
    one = np.ones(1, dtype=np.uint64)
    lower, upper = np.broadcast_to(one * 0, (n,)), np.broadcast_to(one, (n,))
    start = time.perf_counter()
    with pytest.raises(MemoryError, match=rf"plan: {n} buffers need about {n * 160} bytes of memory "
                                          rf"\(about 160 a buffer\), more than the "
                                          rf"{tensormem.physical_memory_bytes()} bytes this process can have"):
        tensormem.plan(lower, upper, np.broadcast_to(one, (n,)))
    assert time.perf_counter() - start < 5


def test_arena_policies_minimal_moves_the_least_and_full_compacts_everything():
    placed = {}
    for policy in ["minimal", "full"]:
        a = tensormem.ContiguousArena(1280, 256, policy)
        ids = [a.allocate(256)[0] for _ in range(5)]
        a.release(ids[0])
        a.release(ids[2])  # 512 bytes free, in two holes of 256
        new, offset = a.allocate(512)
        moves = sorted((ids.index(i), o) for i, o in a.take_moves())
        assert a.offset(new) == offset
        placed[policy] = (moves, offset, [a.offset(ids[k]) for k in (1, 3, 4)])
    assert placed["minimal"] == ([(1, 0)], 256, [0, 768, 1024])  # one tensor moved opens a hole of 512
    assert placed["full"] == ([(1, 0), (3, 256), (4, 512)], 768, [0, 256, 512])  # every tensor moved down


def test_arena_devices_are_the_cpu_or_cuda_device_0_and_others_are_refused_by_name():
    for bad in ["tpu", "cuda:1", "CPU", ""]:
        with pytest.raises(ValueError, match=f"device must be 'cpu', 'cuda' or 'cuda:0', not '{bad}'$"):
            tensormem.ContiguousArena(1280, 256, "minimal", bad)
    host = tensormem.ContiguousArena(1280, 256, "minimal", "cpu").buffer()
    assert host.__dlpack_device__() == (1, 0)
    view = np.frombuffer(host, dtype=np.uint8)  # host memory: the buffer protocol too
    view[:] = 7
    assert view.size == 1280 and bytes(memoryview(host)) == b"\x07" * 1280
    assert memoryview(host).format == "B" and not memoryview(host).readonly
    for cuda in ["cuda", "cuda:0"]:
        if tensormem.cuda_unavailable_reason():
            with pytest.raises(RuntimeError, match="CUDA"):
                tensormem.ContiguousArena(1280, 256, "minimal", cuda)
        else:
            device = tensormem.ContiguousArena(1280, 256, "minimal", cuda).buffer()
            assert device.__dlpack_device__() == (2, 0)
            # device memory: a BufferError (it once ended the interpreter), DLPack instead
            with pytest.raises(BufferError, match="device memory has no buffer protocol; use DLPack"):
                memoryview(device)
            assert torch.utils.dlpack.from_dlpack(device).device.type == "cuda"
