"""Builds the tensormem extension with the project's CMake build.

The version comes from CMakeLists.txt. Extra CMake arguments: the environment variable
TENSORMEM_CMAKE_ARGS (for example "-DTENSORMEM_CUDA=OFF"); parallel jobs: CMAKE_BUILD_PARALLEL_LEVEL
(default: every core).
"""

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


def project_version() -> str:
    text = (ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    found = re.search(r"project\(tensormem VERSION ([0-9.]+)", text)
    if not found:
        raise RuntimeError("CMakeLists.txt does not state the project's version")
    return found.group(1)


def pybind11_cmake_dir():
    """The CMake package of the pybind11 this interpreter imports: the one pip installed in
    the build environment (or, with --no-build-isolation, the one the environment has), so
    that CMake does not take another from its own search path (an older system pybind11
    misreads numpy 2's arrays). None when pybind11 is not importable."""
    try:
        import pybind11
    except ImportError:
        return None
    return pybind11.get_cmake_dir()


class CMakeBuild(build_ext):
    """Configures the project for this interpreter, builds only the module, copies it in."""

    def build_extension(self, ext: Extension) -> None:
        if shutil.which("cmake") is None:
            raise RuntimeError("building tensormem needs cmake (Debian: apt-get install cmake ninja-build)")
        build_dir = pathlib.Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DTENSORMEM_BUILD_TESTS=OFF",
            "-DTENSORMEM_PYTHON=ON",
            f"-DPython3_EXECUTABLE={sys.executable}",
        ]
        if (pybind11_dir := pybind11_cmake_dir()) is not None:
            configure.append(f"-Dpybind11_DIR={pybind11_dir}")
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        configure += shlex.split(os.environ.get("TENSORMEM_CMAKE_ARGS", ""))
        subprocess.run(configure, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        targets = ["_tensormem"]
        cache = (build_dir / "CMakeCache.txt").read_text(encoding="utf-8")
        if re.search(r"^TENSORMEM_C10_LIBRARY:FILEPATH=/", cache, re.M):
            targets.append("_tensormem_torch")  # PyTorch's allocator hook, where libc10 is there
        subprocess.run(["cmake", "--build", str(build_dir), "--target", *targets, "-j", jobs], check=True)
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        for name in targets:
            built = list((build_dir / "python" / "tensormem").glob(name + ".*.so"))
            if len(built) != 1:
                raise RuntimeError(f"expected one {name} module in {build_dir}, found {built}")
            shutil.copyfile(built[0], target.parent / built[0].name)


setup(
    version=project_version(),
    ext_modules=[Extension("tensormem._tensormem", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    options={"build": {"build_base": "build-pip"}},
)
