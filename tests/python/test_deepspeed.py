"""tensormem.deepspeed: DeepSpeed's aio op contract, restated and checked on real files.

Raw files (no header) byte for byte what a plain write gives, at any offset and for any
dtype; DeepSpeed's return conventions; failures reported per operation with path and errno;
pinned tensors; the op builder and patch()."""

import ctypes
import errno
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tensormem
from tensormem import deepspeed as ds

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]


def raw_bytes(tensor):
    """The tensor's bytes as a plain write would put them in a file."""
    t = tensor.detach().contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def random_tensor(numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype in (torch.int64, torch.uint8):
        return torch.randint(0, 200, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g).to(dtype)


def test_getters_and_defaults():
    h = ds.aio_handle()
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism(), h.get_alignment()) == (1048576, 128, False, False, 1, 4096)
    h = ds.aio_handle(block_size=65536, queue_depth=8, single_submit=True, overlap_events=True,
                      intra_op_parallelism=2)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism()) == (65536, 8, True, True, 2)
    for bad in ({"block_size": 0}, {"queue_depth": -1}, {"queue_depth": 0}, {"intra_op_parallelism": 0}):
        (name, value), = bad.items()
        with pytest.raises(ValueError, match=f"aio_handle: {name} must be positive, not {value}$"):
            ds.aio_handle(**bad)
    with pytest.raises(TypeError):
        ds.aio_handle(block_size=1.5)  # as DeepSpeed's own handle refuses it


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_write_method_gives_the_plain_bytes(tmp_path, dtype):
    h = ds.aio_handle(block_size=65536, queue_depth=8, intra_op_parallelism=2)
    tensor = random_tensor(100_003, dtype, 1)
    expected = raw_bytes(tensor)
    writes = {
        "write": lambda p: h.write(tensor, p, False),
        "pwrite": lambda p: h.pwrite(tensor, p, False, False),
        "pwrite_keyword": lambda p: h.pwrite(tensor, p, True, **{"async": False}),
        "sync_pwrite": lambda p: h.sync_pwrite(tensor, p),
        "async_pwrite": lambda p: (h.async_pwrite(tensor, p), h.wait())[1],
    }
    returned = {}
    for name, write in writes.items():
        path = str(tmp_path / name)
        returned[name] = write(path)
        assert pathlib_bytes(path) == expected, name
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    # DeepSpeed's conventions: write 0, synchronous pwrite the count it waited for.
    assert returned == {"write": 0, "pwrite": 1, "pwrite_keyword": 1, "sync_pwrite": 1, "async_pwrite": 1}


