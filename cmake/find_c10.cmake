# The c10 headers and library of the PyTorch that ${Python3_EXECUTABLE} imports (else of a
# c10 on the system paths): sets TENSORMEM_C10_INCLUDE, TENSORMEM_C10_LIBRARY, and torch_abi
# (its _GLIBCXX_USE_CXX11_ABI, empty when no PyTorch answered) and torch_version.
execute_process(
  COMMAND ${Python3_EXECUTABLE} -c
          "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__)"
  OUTPUT_VARIABLE torch_probe OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE torch_probe_failed)
set(torch_hints "")
set(torch_abi "")
set(torch_version "")
if(NOT torch_probe_failed)
  string(REPLACE "\n" ";" torch_probe "${torch_probe}")
  list(GET torch_probe 0 torch_dir)
  list(GET torch_probe 1 torch_abi)
  list(GET torch_probe 2 torch_version)
  set(torch_hints ${torch_dir})
endif()
find_path(TENSORMEM_C10_INCLUDE c10/core/CPUAllocator.h HINTS ${torch_hints} PATH_SUFFIXES include)
find_library(TENSORMEM_C10_LIBRARY c10 HINTS ${torch_hints} PATH_SUFFIXES lib)
