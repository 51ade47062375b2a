"""The Python blocks of README.md, run as a reader would paste them.

Each block runs in a fresh interpreter after a preamble that defines the names a block takes
as the reader's own (a parameter, a model and its input, a trace's arrays). Paths under
/nvme move into the test's folder, and two sizes chosen for a real run are made smaller: the
ResNet-50 input (batch 32 at 224 x 224) and a 256 MiB locked tensor. Nothing else in a block is
changed, so a renamed function, a changed signature or a wrong keyword in the README fails here.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"

PREAMBLE = """
def _readers_own():  # built here so that the block's own imports are what it can use
    import numpy as np
    import torch
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=4), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 2))
    x = torch.randn(2, 3, 64, 64)
    return dict(param=torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.half)),
                lower=np.array([0, 1, 2]), upper=np.array([2, 3, 4]), size=np.array([100, 200, 300]),
                model=model, x=x, loss=model(x).sum())
globals().update(_readers_own())
"""

SMALLER = {
    "torch.randn(32, 3, 224, 224)": "torch.randn(2, 3, 64, 64)",
    "new_cpu_locked_tensor(1 << 28,": "new_cpu_locked_tensor(1 << 20,",
}


BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_the_readme_has_its_python_blocks():
    # A changed fence or a moved README would otherwise leave the test below with nothing to run.
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[b.splitlines()[0][:40] for b in BLOCKS])
def test_a_readme_block_runs(index, tmp_path):
    block = BLOCKS[index]
    for before, after in SMALLER.items():
        block = block.replace(before, after)
    for folder in ("nvme", "nvme0/swap", "nvme1/swap"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    block = block.replace('"/nvme', f'"{tmp_path}/nvme')
    script = tmp_path / "block.py"
    script.write_text(PREAMBLE + block)
    env = dict(os.environ)  # the block runs in tmp_path: the module's folder made absolute
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, f"README block {index}:\n{block}\n--- stderr ---\n{run.stderr}"
    assert "Traceback" not in run.stderr, run.stderr


def run_cpp_block_writer(readme_text, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(readme_text)
    writer = pathlib.Path(__file__).resolve().parents[1] / "readme_cpp_blocks.py"
    return subprocess.run([sys.executable, str(writer), str(readme), str(tmp_path / "out.cpp")],
                          capture_output=True, text=True, timeout=60)


def test_the_cpp_block_writer_refuses_a_readme_it_does_not_know(tmp_path):
    # The program that runs README's C++ blocks (readme.cpp_blocks) is written by this script;
    # a README whose blocks it cannot match fails with a reason, never with a shorter program.
    text = README.read_text()
    whole = run_cpp_block_writer(text, tmp_path)
    assert whole.returncode == 0, whole.stderr
    assert (tmp_path / "out.cpp").read_text().count("void readme_block_") == text.count("```cpp\n")
    fewer = run_cpp_block_writer(text.replace("```cpp\n", "```\n", 1), tmp_path)
    assert fewer.returncode != 0 and "fewer than the six it had" in fewer.stderr
    changed = run_cpp_block_writer(text.replace("best_fit_allocator exact;", "best_fit_allocator exact2;"), tmp_path)
    assert changed.returncode != 0 and "a block this script knows by a line has changed" in changed.stderr
