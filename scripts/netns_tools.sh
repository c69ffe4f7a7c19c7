#!/usr/bin/env bash
# Copies this machine's iproute2 `ip` and the libraries it links into .netns-tools/ (ignored by
# git), with a wrapper that runs it on those libraries, for a machine without iproute2 (the GPU
# machines the device tool lends): carry the folder and put it first on PATH there
# (scripts/gpu_session.sh does that with NETNS_TOOLS=.netns-tools). About 1.5 MB.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ip=$(command -v ip) || { echo "no ip here: apt-get install iproute2" >&2; exit 1; }
rm -rf .netns-tools && mkdir -p .netns-tools/lib
cp "$ip" .netns-tools/ip.real
# Every library ldd names, but not the C library and the loader, which the other machine has.
ldd "$ip" | awk '$3 ~ /^\// {print $3}' | grep -vE '/(libc|ld-linux[^/]*)\.so' |
    while read -r lib; do cp -L "$lib" .netns-tools/lib/; done
cat >.netns-tools/ip <<'WRAP'
#!/bin/sh
# iproute2's ip from another machine, with its libraries (scripts/netns_tools.sh).
d=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$d/lib" exec "$d/ip.real" "$@"
WRAP
chmod +x .netns-tools/ip
.netns-tools/ip -V
ls .netns-tools/lib
