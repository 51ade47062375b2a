#!/bin/sh
# Installs the build into a scratch prefix and uses it from outside, as a user would: the
# example consumer project through find_package(tensormem), the same program through
# pkg-config, and `import tensormem` from the folder the install chose.
# Usage: install_test.sh BUILD_DIR SOURCE_DIR PYTHON_DIR_IN_PREFIX
set -eu
build=$1 src=$2 pyrel=${3:-}
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" > "$prefix/install.log"
test -f "$prefix/lib/cmake/tensormem/tensormemConfig.cmake" || { echo "FAIL: no tensormemConfig.cmake"; exit 1; }
cmake -S "$src/examples/cmake-consumer" -B "$prefix/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix" > "$prefix/consumer.log"
cmake --build "$prefix/consumer" >> "$prefix/consumer.log" || { cat "$prefix/consumer.log"; exit 1; }
"$prefix/consumer/consumer"
pc=$(dirname "$(find "$prefix" -name tensormem.pc)")
flags=$(PKG_CONFIG_PATH="$pc" pkg-config --cflags --libs tensormem)
echo "pkg-config: $flags"
c++ -O1 -o "$prefix/pc-consumer" "$src/examples/cmake-consumer/main.cpp" $flags
"$prefix/pc-consumer"
if [ -n "$pyrel" ]; then
  where=$(cd / && PYTHONPATH="$prefix/$pyrel" /usr/bin/python3 -c "import tensormem; print(tensormem.__file__)")
  case "$where" in "$prefix"/*) echo "python: $where" ;; *) echo "FAIL: imported $where"; exit 1 ;; esac
fi
echo PASS
