#!/usr/bin/env python3
"""Redis CPU of one uncontended acquire, by the shape of the request (bench/README.md, #14).

Starts its own redis-server on a free loopback port in a temp dir, sends each shape N times
(pipelined 64 at a time over one connection, a fresh lock key each time, the keyspace flushed
before each run) and prints the server's CPU per acquire (INFO cpu, user + sys) over ROUNDS
interleaved rounds. Only the server's CPU is read, so the client's own speed does not count.

    python3 bench/tools/acquire_shapes.py [N] [ROUNDS]
"""
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

N = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
BATCH = 64
TOKEN = "a" * 32
PX = 90_000

# The uncontended path of dlock's acquire script (backend/redis/scripts.rs): INCR of the
# fencing counter, raised to the client's floor if below, then SET NX PX.
ACQUIRE = """local token, fence_key = ARGV[1], ARGV[3]
local fence
local fence_floor = tonumber(ARGV[4])
fence = redis.call('INCR', fence_key)
if fence == 1 then
  local t = redis.call('TIME')
  fence = tonumber(t[1]) * 1000000 + tonumber(t[2])
  redis.call('SET', fence_key, string.format('%.0f', fence))
end
if fence_floor and fence < fence_floor then
  redis.call('SET', fence_key, string.format('%.0f', fence_floor))
  fence = fence_floor
end
if redis.call('SET', KEYS[1], token, 'NX', 'PX', ARGV[2]) then return fence end
return -1
"""


def enc(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class Conn:
    def __init__(self, port):
        self.s = socket.create_connection(("127.0.0.1", port))
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.f = self.s.makefile("rb")

    def read(self):
        line = self.f.readline()
        kind = line[:1]
        if kind == b"-":
            raise RuntimeError(line.decode().strip())
        if kind in b"+:":
            return line[1:-2]
        if kind == b"$":
            n = int(line[1:])
            return None if n < 0 else self.f.read(n + 2)[:-2]
        if kind == b"*":
            n = int(line[1:])
            return [self.read() for _ in range(max(n, 0))]
        raise RuntimeError(f"unexpected reply {line!r}")

    def cmd(self, *args):
        self.s.sendall(enc(*args))
        return self.read()

    def server_cpu(self):
        info = self.cmd("INFO", "cpu").decode()
        d = dict(l.split(":", 1) for l in info.split("\r\n") if ":" in l)
        return float(d["used_cpu_sys"]) + float(d["used_cpu_user"])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    tmp = tempfile.mkdtemp(prefix="acquire-shapes-")
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", tmp],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                c = Conn(port)
                c.cmd("PING")
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise SystemExit("redis-server did not start")
        sha = c.cmd("SCRIPT", "LOAD", ACQUIRE).decode()
        floor = int(time.time() * 1e6)
        shapes = {
            "EVALSHA acquire, 4 args (a try now)":
                lambda k: [enc("EVALSHA", sha, 1, k, TOKEN, PX, "f", floor)],
            "EVALSHA acquire, 7 args (a try before)":
                lambda k: [enc("EVALSHA", sha, 1, k, TOKEN, PX, "f", floor, 0, 30000, 30000)],
            "MULTI INCR, SET NX PX, EXEC (no floor)":
                lambda k: [enc("MULTI"), enc("INCR", "f"), enc("SET", k, TOKEN, "NX", "PX", PX),
                           enc("EXEC")],
            "MULTI ZADD GT floor, ZINCRBY, SET NX PX, EXEC":
                lambda k: [enc("MULTI"), enc("ZADD", "fz", "GT", floor, "c"),
                           enc("ZINCRBY", "fz", 1, "c"), enc("SET", k, TOKEN, "NX", "PX", PX),
                           enc("EXEC")],
            "SET NX PX (the raw floor's acquire)":
                lambda k: [enc("SET", k, TOKEN, "NX", "PX", PX)],
        }
        results = {name: [] for name in shapes}
        for r in range(ROUNDS):
            for name, shape in shapes.items():
                c.cmd("FLUSHALL")
                c.cmd("SET", "f", 100)
                c.cmd("ZADD", "fz", 100, "c")
                before = c.server_cpu()
                for start in range(0, N, BATCH):
                    reqs = [q for i in range(start, start + BATCH) for q in shape(f"{{l:{r}:{i}}}")]
                    c.s.sendall(b"".join(reqs))
                    for _ in reqs:
                        c.read()
                results[name].append((c.server_cpu() - before) / N * 1e6)
        print(f"redis CPU per acquire (µs), {N} acquires x {ROUNDS} rounds: median (min-max)")
        for name, v in results.items():
            print(f"  {name:48s} {statistics.median(v):5.2f} ({min(v):.2f}-{max(v):.2f})")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
