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

Errors (exit status 2, the node named): interval and usage lists of different lengths, a
time or usage that is not a non-negative integer, an interval that ends before it starts,
a node without usages, an unreadable or malformed file. The trace is written to
OUT.partial and renamed to OUT, so a failed run leaves no partial trace and an existing OUT
as it was.

Usage: iopddl_to_csv.py PROBLEM.json[.gz] OUT.csv [--policy biggest|smallest|random]
                        [--seed N] [--times contest|idealloc]
"""
import argparse
import gzip
import json
import os
import random
import sys


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        problem = json.load(f)
    try:
        nodes = problem["problem"]["nodes"]
        nodes["intervals"], nodes["usages"]
    except (KeyError, TypeError):
        raise ValueError(f"{path}: no problem.nodes.intervals and problem.nodes.usages") from None
    return nodes


def whole(value, what):
    """A non-negative integer of the file, or a ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}: {value!r} is not a non-negative integer")
    return value


def to_buffers(nodes, policy, seed, times="contest"):
    """Returns {node index: (lower, upper, size)} with half-open lifetimes."""
    rng = random.Random(seed)
    if len(nodes["intervals"]) != len(nodes["usages"]):
        raise ValueError(f"{len(nodes['intervals'])} intervals but {len(nodes['usages'])} "
                         "usage lists: one of each per node")
    spans = []
    for index, (interval, usages) in enumerate(zip(nodes["intervals"], nodes["usages"])):
        if not isinstance(interval, list) or len(interval) != 2 or not isinstance(usages, list) \
                or not usages:
            raise ValueError(f"node {index}: expected [start, end] and at least one usage")
        start = whole(interval[0], f"node {index}: start")
        end = whole(interval[1], f"node {index}: end")
        usages = [whole(u, f"node {index}: usage") for u in usages]
        if end < start:
            raise ValueError(f"node {index}: interval [{start}, {end}] ends before it starts")
        if policy == "biggest":
            size = max(usages)
        elif policy == "smallest":
            size = min(usages)
        else:
            size = rng.choice(usages)
        spans.append((start, end + 1, size + 1))
    if times == "contest":
        return dict(enumerate(spans))
    # (time, kind, node): ends (kind 0) before starts (kind 1); order among starts at one
    # time does not change the output.
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
    # Written beside the output and renamed over it: a failed run leaves no partial trace and
    # an existing output as it was.
    partial = args.out + ".partial"
    try:
        buffers = to_buffers(load(args.problem), args.policy, args.seed, args.times)
        with open(partial, "w") as f:
            f.write("id,lower,upper,size\n")
            for index in sorted(buffers):
                lower, upper, size = buffers[index]
                f.write(f"{index},{lower},{upper},{size}\n")
        os.replace(partial, args.out)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        if os.path.exists(partial):
            os.remove(partial)
        parser.exit(2, f"iopddl_to_csv.py: error: {e}\n")
    print(f"{args.out}: {len(buffers)} buffers", file=sys.stderr)


if __name__ == "__main__":
    main()
