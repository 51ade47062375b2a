"""tensormem.deepspeed.aio_handle next to fio: one pinned tensor written and read whole.

For each round, in turn: sync_pwrite, sync_pread, async_pwrite + wait, async_pread + wait of
one page-locked tensor (O_DIRECT, BLOCK-byte requests, QUEUE_DEPTH in flight), then fio
writing and reading a file of the same size with the same request size and depth (io_uring,
O_DIRECT), and, given ``--deepspeed-op PATH`` (DeepSpeed's async_io op built as a torch
extension), the same four calls on DeepSpeed's handle and its own pinned tensor. Prints GB/s and CPU seconds per GB (user + system of the whole process, so the
rings' threads count) per method, medians over the rounds, and one JSON line.

    PYTHONPATH=build/python /usr/bin/python3 bench/aio_handle_bench.py --dir /work/aiobench
"""

import importlib.machinery
import importlib.util

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import time

import torch

from tensormem import deepspeed as ds


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn):
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_seconds() - c0


def fio(path, rw, nbytes, block, depth):
    cmd = ["fio", "--name=t", f"--filename={path}", f"--rw={rw}", f"--bs={block}", f"--size={nbytes}",
           "--direct=1", "--ioengine=io_uring", f"--iodepth={depth}", "--output-format=json"]
    job = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    seconds = side["runtime"] / 1000.0
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * seconds
    return seconds, cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--bytes", type=int, default=4 << 30)
    parser.add_argument("--block", type=int, default=1 << 20)
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-fio", action="store_true")
    parser.add_argument("--deepspeed-op", help="path of DeepSpeed's built async_io op (.so), run beside")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "aio_handle_bench.bin")
    fio_path = os.path.join(args.dir, "aio_handle_bench.fio")
    numel = args.bytes // 4
    tensor = ds.new_cpu_locked_tensor(numel, torch.zeros(1))
    tensor.copy_(torch.arange(numel, dtype=torch.float32))
    h = ds.aio_handle(block_size=args.block, queue_depth=args.queue_depth)
    methods = {
        "sync_pwrite": lambda: h.sync_pwrite(tensor, path),
        "sync_pread": lambda: h.sync_pread(tensor, path),
        "async_pwrite": lambda: (h.async_pwrite(tensor, path), h.wait()),
        "async_pread": lambda: (h.async_pread(tensor, path), h.wait()),
    }
    if args.deepspeed_op:
        loader = importlib.machinery.ExtensionFileLoader("async_io_op", args.deepspeed_op)
        spec = importlib.util.spec_from_file_location("async_io_op", args.deepspeed_op, loader=loader)
        op = importlib.util.module_from_spec(spec)
        loader.exec_module(op)
        dsh = op.aio_handle(args.block, args.queue_depth, False, True, 1)
        ds_tensor = dsh.new_cpu_locked_tensor(numel, torch.zeros(1))
        ds_tensor.copy_(tensor)
        ds_path = os.path.join(args.dir, "aio_handle_bench.ds")
        methods["ds_sync_pwrite"] = lambda: dsh.sync_pwrite(ds_tensor, ds_path)
        methods["ds_sync_pread"] = lambda: dsh.sync_pread(ds_tensor, ds_path)
        methods["ds_async_pwrite"] = lambda: (dsh.async_pwrite(ds_tensor, ds_path), dsh.wait())
        methods["ds_async_pread"] = lambda: (dsh.async_pread(ds_tensor, ds_path), dsh.wait())
    if not args.no_fio and shutil.which("fio"):
        methods["fio_write"] = lambda: fio(fio_path, "write", args.bytes, args.block, args.queue_depth)
        methods["fio_read"] = lambda: fio(fio_path, "read", args.bytes, args.block, args.queue_depth)
    samples = {name: [] for name in methods}
    try:
        for _ in range(args.rounds):
            for name, fn in methods.items():
                if name.startswith("fio"):
                    seconds, cpu = fn()
                else:
                    seconds, cpu = timed(fn)
                samples[name].append((args.bytes / seconds / 1e9, cpu / (args.bytes / 1e9)))
        expected = torch.arange(numel, dtype=torch.float32)
        assert torch.equal(tensor, expected), "the data read back differs"
        if args.deepspeed_op:
            assert torch.equal(ds_tensor, expected), "DeepSpeed's data read back differs"
    finally:
        for p in (path, fio_path, os.path.join(args.dir, "aio_handle_bench.ds")):
            if os.path.exists(p):
                os.remove(p)
    result = {"bytes": args.bytes, "block": args.block, "queue_depth": args.queue_depth,
              "engine": h.stats()["engine"], "fallback": h.stats()["fallback"], "direct_ops": h.stats()["direct_ops"]}
    print(f"{args.bytes / 2**30:.1f} GiB pinned tensor, {args.block} B requests, queue depth {args.queue_depth}, "
          f"engine {result['engine']}, medians of {args.rounds} rounds")
    for name, values in samples.items():
        gbps = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        result[name] = {"gbps": gbps, "cpu_s_per_gb": cpu, "all_gbps": [round(v[0], 3) for v in values]}
        print(f"  {name:<13} {gbps:6.2f} GB/s   {cpu:6.3f} CPU s/GB   (rounds: "
              + ", ".join(f"{v[0]:.2f}" for v in values) + ")")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
