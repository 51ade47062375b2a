"""Offloaded optimizer benchmark: one AdamW step with its state on disk against the disk-bound
floor, the update kernel against torch.optim.AdamW(foreach=True), and striping over folders.

    PYTHONPATH=build/python /usr/bin/python3 bench/offload_bench.py --param-gib 4 \
        --folders /var/tmp/tm-a --folders /var/tmp/tm-a,/var/tmp/tm-b,/var/tmp/tm-c
    PYTHONPATH=build/python /usr/bin/python3 bench/offload_bench.py --wrapper-mparams 25

Per folder set: the optimizer is built (its first state written to new files), the state is
written twice more (both generations' files then exist; the second of these is the write
rate), read back through the pipeline without computing (the read rate), then one step is
timed. The floor is bytes read / read rate + bytes written / write rate, all measured in the
same run.
"""

import argparse
import json
import os
import time

import torch

from tensormem import _tensormem
from tensormem.offload import OffloadedAdamW


def kernel_bench(mib, rounds):
    n = mib << 18  # float32 elements
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    m = torch.zeros(n)
    v = torch.zeros(n)
    ours = []
    for r in range(rounds):
        t = time.perf_counter()
        _tensormem.adam_update(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n, 1e-3, 0.9, 0.999, 1e-8,
                               0.01, True, r + 1)
        ours.append(time.perf_counter() - t)
    tp = p.clone().requires_grad_(True)
    tp.grad = g
    opt = torch.optim.AdamW([tp], lr=1e-3, weight_decay=0.01, foreach=True)
    opt.step()  # creates the state
    theirs = []
    for _ in range(rounds):
        t = time.perf_counter()
        opt.step()
        theirs.append(time.perf_counter() - t)
    bytes_ = n * 4
    return {"param_mib": mib, "simd": _tensormem.simd_level(), "threads": 1,
            "tensormem_gbps": bytes_ / min(ours) / 1e9, "torch_foreach_gbps": bytes_ / min(theirs) / 1e9}


def step_bench(folders, param_gib, budget_mib, group_mib, stripe_mib):
    n = param_gib << 28
    p = torch.empty(n).uniform_(-1, 1).requires_grad_(True)
    p.grad = torch.empty(n).uniform_(-1e-3, 1e-3)
    t = time.perf_counter()
    opt = OffloadedAdamW([p], lr=1e-3, swap_dirs=folders, pinned_budget=budget_mib << 20,
                         group_bytes=group_mib << 20, stripe_bytes=stripe_mib << 20)
    new_files_s = time.perf_counter() - t
    state_bytes = opt.io_stats()["bytes_written"]
    # Steady state: both generations' files exist (the first writes to new files are slower on
    # ext4, reported apart). The write rate: the first state written again, over old files.
    opt._core.initialize([p.data_ptr()])
    t = time.perf_counter()
    opt._core.initialize([p.data_ptr()])
    write_gbps = state_bytes / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    opt._core.visit(lambda g, rec: None, copy=False)
    read_gbps = state_bytes / (time.perf_counter() - t) / 1e9
    opt.step()
    s = opt.last_stats
    floor = s["bytes_read"] / (read_gbps * 1e9) + s["bytes_written"] / (write_gbps * 1e9)
    io = opt.io_stats()
    result = {"folders": len(folders), "param_gib": param_gib, "state_gib_on_disk": state_bytes / 2**30,
              "pinned_budget_mib": budget_mib, "group_mib": group_mib, "stripe_mib": stripe_mib,
              "new_files_write_gbps": state_bytes / new_files_s / 1e9, "write_gbps": write_gbps, "read_gbps": read_gbps, "step_seconds": s["seconds"],
              "floor_seconds": floor, "step_over_floor": s["seconds"] / floor,
              "compute_seconds": s["compute_seconds"], "io_wait_seconds": s["io_wait_seconds"],
              "overlap_ratio": s["overlap_ratio"], "bytes_read": s["bytes_read"], "bytes_written": s["bytes_written"],
              "pinned_high_water_mib": s["pinned_high_water"] / 2**20, "engine": io["engine"],
              "fallback": io["fallback"], "direct_ops": io["direct_ops"], "buffered_ops": io["buffered_ops"]}
    del opt, p
    return result