def pathlib_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def read_methods(h, path):
    """Each way of ``aio_handle`` ``h`` to read the file at ``path`` into a tensor, whole."""
    return {
        "read": lambda b: h.read(b, path, False),
        "pread": lambda b: h.pread(b, path, True, False),
        "sync_pread": lambda b: h.sync_pread(b, path),
        "async_pread": lambda b: (h.async_pread(b, path), h.wait())[1],
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_read_method_returns_the_file(tmp_path, dtype):
    h = ds.aio_handle(block_size=65536, queue_depth=8)
    tensor = random_tensor(70_001, dtype, 2)
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(raw_bytes(tensor))
    for name, read in read_methods(h, path).items():
        back = torch.zeros_like(tensor)
        read(back)
        assert torch.equal(back, tensor), name


def test_a_read_counts_as_an_in_place_change_for_autograd(tmp_path):
    """A read into a tensor changes its values in place: its version counts it (a read into
    the tensor's own memory once queued, a staged one by its copy_), so that a backward
    through values saved before it is refused instead of computing with the file's values.
    A write, and a read refused before any I/O, count nothing."""
    h = ds.aio_handle(block_size=65536, queue_depth=8)
    path = str(tmp_path / "f")
    saved = torch.arange(1000, dtype=torch.float32)
    assert h.sync_pwrite(saved, path) == 1 and saved._version == 0
    for name, read in read_methods(h, path).items():
        # its own memory, staged; a parameter (a leaf that requires grad) either way, which
        # DeepSpeed's reads fill as any tensor
        for target in (torch.zeros(1000), torch.zeros(2000)[::2], torch.nn.Parameter(torch.zeros(1000)),
                       torch.nn.Parameter(torch.zeros(2000)[::2])):
            w = torch.ones(1000, requires_grad=True)
            loss = (w * target).sum()  # saves the zeros for w's gradient
            read(target)
            assert torch.equal(target, saved) and target._version == 1, (name, target.is_contiguous())
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
    queued = torch.zeros(1000)
    assert h.async_pread(queued, path) == 0
    assert queued._version == 1  # counted once queued, before the wait
    assert h.wait() == 1 and torch.equal(queued, saved)
    meta = torch.zeros(1000, device="meta")
    with pytest.raises(ValueError, match="meta"):
        h.sync_pread(meta, path)
    assert meta._version == 0


def test_offsets_keep_the_rest_of_the_file(tmp_path):
    """Writes at any offset (aligned or not) into one file; nothing outside is touched."""
    h = ds.aio_handle(block_size=8192, queue_depth=4)
    path = str(tmp_path / "f")
    model = bytearray(os.urandom(300_000))
    with open(path, "wb") as f:
        f.write(model)
    rng = np.random.default_rng(5)
    for _ in range(30):
        numel = int(rng.integers(1, 20_000))
        offset = int(rng.integers(0, 200_000))
        if rng.integers(0, 2):
            offset -= offset % 4096  # O_DIRECT-eligible ones too
            numel = max(1024, numel - numel % 1024)
        t = random_tensor(numel, torch.float32, int(rng.integers(0, 1 << 30)))
        if offset % 4096 == 0 and numel % 1024 == 0:  # 4096-aligned memory as well
            t = ds.new_cpu_locked_tensor(numel, t).copy_(t)
        assert h.async_pwrite(t, path, offset) == 0
        assert h.wait() == 1
        model[offset:offset + 4 * numel] = raw_bytes(t)
        assert pathlib_bytes(path) == bytes(model)
        back = torch.empty(numel, dtype=torch.float32)
        assert h.sync_pread(back, path, offset) == 1
        assert torch.equal(back, t)
    stats = h.stats()
    assert stats["direct_ops"] > 0 and stats["buffered_ops"] > 0 and stats["failed"] == 0
    assert stats["synchronous_requests"] == 0  # io_uring started every request itself


def test_wait_counts_operations_and_sync_calls_collect_the_queue(tmp_path):
    h = ds.aio_handle(block_size=65536)
    tensors = [random_tensor(50_000, torch.float32, i) for i in range(5)]
    for i, t in enumerate(tensors):
        assert h.async_pwrite(t, str(tmp_path / str(i))) == 0
    assert h.wait() == 5
    assert h.wait() == 0
    backs = [torch.empty_like(t) for t in tensors]
    for i in range(3):
        assert h.async_pread(backs[i], str(tmp_path / str(i))) == 0
    # A synchronous pread waits for everything queued: 3 + itself.
    assert h.pread(backs[3], str(tmp_path / "3"), False, False) == 4
    assert h.sync_pread(backs[4], str(tmp_path / "4")) == 1
    for t, b in zip(tensors, backs):
        assert torch.equal(t, b)


def test_non_contiguous_tensors_go_through_a_bounce(tmp_path):
    h = ds.aio_handle()
    base = random_tensor(64 * 48, torch.float32, 3).view(64, 48)
    view = base.t()  # not contiguous
    path = str(tmp_path / "t")
    assert h.sync_pwrite(view, path) == 1
    assert pathlib_bytes(path) == raw_bytes(view)
    target = torch.zeros(64, 48).t()  # a non-contiguous destination of the view's shape
    assert target.shape == view.shape and not target.is_contiguous()
    assert h.async_pread(target, path) == 0
    assert h.wait() == 1
    assert torch.equal(target, view)


class _EngineFailingOnePath:
    """Stands in for the handle's I/O engine: a read fills its memory with 7s, except for
    `bad_path`, whose read writes nothing and fails at wait() (as a file that shrank
    meanwhile does)."""

    def __init__(self, bad_path):
        self.bad_path, self.queued, self.next_ticket = bad_path, [], 1

    def read(self, address, nbytes, path, offset, validate):
        ticket, self.next_ticket = self.next_ticket, self.next_ticket + 1
        if path != self.bad_path:
            ctypes.memset(address, 7, nbytes)
        self.queued.append((ticket, path))
        return ticket

    def wait(self):
        done, self.queued = self.queued, []
        errors = [(path, errno.EIO, f"short read from {path}", t) for t, path in done if path == self.bad_path]
        return len(done), errors


def test_a_failed_staged_read_leaves_its_tensor_as_it_was(tmp_path):
    """A non-contiguous tensor is read through a staging copy; when that read fails, the
    staging copy holds no file data and must not be copied into the tensor. The read that
    succeeded beside it is copied back."""
    h = ds.aio_handle()
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    h._io = _EngineFailingOnePath(bad)
    kept = torch.arange(64 * 48, dtype=torch.float32).view(64, 48).t()  # not contiguous
    before = kept.clone()
    filled = torch.zeros(64, 48, dtype=torch.uint8).t()
    assert h.async_pread(kept, bad) == 0 and h.async_pread(filled, good) == 0
    with pytest.raises(ds.AIOError) as e:
        h.wait()
    assert e.value.completed == 2 and e.value.errors == [(bad, errno.EIO, f"short read from {bad}")]
    assert torch.equal(kept, before)
    assert torch.equal(filled, torch.full((48, 64), 7, dtype=torch.uint8))
    # The synchronous read has the same rule.
    h._sync_io = _EngineFailingOnePath(bad)
    with pytest.raises(ds.AIOError):
        h.read(kept, bad, False)
    assert torch.equal(kept, before)


def test_tensors_without_memory_of_their_own_are_refused_before_any_io(tmp_path):
    """A meta tensor has no bytes (a read into it completed and its bytes went nowhere), a
    sparse one no single buffer, and an expanded view shares memory between elements (the
    copy-back refused it only after the read). Each is refused when queued, on every path
    in; the file is untouched and nothing is left queued."""
    h = ds.aio_handle()
    path = str(tmp_path / "f")
    data = random_tensor(4096, torch.float32, 5)
    assert h.sync_pwrite(data, path) == 1
    before = pathlib_bytes(path)
    cases = [
        (torch.zeros(4096, device="meta"), "a tensor on meta has no memory", (True, False)),
        (torch.zeros(64, 64).to_sparse(), "tensors must be dense \\(strided\\), not torch.sparse_coo", (True, False)),
        (torch.zeros(1).expand(4096), "elements of the tensor to read into share memory", (True,)),
    ]
    for tensor, message, reads in cases:
        for read in reads:
            calls = [lambda: h.sync_pread(tensor, path), lambda: h.async_pread(tensor, path),
                     lambda: h.read(tensor, path, False), lambda: h.pread(tensor, path, False, False),
                     lambda: ds.aio_read(tensor, path, 1 << 20, 8, False, False, False)]
            if not read:
                calls = [lambda: h.sync_pwrite(tensor, path), lambda: h.async_pwrite(tensor, path),
                         lambda: h.write(tensor, path, False), lambda: h.pwrite(tensor, path, False, False),
                         lambda: ds.aio_write(tensor, path, 1 << 20, 8, False, False, False)]
            for call in calls:
                with pytest.raises(ValueError, match=message):
                    call()
    assert h.wait() == 0
    assert pathlib_bytes(path) == before
    # An expanded view may be written: its elements are read, not written.
    assert h.sync_pwrite(torch.ones(1).expand(1024), str(tmp_path / "ones")) == 1
    assert pathlib_bytes(str(tmp_path / "ones")) == raw_bytes(torch.ones(1024))


def test_a_tensor_resized_before_the_wait_does_not_take_the_others_reads_with_it(tmp_path):
    """Staged reads are copied back at wait(): when one copy fails (its tensor was resized
    meanwhile), the other reads are still copied back, and then the failure is raised."""
    h = ds.aio_handle()
    paths = [str(tmp_path / n) for n in ("a", "b")]
    data = [random_tensor(64 * 48, torch.float32, 6 + i).view(64, 48) for i in range(2)]
    for d, p in zip(data, paths):
        assert h.sync_pwrite(d.t().contiguous(), p) == 1
    first, second = torch.zeros(64, 48).t(), torch.zeros(64, 48).t()  # staged: not contiguous
    assert h.async_pread(first, paths[0]) == 0 and h.async_pread(second, paths[1]) == 0
    first.resize_(0)
    with pytest.raises(RuntimeError):
        h.wait()
    assert torch.equal(second, data[1].t())
    assert h.wait() == 0


def test_a_tensor_given_other_memory_before_the_wait_keeps_its_old_memory_alive(tmp_path):
    """The handle holds each queued tensor's storage: `t.set_(...)` or `p.data = ...` before
    wait() used to free the memory the I/O threads were reading or writing. A write then
    writes the bytes the tensor had."""
    h = ds.aio_handle(block_size=4096, queue_depth=1)
    n = 8 << 20  # 32 MiB of float32: 8,192 requests of 4 KiB, one at a time
    data = random_tensor(n, torch.float32, 9)
    t = data.clone()
    path = str(tmp_path / "f")
    assert h.async_pwrite(t, path) == 0
    t.set_(torch.empty(0))
    reuse = [torch.full((1 << 18,), 7.0) for _ in range(64)]  # memory handed out again meanwhile
    assert h.wait() == 1
    assert pathlib_bytes(path) == raw_bytes(data)
    assert all(bool((r == 7.0).all()) for r in reuse)
    p = torch.nn.Parameter(torch.zeros(n))
    assert h.async_pread(p, path) == 0
    p.data = torch.full((4,), 3.0)
    assert h.wait() == 1
    assert torch.equal(p.data, torch.full((4,), 3.0))


def test_validate_passes_on_matching_bytes(tmp_path):
    h = ds.aio_handle()
    t = random_tensor(1 << 20, torch.float32, 4)
    path = str(tmp_path / "v")
    assert h.write(t, path, True) == 0
    back = torch.empty_like(t)
    assert h.read(back, path, True) == 0
    assert torch.equal(back, t)
    assert h.pwrite(t, path, True, False) == 1


def test_pread_and_pwrite_take_async_and_the_offset_by_position_or_by_name(tmp_path):
    """DeepSpeed's signature: (buffer, filename, validate, async, file_offset), where ``async``
    (a Python keyword) comes by position, as ``**{"async": ...}`` or as ``async_op``."""
    h = ds.aio_handle(block_size=8192, queue_depth=4)
    path = str(tmp_path / "f")
    first, second = random_tensor(1024, torch.float32, 1), random_tensor(1024, torch.float32, 2)
    assert h.pwrite(first, path, False, False) == 1
    assert h.pwrite(second, path, False, False, 8192) == 1  # both by position
    assert pathlib_bytes(path) == raw_bytes(first) + bytes(4096) + raw_bytes(second)
    for call in (lambda b: h.pread(b, path, False, False, 8192),
                 lambda b: h.pread(b, path, False, async_op=False, file_offset=8192),
                 lambda b: h.pread(b, path, False, file_offset=8192, **{"async": False}),
                 lambda b: h.pread(b, path, False, False, file_offset=8192)):
        back = torch.zeros(1024)
        assert call(back) == 1
        assert torch.equal(back, second)
    back = torch.zeros(1024)
    assert h.pread(back, path, False, async_op=False) == 1 and torch.equal(back, first)  # offset 0
    for call, message in ((lambda: h.pread(back, path, False, False, 0, 1), "takes at most 5 positional arguments"),
                          (lambda: h.pwrite(first, path, False, False, async_op=True),
                           "got multiple values for argument 'async'"),
                          (lambda: h.pread(back, path, False, False, 0, file_offset=0),
                           "got multiple values for argument 'file_offset'"),
                          (lambda: h.pread(back, path, False, offset=0), "unexpected keyword argument 'offset'"),
                          (lambda: h.pwrite(first, path, False), "missing required argument: 'async'"),
                          # Flags as DeepSpeed's binding converts them: not a string or a list.
                          (lambda: h.pwrite(first, path, False, "no"), r"pwrite\(\): async must be a bool, not str"),
                          (lambda: h.pread(back, path, [], False), r"aio_handle\(\): validate must be a bool, not list"),
                          (lambda: h.write(first, path, "False"), r"aio_handle\(\): validate must be a bool, not str"),
                          (lambda: ds.aio_handle(single_submit="yes"), "single_submit must be a bool"),
                          (lambda: ds.aio_handle(overlap_events=[0]), "overlap_events must be a bool")):
        with pytest.raises(TypeError, match=message):
            call()
    # What that binding takes (None, numbers, a one-element tensor) is its truth value.
    assert h.pwrite(first, path, None, 0) == 1
    assert h.pread(back, path, 0.0, torch.tensor(False)) == 1 and torch.equal(back, first)
    assert ds.aio_handle(single_submit=1, overlap_events=None).get_single_submit() is True
    assert pathlib_bytes(path) == raw_bytes(first) + bytes(4096) + raw_bytes(second)  # nothing written


def test_aio_error_names_how_many_more_operations_failed():
    one = ds.AIOError([("/a", errno.EIO, "cannot write /a")], 3)
    assert (one.errno, one.filename, one.strerror, one.completed) == (errno.EIO, "/a", "cannot write /a", 3)
    three = ds.AIOError([("/a", errno.EIO, "cannot write /a"), ("/b", errno.ENOSPC, "x"), ("/c", errno.EIO, "y")], 3)
    assert three.strerror == "cannot write /a (and 2 more failed operations)" and len(three.errors) == 3


def test_errors_name_the_path_and_errno(tmp_path):
    h = ds.aio_handle()
    t = torch.ones(1024)
    missing = str(tmp_path / "no" / "dir" / "f")
    for call in (lambda: h.async_pwrite(t, missing), lambda: h.write(t, missing, False),
                 lambda: h.sync_pwrite(t, missing), lambda: h.async_pread(t, missing)):
        with pytest.raises(OSError) as e:
            call()
        assert e.value.errno == errno.ENOENT and missing in str(e.value)
    short = str(tmp_path / "short")
    with open(short, "wb") as f:
        f.write(b"x" * 1000)
    with pytest.raises(OSError) as e:
        h.async_pread(t, short)  # 4096 bytes wanted, 1000 there
    assert e.value.errno == errno.EINVAL and "has 1000 bytes" in str(e.value)
    with pytest.raises(OSError):
        h.read(t, short, False)
    assert h.wait() == 0  # nothing was queued
    # The handle goes on working.
    assert h.sync_pwrite(t, short) == 1
    with pytest.raises(TypeError):
        h.pread(t, short, False)  # 'async' missing
    with pytest.raises(TypeError):
        h.async_pwrite(np.ones(4), short)
    with pytest.raises((TypeError, OverflowError, ValueError)):
        h.async_pwrite(t, short, -4096)  # a negative offset is refused, nothing queued
    assert h.wait() == 0


ENOSPC_SCRIPT = textwrap.dedent("""
    import errno, sys, torch
    from tensormem import deepspeed as ds
    d = sys.argv[1]
    h = ds.aio_handle()
    small, big = torch.ones(65536), torch.ones(1 << 20)  # 256 KiB fits in 1 MiB, 4 MiB does not
    h.async_pwrite(small, d + "/fits")
    h.async_pwrite(big, d + "/too-big")
    try:
        h.wait()
        print("NO ERROR")
    except ds.AIOError as e:
        ok = (e.errno == errno.ENOSPC and e.completed == 2 and len(e.errors) == 1
              and e.errors[0][0] == d + "/too-big" and e.filename == d + "/too-big")
        print("ENOSPC-REPORTED" if ok else "WRONG %r %r" % (e, e.errors))
    import os
    os.remove(d + "/too-big")  # what it wrote before the disk filled
    h.sync_pwrite(small, d + "/again")  # still usable
    print("STILL-WORKS")
""")


def test_a_full_disk_is_reported_per_operation(tmp_path):
    """A 1 MiB tmpfs in a private mount namespace (needs root and unshare)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a small tmpfs")
    script = tmp_path / "enospc.py"
    script.write_text(ENOSPC_SCRIPT)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = ["unshare", "-m", "sh", "-c",
           f"mount -t tmpfs -o size=1m tmpfs {mnt} && {sys.executable} {script} {mnt}"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, timeout=120)
    if "mount" in r.stderr and r.returncode != 0 and "ENOSPC" not in r.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    assert "ENOSPC-REPORTED" in r.stdout and "STILL-WORKS" in r.stdout, (r.stdout, r.stderr)


# ----------------------------------------------------------------------------- pinned tensors

def test_pinned_tensors():
    example = torch.zeros(1, dtype=torch.float16)
    t = ds.new_cpu_locked_tensor(1 << 20, example)
    assert t.dtype == torch.float16 and t.shape == (1 << 20,) and t.data_ptr() % 4096 == 0
    h = ds.aio_handle()
    assert h.is_pinned(t) and ds.is_pinned(t.narrow(0, 100, 1000))
    assert not h.is_pinned(torch.zeros(10))
    assert not ds.is_pinned(torch.zeros(16, dtype=torch.float16))
    t.fill_(1.5)
    assert h.free_cpu_locked_tensor(t) is True
    assert h.free_cpu_locked_tensor(t) is False  # already freed: reported
    assert ds.free_cpu_locked_tensor(torch.zeros(4)) is False  # never managed
    assert not ds.is_pinned(t)
    assert float(t[123]) == 1.5  # the tensor keeps its memory until it dies
    z = h.new_cpu_locked_tensor(0, torch.zeros(1))
    assert z.numel() == 0 and h.free_cpu_locked_tensor(z)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


@needs_cuda
def test_pinned_tensors_are_registered_with_cuda():
    """Where torch sees a device, every locked tensor is pinned in torch's eyes (small ones
    sharing no page with each other included), copies to and from the device round trip,
    and a freed tensor is no longer registered."""
    tensors = [ds.new_cpu_locked_tensor(n, torch.zeros(1)) for n in (1, 10, 1000, 1 << 20, 3)]
    for i, t in enumerate(tensors):
        assert t.is_pinned(), f"tensor {i} of {t.numel()} elements"
        t.copy_(torch.arange(t.numel(), dtype=torch.float32) + i)
        on_device = t.to("cuda", non_blocking=True)
        back = torch.empty_like(t).pin_memory()
        back.copy_(on_device, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, t)
    for t in tensors:
        assert ds.free_cpu_locked_tensor(t)
        assert not t.is_pinned()


def test_a_refused_cuda_registration_is_an_error(monkeypatch):
    """cudaHostRegister's error is raised, not dropped, and the buffer goes back to the pool."""
    class FakeCudart:
        def cudaHostRegister(self, address, nbytes, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    before = ds._PINNED.stats().get("in_use_bytes", 0)
    with pytest.raises(MemoryError, match="cudaHostRegister.*error 2"):
        ds.new_cpu_locked_tensor(1000, torch.zeros(1))
    assert ds._PINNED.stats()["in_use_bytes"] == before
    assert not ds._PINNED._regions or all(
        limit - start != 4000 for start, (limit, _b) in ds._PINNED._regions.items())


def test_cuda_that_cannot_be_reached_takes_nothing(monkeypatch):
    """In a child forked from a process that had initialised CUDA (which torch will not start
    again there), new_cpu_locked_tensor raises RuntimeError saying so before anything is
    taken, and free_cpu_locked_tensor forgets a tensor without calling CUDA (the registration
    is the parent's); a registration that raises instead of returning an error (a driver that
    cannot start) gives every byte back to the pool."""
    def stats():
        s = ds._PINNED.stats()
        return s.get("in_use_bytes", 0), s.get("allocations", 0), dict(ds._PINNED._regions)

    def no_cuda_call():
        raise AssertionError("CUDA was called")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kept = ds.new_cpu_locked_tensor(1000, torch.zeros(1))  # (registered nowhere)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", no_cuda_call)
    before = stats()
    with pytest.raises(RuntimeError, match=r"forked from one that had initialised CUDA.*'spawn'"):
        ds.new_cpu_locked_tensor(1000, torch.zeros(1))
    assert stats() == before
    assert ds.free_cpu_locked_tensor(kept) and not ds.is_pinned(kept)

    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)

    def driver_that_cannot_start():
        raise RuntimeError("the CUDA driver cannot start (test)")

    monkeypatch.setattr(torch.cuda, "cudart", driver_that_cannot_start)
    before = stats()
    with pytest.raises(RuntimeError, match=re.escape("the CUDA driver cannot start (test)")) as caught:
        ds.new_cpu_locked_tensor(1000, torch.zeros(1))
    assert caught.tb is not None and stats() == before  # (also while the error and its frames are kept)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_cuda_tensors_round_trip_through_the_handle(tmp_path, dtype):
    """A CUDA tensor is written through a bounce copy (the file holds its raw bytes) and
    read back into a CUDA tensor by wait()."""
    h = ds.aio_handle()
    source = random_tensor(100_003, dtype, 5).to("cuda")
    path = str(tmp_path / "cuda.bin")
    assert h.async_pwrite(source, path) == 0 and h.wait() == 1
    assert pathlib_bytes(path) == raw_bytes(source.cpu())
    back = torch.zeros_like(source)
    assert h.sync_pread(back, path) == 1
    assert back.device.type == "cuda" and torch.equal(back, source)
    strided = torch.zeros((2, 100_003), dtype=dtype, device="cuda")[1]  # a view at an offset
    assert h.async_pread(strided, path) == 0 and h.wait() == 1
    assert torch.equal(strided, source)


