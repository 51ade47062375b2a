#!/usr/bin/env bash
# Installs the Debian packages tensormem needs, only those that are missing.
# Idempotent: when everything is present it changes nothing and needs no network.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libgtest-dev libgmock-dev libbenchmark-dev
  libfmt-dev libcli11-dev nlohmann-json3-dev liburing-dev
  python3-dev pybind11-dev python3-pybind11 libdlpack-dev
  python3-numpy python3-pytest python3-torch python3-torchvision libtorch-dev python3-pip python3-setuptools python3-wheel python3-venv
  libopenblas0-pthread  # python3-torch's BLAS: without it the reference one, 20-30 x slower
  fio chromium
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update
$sudo apt-get install -y --no-install-recommends "${missing[@]}"