def wrapper_bench(folder, mparams, rounds):
    """What the Python wrapper adds (medians of `rounds` calls): state_dict and load_state_dict
    of one parameter of `mparams` million floats (their records handed over without copies),
    the core's visit with and without copies of the records, and, per step, the parameter check
    and the views held during the core's step for 1,000 parameters of 1,024 floats."""
    def median(f):
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]

    p = torch.nn.Parameter(torch.randn(mparams * 10**6, generator=torch.Generator().manual_seed(0)))
    opt = OffloadedAdamW([p], swap_dirs=[folder], pinned_budget=256 << 20)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    out = {"mparams": mparams, "state_dict_s": median(opt.state_dict),
           "load_state_dict_s": median(lambda: opt.load_state_dict(sd)),
           "visit_copies_s": median(lambda: opt._core.visit(lambda g, rec: None)),
           "visit_no_copies_s": median(lambda: opt._core.visit(lambda g, rec: None, copy=False))}
    del opt, sd
    small = [torch.nn.Parameter(torch.zeros(1024)) for _ in range(1000)]
    opt = OffloadedAdamW(small, swap_dirs=[folder])
    for q in small:
        q.grad = torch.zeros_like(q)
    out["check_1000_params_ms"] = median(opt._check_params) * 1e3
    out["views_1000_params_ms"] = median(lambda: [q.data for q in opt._params]) * 1e3
    out["step_1000_params_ms"] = median(opt.step) * 1e3
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--param-gib", type=int, default=4)
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--group-mib", type=int, default=16, help="parameter MiB per sub-group")
    ap.add_argument("--stripe-mib", type=int, default=8)
    ap.add_argument("--folders", action="append", default=None,
                    help="comma-separated folder set (repeat for several sets)")
    ap.add_argument("--kernel-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--wrapper-mparams", type=int, default=0,
                    help="instead: what the Python wrapper adds, with one parameter of this many million floats")
    args = ap.parse_args()
    if args.wrapper_mparams:
        folder = (args.folders or ["/var/tmp/tensormem-offload-bench"])[0].split(",")[0]
        os.makedirs(folder, exist_ok=True)
        r = wrapper_bench(folder, args.wrapper_mparams, args.rounds)
        print(json.dumps(r, indent=1) if args.json else
              f"{r['mparams']} M parameters: state_dict {r['state_dict_s']:.3f} s, load_state_dict "
              f"{r['load_state_dict_s']:.3f} s, visit {r['visit_copies_s']:.3f} s with copies, "
              f"{r['visit_no_copies_s']:.3f} s without; 1,000 parameters of 1,024 floats: check "
              f"{r['check_1000_params_ms']:.2f} ms, views {r['views_1000_params_ms']:.2f} ms, step "
              f"{r['step_1000_params_ms']:.1f} ms")
        return
    sets = [f.split(",") for f in (args.folders or ["/var/tmp/tensormem-offload-bench"])]
    for s in sets:
        for d in s:
            os.makedirs(d, exist_ok=True)
    out = {"kernel": kernel_bench(args.kernel_mib, args.rounds), "steps": []}
    k = out["kernel"]
    print(f"AdamW kernel, 1 thread, {k['param_mib']} MiB of parameters: tensormem ({k['simd']}) "
          f"{k['tensormem_gbps']:.2f} GB/s, torch.optim.AdamW(foreach=True) {k['torch_foreach_gbps']:.2f} GB/s",
          flush=True)
    for s in sets:
        r = step_bench(s, args.param_gib, args.budget_mib, args.group_mib, args.stripe_mib)
        out["steps"].append(r)
        print(f"{r['folders']} folder(s): state {r['state_gib_on_disk']:.1f} GiB, write {r['write_gbps']:.2f} GB/s "
              f"(new files {r['new_files_write_gbps']:.2f}), "
              f"read {r['read_gbps']:.2f} GB/s; step {r['step_seconds']:.2f} s, floor {r['floor_seconds']:.2f} s "
              f"({r['step_over_floor']:.3f}x), compute {r['compute_seconds']:.2f} s, waited {r['io_wait_seconds']:.2f} s, "
              f"pinned peak {r['pinned_high_water_mib']:.0f} MiB of {r['pinned_budget_mib']} "
              f"[{r['engine']}{', ' + r['fallback'] if r['fallback'] else ''}]", flush=True)
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