@needs_cuda
def test_swapper_takes_cuda_gradients(tmp_path):
    """DeepSpeed's gradients live on the device: the swapper copies them into the pinned
    buffers and the files hold their bytes, zero-padded to the alignment."""
    handle = ds.aio_handle()
    swapper = ds.AsyncTensorSwapper(handle, numel_alignment=256, timers=None)
    swapper.add_buffers([handle.new_cpu_locked_tensor(4096, torch.zeros(1)) for _ in range(2)])
    expected = {}
    for batch in range(4):
        grads = [torch.randn(1000 + 17 * i, device="cuda") for i in range(3)]
        paths = [str(tmp_path / f"g{batch}_{i}") for i in range(3)]
        swapper.swap_out_tensors(grads, paths)
        for g, p in zip(grads, paths):
            expected[p] = g.cpu()
            g.fill_(float("nan"))
    swapper.release_buffers()
    for path, grad in expected.items():
        aligned = -(-grad.numel() // 256) * 256
        assert pathlib_bytes(path) == raw_bytes(torch.cat([grad, torch.zeros(aligned - grad.numel())]))


def test_pinned_memory_returns_to_the_pool_when_the_tensor_dies():
    before = ds._PINNED.stats().get("in_use_bytes", 0)
    t = ds.new_cpu_locked_tensor(1 << 18, torch.zeros(1))
    assert ds._PINNED.stats()["in_use_bytes"] >= before + (1 << 20)
    ds.free_cpu_locked_tensor(t)
    assert ds._PINNED.stats()["in_use_bytes"] >= before + (1 << 20)  # a live tensor holds it
    del t
    assert ds._PINNED.stats()["in_use_bytes"] == before


def test_io_through_pinned_tensors_is_direct(tmp_path):
    h = ds.aio_handle()
    t = ds.new_cpu_locked_tensor(1 << 20, torch.zeros(1))
    t.copy_(torch.arange(1 << 20, dtype=torch.float32))
    path = str(tmp_path / "p")
    assert h.sync_pwrite(t, path) == 1
    back = ds.new_cpu_locked_tensor(1 << 20, torch.zeros(1))
    assert h.sync_pread(back, path) == 1
    assert torch.equal(back, t)
    assert h.stats()["direct_ops"] == 2
    ds.free_cpu_locked_tensor(t)
    ds.free_cpu_locked_tensor(back)


# ----------------------------------------------------------------------------- builder, patch

def test_builder_and_module_functions(tmp_path):
    builder = ds.AsyncIOBuilder()
    assert builder.is_compatible() and builder.NAME == builder.name == "async_io"
    assert ds.AsyncIOBuilder("my_aio").name == "my_aio"  # DeepSpeed's builders take a name
    ops = builder.load(verbose=False)
    for name in ("aio_handle", "aio_read", "aio_write", "deepspeed_memcpy"):
        assert callable(getattr(ops, name))
    t = random_tensor(10_000, torch.float32, 7)
    path = str(tmp_path / "m")
    assert ops.aio_write(t, path, 1 << 20, 32, False, False, True) == 0
    back = torch.empty_like(t)
    assert ops.aio_read(back, path, 1 << 20, 32, False, False, False) == 0
    assert torch.equal(back, t)
    dest = torch.zeros_like(t)
    assert ops.deepspeed_memcpy(dest, t) == 0 and torch.equal(dest, t) and dest._version == 1
    param = torch.nn.Parameter(torch.zeros(10_000))  # bytes into a parameter, as DeepSpeed's memcpy
    assert ops.deepspeed_memcpy(param, t) == 0 and torch.equal(param.detach(), t) and param._version == 1
    with pytest.raises(ValueError):
        ops.deepspeed_memcpy(torch.zeros(3), t)


FAKE_BUILDER = textwrap.dedent("""
    class AsyncIOBuilder:
        NAME = "async_io"
        def is_compatible(self, verbose=False):
            return False
        def load(self, verbose=True):
            raise RuntimeError("would build libaio")
""")


def test_patch_redirects_deepspeeds_builder(tmp_path, monkeypatch):
    """A stand-in DeepSpeed package: its op_builder's AsyncIOBuilder, and a module that
    imported the class before patch(), both load tensormem's op afterwards."""
    pkg = tmp_path / "deepspeed"
    (pkg / "ops" / "op_builder").mkdir(parents=True)
    (pkg / "runtime").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "op_builder" / "__init__.py").write_text("from .async_io import AsyncIOBuilder\n")
    (pkg / "ops" / "op_builder" / "async_io.py").write_text(FAKE_BUILDER)
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "swapper.py").write_text(
        "from deepspeed.ops.op_builder import AsyncIOBuilder\n"
        "def make_handle():\n"
        "    return AsyncIOBuilder().load().aio_handle(block_size=65536, queue_depth=4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        monkeypatch.delitem(sys.modules, name)
    import deepspeed.runtime.swapper as swapper  # imports the class before the patch
    with pytest.raises(RuntimeError):
        swapper.make_handle()
    assert ds.patch() is True
    handle = swapper.make_handle()
    assert isinstance(handle, ds.aio_handle) and handle.get_block_size() == 65536
    from deepspeed.ops.op_builder import AsyncIOBuilder
    assert AsyncIOBuilder().is_compatible()
    t = torch.arange(1000, dtype=torch.float32)
    assert handle.sync_pwrite(t, str(tmp_path / "x")) == 1
    for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        del sys.modules[name]


def test_patch_without_deepspeed(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import fails
    assert ds.patch() is False


# ----------------------------------------------------------------------------- ContiguousMemoryAllocator

def check_bookkeeping(mem):
    """DeepSpeed's attributes agree with each other and with the tensors, after every step."""
    sizes, holes = dict(mem.tensor_sizes), dict(mem.contiguous_sizes)
    assert sum(sizes.values()) + sum(holes.values()) == mem.total_size
    assert all(size > 0 for size in holes.values()), holes  # a hole has room, or is not listed
    spans = sorted([(a, s, "t") for a, s in sizes.items()] + [(a, s, "h") for a, s in holes.items()])
    cursor = 0
    for address, size, _kind in spans:  # tensors and holes tile the buffer exactly
        assert address == cursor
        cursor += size
    assert cursor == mem.total_size
    assert mem.total_free == sum(holes.values())
    assert mem.largest_contiguous == max(holes.values(), default=0)
    base = mem.buffer.data_ptr()
    for tid, tensor in mem.tensor_map.items():
        assert tid == id(tensor)
        if tensor.numel():
            address = mem.tensor_addresses[tid]
            assert (tensor.data_ptr() - base) // tensor.element_size() == address
            assert mem.tensor_ids[address] == tid and mem.tensor_sizes[address] == tensor.numel()


def cuda_or_skip(device):
    """CUDA cases run where a device is usable; elsewhere the allocator must say why not."""
    if device == "cuda" and tensormem.cuda_unavailable_reason():
        with pytest.raises(RuntimeError, match="CUDA|cuda"):
            ds.ContiguousMemoryAllocator(64, torch.float16, "cuda")
        pytest.skip(tensormem.cuda_unavailable_reason())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("policy", ["minimal", "full"])
def test_allocator_random_oracle(policy, device):
    """Random allocations, releases and param assignments against a model of the values:
    every live tensor and param keeps its fill through every defragmentation."""
    cuda_or_skip(device)
    # Memory that held NaNs before (the heap hands it out again): the buffer starts zeroed,
    # as DeepSpeed's torch.zeros, so its mul_(0.0).add_(x) idiom gives x, never NaN.
    for _ in range(3):
        dirty = ds.ContiguousMemoryAllocator(4096, torch.float16, device, policy=policy)
        dirty.buffer.fill_(float("nan"))
        del dirty
    mem = ds.ContiguousMemoryAllocator(4096, torch.float16, device, policy=policy)
    assert mem.buffer.device.type == device
    assert torch.count_nonzero(mem.buffer) == 0
    rng = np.random.default_rng(11)
    live = {}   # id -> (tensor, value, param or None)
    peak = used = 0
    for step in range(400):
        if live and (rng.random() < 0.45 or mem.total_free < 64):
            tid = list(live)[int(rng.integers(0, len(live)))]
            tensor, _value, param = live.pop(tid)
            if rng.random() < 0.5:
                mem.release_tensor(tensor)
            else:
                mem.release_tensor_with_id(tid)
            used -= tensor.numel()
            if param is not None:
                assert param.numel() == 0  # detached
        else:
            size = int(rng.integers(0, min(512, mem.total_free) + 1))
            tensor = mem.allocate_tensor(size).mul_(0.0).add_(float(step % 100))
            param = None
            if size >= 4 and rng.random() < 0.5:
                param = torch.nn.Parameter(torch.empty(0, dtype=torch.float16, device=device))
                mem.assign_to_param(tensor, param, size - size % 4, (4, -1))
                assert param.contiguous_tensor_id == id(tensor)
            live[id(tensor)] = (tensor, float(step % 100), param)
            used += size
            peak = max(peak, used)
        for tensor, value, param in live.values():
            assert not torch.isnan(tensor).any()
            assert torch.all(tensor == value), f"step {step}"
            if param is not None:
                assert param.data_ptr() == tensor.data_ptr() and torch.all(param == value)
        check_bookkeeping(mem)
        assert mem.max_allocated == peak and mem.max_allocated() == peak
    assert mem.count > 200
    assert mem.stats()["defragmentations"] > 0


def test_allocator_refuses_what_deepspeed_asserts_on():
    mem = ds.ContiguousMemoryAllocator(256, torch.float32)
    u = mem.allocate_tensor(100)
    with pytest.raises(AssertionError, match="view or slice"):
        mem.release_tensor(u[:10])  # DeepSpeed would free all of u's memory
    assert mem.total_free == 156
    p = torch.nn.Parameter(torch.empty(0))
    mem.assign_to_param(u, p, 100, (10, 10))
    assert [q is p for q in mem.id_to_params[id(u)]] == [True]
    with pytest.raises(AssertionError, match="already been assigned"):
        mem.assign_to_param(u, torch.nn.Parameter(torch.empty(0)), 100, (100,))
    with pytest.raises(AssertionError, match="exceeds"):
        mem.assign_to_param(mem.allocate_tensor(4), p, 5, (5,))
    with pytest.raises(AssertionError, match="no such tensor"):
        mem.assign_to_param(torch.zeros(4), p, 4, (4,))
    with pytest.raises(AssertionError, match="invalid tensor id"):
        mem.release_tensor_with_id(12345)
    with pytest.raises(MemoryError) as e:
        mem.allocate_tensor(1000)
    assert isinstance(e.value, AssertionError)
    with pytest.raises(TypeError):
        mem.tensor_map[1] = u  # read-only views
    with pytest.raises(TypeError):
        mem.contiguous_sizes[0] = 1
    with pytest.raises(NotImplementedError, match="cuda:1"):
        ds.ContiguousMemoryAllocator(64, torch.float32, "cuda:1")
    mem.release_tensor(u)
    with pytest.raises(AssertionError):
        mem.release_tensor(u)  # twice
    with pytest.raises(ValueError, match="size must be >= 0 elements, not -1"):
        ds.ContiguousMemoryAllocator(-1, torch.float32)
    empty = ds.ContiguousMemoryAllocator(0, torch.float32)  # as torch.zeros(0) in DeepSpeed's
    assert empty.allocate_tensor(0).numel() == 0 and dict(empty.contiguous_sizes) == {}
    check_bookkeeping(empty)


def test_allocator_like_deepspeeds_own_scenario():
    """Two releases leave 512 elements free in holes; a 512-element tensor defragments, and
    the norms are what the fills say (values and sizes computed here, not copied)."""
    mem = ds.ContiguousMemoryAllocator(1024, torch.half, "cpu")
    fills = {}
    tensors = {}
    for name, size, value in (("a", 64, 2.0), ("b", 256, 3.0), ("c", 128, 4.0), ("d", 64, 5.0),
                              ("e", 256, 6.0), ("f", 128, 7.0), ("g", 128, 9.0)):
        tensors[name] = mem.allocate_tensor(size).mul_(0.0).add_(value)
        fills[name] = (size, value)
    for name in ("g", "e", "a", "d"):
        mem.release_tensor(tensors.pop(name))
        fills.pop(name)
    assert mem.largest_contiguous < 512 <= mem.total_free
    tensors["h"] = mem.allocate_tensor(512).mul_(0.0).add_(10.0)
    fills["h"] = (512, 10.0)
    expected = sum(v * np.sqrt(n) for n, v in fills.values())
    got = sum(t.float().norm().item() for t in tensors.values())
    assert abs(got - expected) < 1e-3 * expected


# ----------------------------------------------------------------------------- AsyncTensorSwapper

class RecordingHandle:
    """The real handle, with its calls counted."""

    def __init__(self, handle):
        self.handle = handle
        self.calls = []

    def async_pwrite(self, buffer, path, file_offset=0):
        self.calls.append("write")
        return self.handle.async_pwrite(buffer, path, file_offset)

    def wait(self):
        self.calls.append("wait")
        return self.handle.wait()

    def is_pinned(self, t):
        return self.handle.is_pinned(t)


class Timers:
    def __init__(self):
        self.events = []

    def __call__(self, name):
        timers = self

        class Timer:
            def start(self):
                timers.events.append(("start", name))

            def stop(self):
                timers.events.append(("stop", name))
        return Timer()


def test_a_defragmentation_counts_as_a_change_of_the_moved_tensors_for_autograd():
    """A tensor moved by a defragmentation, and the parameter assigned to it, hold their
    values at a new place; a view made before (autograd saves a linear layer's weight.t())
    still looks at the old place, where other bytes are now. The move counts in their
    versions, so that backward is refused instead of computing with those bytes; tensors
    that did not move count nothing."""
    torch.manual_seed(0)
    mem = ds.ContiguousMemoryAllocator(1000, torch.float32, "cpu")
    below = mem.allocate_tensor(200)
    layer = torch.nn.Linear(10, 10, bias=False)
    weight = layer.weight.detach().clone()
    t = mem.allocate_tensor(100)
    mem.assign_to_param(t, layer.weight, 100, (10, 10))
    with torch.no_grad():
        layer.weight.copy_(weight)
    x = torch.randn(3, 10, requires_grad=True)
    y = layer(x).sum()  # saves weight.t() for x's gradient
    still = mem.allocate_tensor(50)  # after t: moves down too
    versions = (t._version, layer.weight._version, still._version)
    mem.release_tensor(below)
    big = mem.allocate_tensor(850)  # fits in no hole: t and still move down into it
    assert torch.equal(layer.weight.detach(), weight) and mem.tensor_addresses[id(t)] == 0
    assert t._version > versions[0] and layer.weight._version > versions[1] and still._version > versions[2]
    big.fill_(-7.0)  # (over the weight's old place; views of the buffer share its version)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    # Nothing moves: nothing counted.
    versions = (t._version, layer.weight._version)
    mem.release_tensor(big)
    mem.allocate_tensor(10)
    assert (t._version, layer.weight._version) == versions


def test_swapper_driven_like_deepspeeds_optimizer(tmp_path):
    handle = RecordingHandle(ds.aio_handle(block_size=1 << 16, queue_depth=8))
    timers = Timers()
    swapper = ds.AsyncTensorSwapper(handle, numel_alignment=256, timers=timers)
    assert not swapper.has_buffers()
    # Four pinned buffers of 4096 elements, as DeepSpeed's SwapBufferManager hands out.
    example = torch.zeros(1, dtype=torch.float32)
    buffers = [handle.handle.new_cpu_locked_tensor(4096, example).zero_() for _ in range(4)]
    swapper.add_buffers(buffers)
    assert swapper.has_buffers()
    rng = np.random.default_rng(3)
    expected = {}
    for batch in range(6):
        tensors = [torch.randn(int(rng.integers(1, 3000))) for _ in range(5)]
        paths = [str(tmp_path / f"g{batch}_{i}") for i in range(5)]
        before = len(handle.calls)
        swapper.swap_out_tensors(tensors, paths)
        for t, p in zip(tensors, paths):
            expected[p] = t.clone()
            t.fill_(float("nan"))  # the caller reuses its tensors at once
        if batch == 0:
            assert "wait" not in handle.calls[before:]  # buffers free: no waiting
    assert "wait" in handle.calls  # 6 x 5 tensors need more than four buffers: back-pressure
    returned = swapper.release_buffers()
    assert [id(b) for b in returned] == [id(b) for b in buffers]  # the caller's own objects
    assert not swapper.has_buffers()
    assert swapper.get_timer_names() == [] or ds.ASYNC_SWAPPER_WAIT_TIMER in swapper.get_timer_names()
    assert ("start", ds.ASYNC_SWAPPER_WAIT_TIMER) in timers.events
    assert timers.events.count(("start", ds.ASYNC_SWAPPER_WAIT_TIMER)) == \
        timers.events.count(("stop", ds.ASYNC_SWAPPER_WAIT_TIMER))
    # Raw files: the tensor's elements then zeros up to a multiple of 256 elements; read
    # back as DeepSpeed's swap-in does (async_pread of the aligned length).
    reader = ds.aio_handle()
    for path, tensor in expected.items():
        aligned = -(-tensor.numel() // 256) * 256
        data = pathlib_bytes(path)
        assert len(data) == 4 * aligned
        assert data == raw_bytes(torch.cat([tensor, torch.zeros(aligned - tensor.numel())]))
        back = torch.empty(aligned)
        assert reader.async_pread(back, path) == 0 and reader.wait() == 1
        assert torch.equal(back[:tensor.numel()], tensor)
    # The buffers come back reusable.
    swapper.add_buffers(returned)
    swapper.swap_out_tensors([torch.ones(10)], [str(tmp_path / "again")])
    swapper.release_buffers()
    assert pathlib_bytes(str(tmp_path / "again"))[:40] == raw_bytes(torch.ones(10))


def test_swapper_refuses_what_deepspeed_asserts_on(tmp_path):
    handle = ds.aio_handle()
    swapper = ds.AsyncTensorSwapper(handle, numel_alignment=64, timers=None)
    with pytest.raises(AssertionError, match="add_buffers first"):
        swapper.swap_out_tensors([torch.ones(4)], [str(tmp_path / "x")])
    with pytest.raises(AssertionError, match="not page-locked"):
        swapper.add_buffers([torch.zeros(1024)])
    pinned = handle.new_cpu_locked_tensor(1024, torch.zeros(1))
    swapper.add_buffers([pinned])
    with pytest.raises(AssertionError, match="has buffers already"):
        swapper.add_buffers([pinned])
    with pytest.raises(AssertionError, match="does not fit"):
        swapper.swap_out_tensors([torch.ones(1000)], [str(tmp_path / "big")])  # 1024 aligned: fits
        swapper.swap_out_tensors([torch.ones(1025)], [str(tmp_path / "big")])
    with pytest.raises(AssertionError, match="2 tensors but 1 paths"):
        swapper.swap_out_tensors([torch.ones(1), torch.ones(1)], [str(tmp_path / "y")])
    # A write that cannot be queued is an OSError; the swapper stays usable.
    swapper.swap_out_tensors([torch.ones(8)], [str(tmp_path / "no" / "dir" / "z")])
    with pytest.raises(OSError) as e:
        swapper.release_buffers()
    assert e.value.errno == errno.ENOENT
    swapper.add_buffers([pinned])
    swapper.swap_out_tensors([torch.ones(8)], [str(tmp_path / "ok")])
    assert swapper.release_buffers() == [pinned]
    with pytest.raises(ValueError, match="numel_alignment must be positive, not 0"):
        ds.AsyncTensorSwapper(handle, 0, None)
    # A fractional alignment is refused, not truncated (1.5 would pad every file to 1 element).
    for alignment in (1.5, "64"):
        with pytest.raises(TypeError):
            ds.AsyncTensorSwapper(handle, alignment, None)
    assert ds.AsyncTensorSwapper(handle, np.int64(64), None).numel_alignment == 64


@pytest.mark.parametrize("where", ["while filling", "at release"])
def test_a_refused_write_does_not_drop_the_other_tensors_of_its_buffer(tmp_path, where):
    """One tensor's write is refused at queuing (its folder does not exist). The tensors
    after it in the same buffer used to be dropped without a word; now every one is written,
    the writes in flight are waited for, and AIOError names the refused path."""
    handle = ds.aio_handle()
    swapper = ds.AsyncTensorSwapper(handle, numel_alignment=4, timers=None)
    buffers = [handle.new_cpu_locked_tensor(16, torch.zeros(1)) for _ in range(2)]
    swapper.add_buffers(buffers)
    tensors = [torch.full((4,), float(i)) for i in range(4)]
    paths = [str(tmp_path / "a"), str(tmp_path / "missing" / "b"), str(tmp_path / "c"), str(tmp_path / "d")]
    swapper.swap_out_tensors(tensors, paths)  # fills the first buffer exactly
    if where == "while filling":
        with pytest.raises(ds.AIOError) as e:
            swapper.swap_out_tensors([torch.full((4,), 9.0)], [str(tmp_path / "e")])  # queues the full buffer
        assert [err[0] for err in e.value.errors] == [paths[1]] and e.value.errno == errno.ENOENT
        # The swapper stays usable: the same call again stages the tensor in the other buffer.
        swapper.swap_out_tensors([torch.full((4,), 9.0)], [str(tmp_path / "e")])
        assert swapper.release_buffers() == buffers
        assert pathlib_bytes(str(tmp_path / "e")) == raw_bytes(torch.full((4,), 9.0))
    else:
        with pytest.raises(ds.AIOError) as e:
            swapper.release_buffers()
        assert [err[0] for err in e.value.errors] == [paths[1]] and e.value.errno == errno.ENOENT
    for i in (0, 2, 3):
        assert pathlib_bytes(paths[i]) == raw_bytes(tensors[i]), paths[i]
    assert handle.wait() == 0  # nothing left in flight


def test_conjugate_and_negative_views_are_written_and_read_as_their_values(tmp_path):
    """A lazy conjugate or negative view's memory holds its values unconjugated or negated;
    the handle stages it, so the file holds the tensor's values and a read fills them in."""
    h = ds.aio_handle(block_size=4096, queue_depth=4)
    z = torch.complex(random_tensor(1024, torch.float32, 21), random_tensor(1024, torch.float32, 22))
    r = random_tensor(1024, torch.float32, 23)
    for name, view, plain in [("conj", z.conj(), z.conj().resolve_conj()),
                              ("neg", torch._neg_view(r), -r)]:
        assert view.is_conj() or view.is_neg()
        path = str(tmp_path / name)
        assert h.sync_pwrite(view, path) == 1
        back = torch.empty_like(plain)
        assert h.sync_pread(back, path) == 1
        assert torch.equal(back, plain), name  # the file holds the view's values
        target = torch.zeros_like(plain)
        target = target.conj() if name == "conj" else torch._neg_view(target)
        assert h.async_pread(target, path) == 0 and h.wait() == 1
        assert torch.equal(target, plain), name  # and a read into a view gives it those values


UNLOCKED_SCRIPT = textwrap.dedent("""
    import os, warnings, torch
    from tensormem import deepspeed as ds
    if os.environ.get("TENSORMEM_ALLOW_UNLOCKED") != "1":
        try:
            ds.new_cpu_locked_tensor(4 << 20, torch.zeros(1))  # 16 MiB: over the 8 MiB limit
            print("LOCKED")
        except MemoryError as e:
            print("REFUSED", e)
        ds.allow_unlocked(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = ds.new_cpu_locked_tensor(4 << 20, torch.zeros(1))
        small = ds.new_cpu_locked_tensor(256, torch.zeros(1))  # fits the slab the limit locked: no warning
    t.fill_(2.0)
    print("WARNINGS", len(caught), caught[0].message if caught else "")
    print("TENSOR", float(t.sum()), ds.is_pinned(t), ds.free_cpu_locked_tensor(t), small.numel())
""")


@pytest.mark.parametrize("how", ["call", "environment"])
def test_new_cpu_locked_tensor_past_the_lock_limit_names_and_takes_the_unlocked_fallback(how):
    # A user without CAP_IPC_LOCK, RLIMIT_MEMLOCK 8 MiB: DeepSpeed's callers pass no options,
    # so the refusal names the two knobs (the pool's own words named an option no caller here
    # could set), and with either one the tensor is made of unlocked memory, with a warning.
    if os.geteuid() != 0:
        pytest.skip("needs root to run the child as user nobody (without CAP_IPC_LOCK)")

    def limited():
        import resource
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 << 20, 8 << 20))
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TENSORMEM_ALLOW_UNLOCKED", None)
    if how == "environment":
        env["TENSORMEM_ALLOW_UNLOCKED"] = "1"
    r = subprocess.run([sys.executable, "-c", UNLOCKED_SCRIPT], preexec_fn=limited, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    if how == "call":
        refused = lines.pop(0)
        assert refused.startswith("REFUSED new_cpu_locked_tensor: ") and "RLIMIT_MEMLOCK is 8388608 bytes" in refused
        assert refused.endswith("or allow unlocked memory where the limit refuses (TENSORMEM_ALLOW_UNLOCKED=1 in the "
                                "environment, or tensormem.deepspeed.allow_unlocked(True))"), refused
    warned, made = lines
    assert warned.startswith("WARNINGS 1 new_cpu_locked_tensor: 16777216 bytes could not be page-locked "
                             "(RLIMIT_MEMLOCK): unlocked memory"), warned
    assert made == "TENSOR 8388608.0 True True 256", made


def test_allow_unlocked_takes_a_bool_only():
    with pytest.raises(TypeError, match="allow_unlocked: expected True or False, not 'no'"):
        ds.allow_unlocked("no")
    assert ds._PINNED.allow_unlocked is (os.environ.get("TENSORMEM_ALLOW_UNLOCKED", "") == "1")  # unchanged
