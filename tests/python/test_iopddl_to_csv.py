"""bench/iopddl_to_csv.py on small contest-shaped problems. Oracle for --times contest: two
buffers conflict exactly when their inclusive contest intervals meet."""

import csv
import gzip
import json
import os
import random
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)
import iopddl_to_csv  # noqa: E402

def problem(intervals, usages):
    return {"problem": {"name": "t", "nodes": {"intervals": intervals, "costs": [[0]] * len(usages),
                                               "usages": usages},
                        "edges": {"nodes": [], "costs": []}, "usage_limit": 1}}

def meet(a, b):
    return a[0] <= b[1] and b[0] <= a[1]

def conflict(a, b):
    return a[0] < b[1] and b[0] < a[1]

def test_contest_times_keep_exactly_the_conflicts():
    rng = random.Random(3)
    for _ in range(20):
        n = rng.randrange(1, 60)
        intervals = []
        for _ in range(n):
            start = rng.randrange(0, 30)
            intervals.append([start, start + rng.randrange(0, 8)])
        usages = [[rng.randrange(0, 100) for _ in range(rng.randrange(1, 4))] for _ in range(n)]
        nodes = problem(intervals, usages)["problem"]["nodes"]
        for policy in ("biggest", "smallest", "random"):
            out = iopddl_to_csv.to_buffers(nodes, policy, 7)
            assert sorted(out) == list(range(n))
            for i in range(n):
                lower, upper, size = out[i]
                assert lower < upper
                assert size - 1 in usages[i]
                if policy == "biggest":
                    assert size == max(usages[i]) + 1
                if policy == "smallest":
                    assert size == min(usages[i]) + 1
                for j in range(n):
                    assert conflict(out[i][:2], out[j][:2]) == meet(intervals[i], intervals[j])
            # a fixed seed gives the same draw
            assert out == iopddl_to_csv.to_buffers(nodes, policy, 7)

def test_idealloc_times_on_a_worked_example():
    # [0,1] [1,2] [3,3]: events start 0, start 1, end 0 (after starts: later times move up
    # by one), end 1, start 2, end 2.
    nodes = problem([[0, 1], [1, 2], [3, 3]], [[4], [5], [6]])["problem"]["nodes"]
    out = iopddl_to_csv.to_buffers(nodes, "biggest", 1, "idealloc")
    assert out == {0: (0, 3, 5), 1: (1, 4, 6), 2: (4, 6, 7)}

def test_command_line_writes_a_trace_and_rejects_bad_nodes(tmp_path):
    src = tmp_path / "p.json.gz"
    with gzip.open(src, "wt") as f:
        json.dump(problem([[2, 5], [0, 0]], [[10, 20], [3]]), f)
    dst = tmp_path / "p.csv"
    script = os.path.join(BENCH, "iopddl_to_csv.py")
    subprocess.run([sys.executable, script, str(src), str(dst), "--policy", "smallest"], check=True)
    with open(dst) as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"id": "0", "lower": "2", "upper": "6", "size": "11"},
                    {"id": "1", "lower": "0", "upper": "1", "size": "4"}]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(problem([[5, 2]], [[1]])))
    r = subprocess.run([sys.executable, script, str(bad), str(tmp_path / "x.csv")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "node 0: interval [5, 2] ends before it starts" in r.stderr
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(problem([[0, 1]], [[]])))
    r = subprocess.run([sys.executable, script, str(empty), str(tmp_path / "y.csv")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "node 0: expected [start, end] and at least one usage" in r.stderr
