#!/usr/bin/env python3
"""Turn a problem of the ASPLOS/EuroSys 2025 IOPDDL contest (google/iopddl,
benchmarks/*.json.gz, Apache-2.0) into a planner trace (id,lower,upper,size).

Each graph node becomes one buffer: its interval [start, end] is inclusive in the contest
files, and its size is one of the node's candidate memory usages plus one byte (every
buffer is at least one byte), chosen by --policy: the largest, the smallest, or one drawn
by a seeded generator. The output is deterministic.

--times contest (default): [start, end] becomes [start, end + 1), so two buffers conflict
exactly when their contest intervals meet.
--times idealloc: the times of idealloc's iopddl traces (cappadokes/idealloc,
benchmarks/iopddl: the times of S_1 and Y_1 are this mode on contest problems S and R): events
are swept in time order, ends before starts at equal times; a buffer starting after k runs
of starts that were each followed by an end gets [start + k, end + k + 2). Later buffers
move up while earlier ones keep their end, so some contest conflicts are lost (a trace,
not a contest problem, is planned then).

Usage: iopddl_to_csv.py PROBLEM.json[.gz] OUT.csv [--policy biggest|smallest|random]
                        [--seed N] [--times contest|idealloc]
"""
import argparse
import gzip
import json
import random
import sys


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["problem"]["nodes"]


def to_buffers(nodes, policy, seed, times="contest"):
    """Returns {node index: (lower, upper, size)} with half-open lifetimes."""
    rng = random.Random(seed)
    spans = []
    for index, (interval, usages) in enumerate(zip(nodes["intervals"], nodes["usages"])):
        if len(interval) != 2 or not usages:
            raise ValueError(f"node {index}: expected [start, end] and at least one usage")
        start, end = int(interval[0]), int(interval[1])
        if end < start:
            raise ValueError(f"node {index}: interval [{start}, {end}] ends before it starts")
        if policy == "biggest":
            size = max(usages)
        elif policy == "smallest":
            size = min(usages)
        else:
            size = rng.choice(usages)
        spans.append((start, end + 1, int(size) + 1))
    if times == "contest":
        return dict(enumerate(spans))
    # (time, kind, tie, node): ends (kind 0) before starts (kind 1); order among starts at
    # one time does not change the output.
    events = []
    for index, (lower, upper, _) in enumerate(spans):
        events.append((lower, 1, index))
        events.append((upper, 0, index))
    events.sort()
    shift = 0
    after_start = True
    out = {}
    for _, kind, index in events:
        lower, upper, size = spans[index]
        if kind == 1:
            out[index] = (lower + shift, upper + shift + 1, size)
            after_start = True
        elif after_start:
            shift += 1
            after_start = False
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("problem")
    parser.add_argument("out")
    parser.add_argument("--policy", choices=["biggest", "smallest", "random"], default="biggest")
    parser.add_argument("--seed", type=int, default=1, help="seed of --policy random")
    parser.add_argument("--times", choices=["contest", "idealloc"], default="contest")
    args = parser.parse_args(argv)
    buffers = to_buffers(load(args.problem), args.policy, args.seed, args.times)
    with open(args.out, "w") as f:
        f.write("id,lower,upper,size\n")
        for index in sorted(buffers):
            lower, upper, size = buffers[index]
            f.write(f"{index},{lower},{upper},{size}\n")
    print(f"{args.out}: {len(buffers)} buffers", file=sys.stderr)


if __name__ == "__main__":
    main()
