"""Planned arenas of torchvision models next to eager PyTorch (tensormem.torch.plan_module).

For each model and case: eager peak (PyTorch's allocator hook where tensormem has it,
else torch.profiler's memory events), online best fit
(tensormem's best_fit_allocator replaying the buffers), the planned arena, the lower bound,
and the planner's seconds. Prints a markdown table.

    PYTHONPATH=build/python /usr/bin/python3 bench/model_plan_bench.py
"""

import argparse
import time

import torch
import torchvision

from tensormem.torch import plan_module

MODELS = ["resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "vit_b_16"]
CASES = [("inference", 1, False), ("inference", 32, False), ("training step", 1, True)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--time-limit", type=float, default=2.0)
    parser.add_argument("--skip", nargs="*", default=[], help="MODEL:BATCH cases to leave out")
    args = parser.parse_args()
    torch.manual_seed(0)
    print("| model | case | buffers | eager peak MiB | online best fit MiB | planned arena MiB | lower bound MiB "
          "| arena / LB | eager / arena | plan s | total s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    mib = float(1 << 20)
    for name in args.models:
        model = torchvision.models.get_model(name, weights=None).eval()
        for case, batch, training in CASES:
            if f"{name}:{batch}" in args.skip:
                continue
            x = torch.randn(batch, 3, 224, 224)
            t0 = time.perf_counter()
            p = plan_module(model, x, training=training, time_limit=args.time_limit)
            total = time.perf_counter() - t0
            print(f"| {name} | {case}, batch {batch} | {len(p.graph.buffers)} | {p.eager_peak / mib:.1f} "
                  f"| {p.online_best_fit / mib:.1f} | {p.arena_bytes / mib:.1f} | {p.lower_bound / mib:.1f} "
                  f"| {p.arena_bytes / p.lower_bound:.4f} | {p.eager_peak / p.arena_bytes:.3f} "
                  f"| {p.plan_seconds:.2f} | {total:.1f} |", flush=True)


if __name__ == "__main__":
    main()
