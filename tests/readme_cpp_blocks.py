"""Writes README.md's C++ blocks as one program, each block the body of a function of its own.

A block's #include lines go to the top of the file and the rest runs as written, after a few
lines that stand for what the block takes as the reader's own (a pointer to swap, a progress
display, the buffers of the block before it). /nvme/ becomes the folder the program is given.
What a block's comments say it returns is asserted after it (CLAIMS). The program runs every
block in that folder and fails on the first exception or failed assert (NDEBUG is undefined),
so a README block that no longer compiles or runs fails the build or the test.

usage: readme_cpp_blocks.py README.md OUT.cpp
"""
import re
import sys

# What a block takes as the reader's own, by a line only that block holds.
READERS_OWN = {
    "auto buffers = tensormem::trace::read_trace": """
using namespace tensormem::core;
write_model_csv();
""",
    "plan_result p = plan(buffers, o);": """
using namespace tensormem::core;
std::vector<buffer> buffers = {{"a", 0, 2, 1000}, {"b", 1, 3, 2000}, {"c", 2, 4, 3000}};
auto show = [](double, std::uint64_t, std::uint64_t) {};
bool stop_requested = false;
""",
    "std::vector<swap::tensor_ref> tensors = {{ptr, bytes}};": """
std::vector<std::byte> storage(1 << 20, std::byte{7});
void* ptr = storage.data();
std::size_t bytes = storage.size();
""",
}

# What a block's comments say it gives, checked after it runs.
CLAIMS = {
    "best_fit_allocator exact;": """
assert(a && a->offset == 0 && a->bytes == 1024);
assert(b && b->offset == 1024);
assert(c && c->offset == 0);
assert(arena_bytes == 4096);
""",
    "plan_result p = plan(buffers, o);": """
assert(p.arena_bytes == p.lower_bound && q.offsets.size() > 0 && !r.stopped);
""",
}

HEADER = """// Generated from README.md by tests/readme_cpp_blocks.py; do not edit.
#undef NDEBUG
#include <cassert>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>
"""

MAIN = """
namespace {{
std::string readme_dir;
void write_model_csv() {{
  std::ofstream out("model.csv");
  out << "id,lower,upper,size\\n0,0,2,1000\\n1,1,3,2000\\n2,2,4,3000\\n";
  if (!out.flush()) throw std::runtime_error("cannot write model.csv");
}}
}}  // namespace
{functions}
int main(int argc, char** argv) {{
  if (argc != 2) {{
    std::cerr << "usage: readme_cpp_blocks FOLDER\\n";
    return 2;
  }}
  readme_dir = argv[1];
  std::filesystem::create_directories(readme_dir);  // the blocks' files (model.csv, swap files) go there
  std::filesystem::current_path(readme_dir);
  const std::vector<std::pair<const char*, void (*)()>> blocks = {{{table}}};
  for (const auto& [name, run] : blocks) {{
    try {{
      run();
    }} catch (const std::exception& e) {{
      std::cerr << "README block " << name << ": " << e.what() << "\\n";
      return 1;
    }}
    std::cout << "README block " << name << ": ran\\n";
  }}
  std::cout << blocks.size() << " blocks ran\\n";
  return 0;
}}
"""


def main():
    readme, out = sys.argv[1], sys.argv[2]
    blocks = re.findall(r"^```cpp\n(.*?)^```", open(readme).read(), re.S | re.M)
    if len(blocks) < 6:
        sys.exit(f"{readme}: {len(blocks)} C++ blocks, fewer than the six it had")
    includes, functions, table = [], [], []
    for number, block in enumerate(blocks, 1):
        body = []
        for line in block.splitlines():
            (includes if line.startswith("#include") else body).append(line)
        own = [text for key, text in READERS_OWN.items() if key in block]
        code = "\n".join(body).replace('"/nvme/', 'readme_dir + "/')
        claims = [text for key, text in CLAIMS.items() if key in block]
        functions.append(f"void readme_block_{number}() {{\n{''.join(own)}{code}\n{''.join(claims)}}}\n")
        table.append(f'{{"{number}", readme_block_{number}}}')
    for keys in (READERS_OWN, CLAIMS):
        if not all(any(key in b for b in blocks) for key in keys):
            sys.exit(f"{readme}: a block this script knows by a line has changed; update its tables")
    text = HEADER + "\n".join(dict.fromkeys(includes)) + "\n" + MAIN.format(
        functions="\n".join(functions), table=", ".join(table))
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
