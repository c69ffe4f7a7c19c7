#!/usr/bin/env python3
"""What TCP on loopback can carry on this machine, for the TCP rows of docs/PERF.md.

A 2-rank all-reduce sends and receives the same bytes in both directions at once. This moves
BYTES (default 1 GiB) each way between two endpoints over STREAMS connections per direction
(default 1, 2, 4, 8), every connection with its own sending and receiving thread (the kernel
copies while Python waits in sendall / recv_into, so the interpreter is not the limit), and
prints GB/s per direction: the ceiling a 2-rank all-reduce's busbw over TCP is measured against.

Usage: tcp_loopback_ceiling.py [BYTES_MIB [STREAMS,...]]
"""
import socket
import sys
import threading
import time

CHUNK = 4 << 20


def pair(bufsize):
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    a = socket.create_connection(lst.getsockname())
    b, _ = lst.accept()
    lst.close()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufsize)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def send(sock, n):
    buf = memoryview(bytearray(CHUNK))
    while n > 0:
        k = min(n, CHUNK)
        sock.sendall(buf[:k])
        n -= k


def recv(sock, n):
    buf = memoryview(bytearray(CHUNK))
    while n > 0:
        k = sock.recv_into(buf, min(n, CHUNK))
        if k == 0:
            raise RuntimeError("connection closed early")
        n -= k


def run(total, streams):
    per = total // streams
    conns = [pair(4 << 20) for _ in range(2 * streams)]  # half each way
    threads = []
    for a, b in conns:
        threads.append(threading.Thread(target=send, args=(a, per)))
        threads.append(threading.Thread(target=recv, args=(b, per)))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for a, b in conns:
        a.close()
        b.close()
    return per * streams / dt / 1e9


def main():
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    streams = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,8").split(",")]
    print(f"# TCP on loopback, {mib} MiB each way at once, GB/s per direction")
    for s in streams:
        print(f"streams {s}: {run(mib << 20, s):.2f} GB/s")


if __name__ == "__main__":
    main()
