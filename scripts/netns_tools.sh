#!/usr/bin/env bash
# Copies this machine's iproute2 `ip` and `tc` and the libraries they link into .netns-tools/ (ignored by
# git), with wrappers that run them on those libraries, for a machine without iproute2 (the GPU
# machines the device tool lends): carry the folder and put it first on PATH there
# (scripts/gpu_session.sh does that with NETNS_TOOLS=.netns-tools). About 2 MB.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rm -rf .netns-tools && mkdir -p .netns-tools/lib
# ip, and tc for scripts/netns.sh --rate (both from iproute2).
for tool in ip tc; do
    path=$(command -v "$tool") || { echo "no $tool here: apt-get install iproute2" >&2; exit 1; }
    cp "$path" ".netns-tools/$tool.real"
    # Every library ldd names but glibc's own (the C library, libm and the like, and the
    # loader), which the other machine has in a version that matches its loader.
    ldd "$path" | awk '$3 ~ /^\// {print $3}' |
        grep -vE '/(libc|libm|libpthread|libdl|librt|libresolv|ld-linux[^/]*)\.so' |
        while read -r lib; do cp -L "$lib" .netns-tools/lib/; done
    # Run through that machine's loader with the copied libraries: no LD_LIBRARY_PATH, so the
    # programs `ip netns exec` starts (the ranks) keep their own environment.
    cat >".netns-tools/$tool" <<WRAP
#!/bin/sh
# iproute2's $tool from another machine, with its libraries (scripts/netns_tools.sh).
d=\$(dirname "\$(readlink -f "\$0")")
exec /lib64/ld-linux-x86-64.so.2 --library-path "\$d/lib" "\$d/$tool.real" "\$@"
WRAP
    chmod +x ".netns-tools/$tool"
done
.netns-tools/ip -V
ls .netns-tools/lib
