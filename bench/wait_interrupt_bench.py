"""How soon Ctrl-C ends a wait for I/O in Python.

A SIGINT is sent to the process at a random time (uniform in [0.05, 0.5] s) while the main
thread waits for a transfer of 128 MiB in 4 KiB requests, one at a time (seconds long): a
``TensorSwapper.wait`` of a swap-out, and DeepSpeed's ``aio_handle.wait`` of an
``async_pwrite``; and while it runs an ``OffloadedAdamW.step`` of 64 Mi parameters in 1 MiB
sub-groups, which the interruption undoes. Prints, per wait, a Markdown row: the rounds, then
the minimum, median and maximum milliseconds from the signal to ``KeyboardInterrupt``. The
interrupted transfer is then collected by a second wait, as a user would; the undone step is
checked to have left the parameters and the step count as they were.

    PYTHONPATH=build/python /usr/bin/python3 bench/wait_interrupt_bench.py --rounds 20
"""

import argparse
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time

import numpy as np
import torch

import tensormem
from tensormem.deepspeed import aio_handle


def latency_ms(rng, wait):
    """Milliseconds from a SIGINT to the KeyboardInterrupt that ends wait(), or None."""
    sent = []

    def interrupt():
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(rng.uniform(0.05, 0.5), interrupt)
    timer.start()
    try:
        wait()
    except KeyboardInterrupt:
        return (time.perf_counter() - sent[0]) * 1000
    finally:
        timer.cancel()
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    folder = tempfile.mkdtemp(dir=args.dir)
    try:
        data = np.ones(128 << 20, dtype=np.uint8)
        swapper = tensormem.TensorSwapper(tensormem.PinnedPool(), queue_depth=1, block_bytes=4096, direct=False)
        handle = aio_handle(block_size=4096, queue_depth=1)
        path = os.path.join(folder, "f")
        waits = {
            "TensorSwapper.wait": (lambda: swapper.swap_out([data], [path]), swapper.wait),
            "aio_handle.wait": (lambda: handle.async_pwrite(torch.from_numpy(data), path), lambda _t: handle.wait()),
        }
        from tensormem.offload import OffloadedAdamW
        param = torch.nn.Parameter(torch.randn(64 << 20))
        param.grad = torch.randn(64 << 20)
        before = param.detach().clone()
        optimizer = OffloadedAdamW([param], swap_dirs=[folder], group_bytes=1 << 20, pinned_budget=16 << 20)

        def undone(_ticket):
            try:
                optimizer.step()
            finally:
                assert optimizer._core.steps == [0] and torch.equal(param.detach(), before), "a step was left"

        waits["OffloadedAdamW.step (undone)"] = (lambda: None, undone)
        print("| wait | rounds interrupted | min ms | median ms | max ms |")
        print("|---|---:|---:|---:|---:|")
        for name, (start, wait) in waits.items():
            got = []
            for _ in range(args.rounds):
                ticket = start()
                ms = latency_ms(rng, lambda: wait(ticket))
                if ms is not None:
                    got.append(ms)
                    if ticket is not None:
                        wait(ticket)  # collects the transfer the interruption left running
            print(f"| {name} | {len(got)} of {args.rounds} | {min(got):.1f} | {statistics.median(got):.1f} | {max(got):.1f} |")
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
