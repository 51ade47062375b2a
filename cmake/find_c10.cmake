# The c10 headers and library of the PyTorch that ${Python3_EXECUTABLE} imports, and nothing
# else: a hook built against another c10 (a system libtorch-dev of another release, say) would
# run inside that PyTorch with the wrong ABI. Sets TENSORMEM_C10_INCLUDE and
# TENSORMEM_C10_LIBRARY (NOTFOUND without PyTorch or without its headers), torch_abi (its
# _GLIBCXX_USE_CXX11_ABI) and torch_version (torch.__version__).
execute_process(
  COMMAND ${Python3_EXECUTABLE} -c
          "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__)"
  OUTPUT_VARIABLE torch_probe OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE torch_probe_failed)
set(torch_dir "")
set(torch_abi "")
set(torch_version "")
string(REPLACE "\n" ";" torch_probe "${torch_probe}")
list(LENGTH torch_probe torch_probe_lines)
if(NOT torch_probe_failed AND torch_probe_lines GREATER_EQUAL 3)
  # The last three lines: anything the import itself printed comes before them.
  list(GET torch_probe -3 torch_dir)
  list(GET torch_probe -2 torch_abi)
  list(GET torch_probe -1 torch_version)
endif()
if(torch_dir)
  find_path(TENSORMEM_C10_INCLUDE c10/core/CPUAllocator.h PATHS ${torch_dir}/include NO_DEFAULT_PATH)
  find_library(TENSORMEM_C10_LIBRARY c10 PATHS ${torch_dir}/lib NO_DEFAULT_PATH)
endif()
