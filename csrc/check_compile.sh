#!/usr/bin/env bash
# Compile csrc/checksum.cu to cubin and PTX for Hopper (sm_90) and Blackwell (sm_100) with nvcc,
# so a syntax or architecture problem shows up on a build machine rather than at the first
# NVRTC compile inside a GPU worker.  Exits non-zero on the first failure.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src="$here/checksum.cu"
nvcc_bin=${NVCC:-nvcc}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for arch in sm_90 sm_100; do
    "$nvcc_bin" -std=c++17 -O3 -arch="$arch" --cubin -Xptxas -Werror -o "$out/checksum_$arch.cubin" "$src"
    "$nvcc_bin" -std=c++17 -O3 -arch="$arch" --ptx -o "$out/checksum_$arch.ptx" "$src"
    for kernel in gdskv_checksum_partial gdskv_checksum_finish; do
        grep -q "\.entry $kernel" "$out/checksum_$arch.ptx" || { echo "$arch: kernel $kernel missing" >&2; exit 1; }
    done
    echo "checksum.cu: $arch ok"
done
