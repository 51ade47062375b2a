"""bench/iopddl_to_csv.py on small contest-shaped problems. Oracle for --times contest: two
buffers conflict exactly when their inclusive contest intervals meet."""

import csv
import gzip
import json
import os
import random
import subprocess
import sys

import pytest

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


def run_script(*args):
    script = os.path.join(BENCH, "iopddl_to_csv.py")
    return subprocess.run([sys.executable, script, *map(str, args)], capture_output=True,
                          text=True)


@pytest.mark.parametrize("body, message", [
    (problem([[0, 1], [2, 3]], [[1]]), "2 intervals but 1 usage lists"),
    (problem([[0, 1.5]], [[1]]), "node 0: end: 1.5 is not a non-negative integer"),
    (problem([[-1, 2]], [[1]]), "node 0: start: -1 is not a non-negative integer"),
    (problem([[0, 2]], [[4, -3]]), "node 0: usage: -3 is not a non-negative integer"),
    (problem([[0, 2]], [[True]]), "node 0: usage: True is not a non-negative integer"),
    (problem([[0, 1, 2]], [[1]]), "node 0: expected [start, end] and at least one usage"),
    ({"problem": {"nodes": {"intervals": []}}}, "no problem.nodes.intervals and problem.nodes.usages"),
    ([1, 2], "no problem.nodes.intervals and problem.nodes.usages"),
])
def test_bad_problems_are_named_and_leave_the_output_as_it_was(tmp_path, body, message):
    src = tmp_path / "p.json"
    src.write_text(json.dumps(body))
    dst = tmp_path / "out.csv"
    dst.write_text("kept\n")
    r = run_script(src, dst)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert dst.read_text() == "kept\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv", "p.json"]


def test_unreadable_input_and_unwritable_output_are_errors(tmp_path):
    r = run_script(tmp_path / "missing.json", tmp_path / "out.csv")
    assert r.returncode == 2 and "missing.json" in r.stderr
    garbage = tmp_path / "g.json.gz"
    garbage.write_bytes(b"not gzip at all")
    r = run_script(garbage, tmp_path / "out.csv")
    assert r.returncode == 2 and "error" in r.stderr
    src = tmp_path / "p.json"
    src.write_text(json.dumps(problem([[0, 1]], [[1]])))
    r = run_script(src, tmp_path / "no_such_dir" / "out.csv")
    assert r.returncode == 2 and "no_such_dir" in r.stderr
    assert not (tmp_path / "out.csv").exists()
