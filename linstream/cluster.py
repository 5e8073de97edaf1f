"""`linstream serve --replicas N`: N replica processes and HAProxy in front of them, on one machine.

One process uses about one core (its engine thread, plus its event loop); more processes use
more, and HAProxy sends each session's requests to one of them (`haproxy_config`). The replicas
share a Redis store, so a session, its lease and its prefix states are found by any of them
(docs/scaling.md). Here: a redis-server is started when no store is given, the replicas listen
on the ports after --port (loopback only), HAProxy on --port. A replica that exits is started
again, unless it could not start at all (uvicorn's exit 3: its port taken), which stops the
cluster; SIGTERM or SIGINT drains the replicas (each answers /health with 503 first, then finishes
its streams), then stops HAProxy and the Redis started here. On Linux every child is also told to
end (SIGTERM) by the kernel when this process dies, SIGKILL included, so nothing is left holding
the ports; and a second `serve --replicas` on ports in use is refused in one line before it starts
anything.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .processes import wait_until_up

# The routing key (docs/scaling.md#routing), in HAProxy's words. The rules run in order; the
# first that sets txn.affinity wins. Double quotes inside single ones: HAProxy's two levels of quoting.
ROUTING = """\
    # a session's routing key: the 12 characters after "sess_" in its id
    http-request set-var(txn.affinity) path,'regsub("^/v1/sessions/sess_([A-Za-z0-9_-]{12}).*$","\\1")' if { path_reg ^/v1/sessions/sess_[A-Za-z0-9_-]{12} }
    # a create names the key its id will start with: the client's, or 12 random characters
    http-request set-header X-Session-Affinity %[uuid(4),'regsub("^.*-","")'] if { method POST } { path /v1/sessions /v1/sessions/restore } !{ req.hdr(x-session-affinity) -m reg ^[A-Za-z0-9_-]{12}$ }
    # any other request: its X-Session-Affinity (a session id counts by its key), else round robin
    http-request set-var(txn.affinity) req.hdr(x-session-affinity),'regsub("^sess_([A-Za-z0-9_-]{12}).*$","\\1")' if !{ var(txn.affinity) -m found } { req.hdr(x-session-affinity) -m found }
"""

HEAD = """\
# HAProxy in front of linstream replicas: every request of a session goes to the replica that
# holds it. Made by linstream.cluster.haproxy_config; docs/scaling.md explains each choice.
#
# balance hash + hash-type consistent: the key (below) picks a replica, and a replica's removal
# or return moves only the keys it owns. /health answers 503 from the moment a replica is told to
# stop (SIGTERM), so it is marked down within a second (inter 500ms, fall 2), before it stops
# listening; its running streams are left to finish (no on-marked-down shutdown-sessions: a
# draining replica is marked down too). A killed replica's connections are reset by its kernel,
# so its streams end at once, and a request that cannot connect goes to another replica
# (option redispatch) before the health check has noticed.
global
    # maxconn: from the file-descriptor limit (ulimit -n), as HAProxy sets it when none is given

defaults
    mode http
    timeout connect 2s
    timeout http-request 10s
    timeout http-keep-alive 60s
    timeout queue 10s
    # a stream sends an SSE ping every 5 s (sse_ping_s), but a generation answered as one JSON body
    # sends nothing until it ends: room for a long one; a lost machine's requests end after this
    timeout client 300s
    timeout server 300s
    # one connection to a replica per request: a request never goes out on a kept-alive connection
    # to a replica that has died meanwhile (nothing retries a request that may have been served),
    # so a dead replica is always a refused connection, tried again on another one (redispatch)
    option http-server-close
    retries 2
    option redispatch 1

frontend linstream
    bind {bind}
    default_backend replicas

backend replicas
    balance hash var(txn.affinity)
    hash-type consistent
{routing}
    option httpchk GET /health
    http-check expect status 200
    default-server check inter 500ms fall 2 rise 2 maxconn 1024{resolve}
"""


def haproxy_config(servers: list[tuple[str, str]], bind: str = ":8080", dns: bool = False) -> str:
    """The HAProxy configuration for replicas `servers` = [(name, "host:port")]. dns: the hosts
    are names that DNS resolves while HAProxy runs (containers, pods: a replica that comes back
    at another address is found again; one that does not resolve yet counts as down)."""
    out = HEAD.format(bind=bind, routing=ROUTING.rstrip("\n"), resolve=" resolvers dns init-addr last,libc,none" if dns else "")
    out += "".join(f"    server {n} {addr}\n" for n, addr in servers)
    if dns:
        out += "\nresolvers dns\n    parse-resolv-conf\n    hold valid 5s\n"
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m linstream.cluster NAME=HOST:PORT ... [--bind ADDR] [--dns]`: print the HAProxy
    configuration for those replicas (deploy/ holds the ones for compose and Kubernetes)."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m linstream.cluster", description=main.__doc__)
    ap.add_argument("servers", nargs="+", metavar="NAME=HOST:PORT")
    ap.add_argument("--bind", default=":8080")
    ap.add_argument("--dns", action="store_true", help="resolve the hosts at run time (containers, pods)")
    a = ap.parse_args(argv)
    print(haproxy_config([tuple(s.split("=", 1)) for s in a.servers], a.bind, a.dns), end="")


# ---- running a cluster on one machine ---------------------------------------------------------

RESTART_S = 5.0  # a replica that exits is started again, at most once per this many seconds
STARTUP_FAILED = 3  # uvicorn's exit code when a server cannot start (its port taken): not started again
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _ends_with_us():
    """A Popen preexec_fn that makes the child end (SIGTERM) when this process dies, however it
    dies (Linux; None elsewhere). Looked up before the fork: the child only makes the call."""
    if _prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between the fork and the prctl
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


def _port_taken(host: str, port: int) -> bool:
    """Whether a server could not listen on host:port now (bound as uvicorn, HAProxy and Redis bind)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _which(cmd: str) -> str | None:
    return shutil.which(cmd) or next((p for p in (f"/usr/sbin/{cmd}", f"/usr/bin/{cmd}") if os.access(p, os.X_OK)), None)


def redis_maxmemory() -> int:
    """The started Redis's bound: a quarter of the machine's memory (the replicas need the rest)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 4 << 30


def start_redis(port: int, workdir: str, maxmemory: int | None = None) -> subprocess.Popen:
    """A redis-server on loopback `port` that keeps nothing on disk (the cluster's sessions last as
    long as it does), bounded by `maxmemory` (default `redis_maxmemory()`) and evicting nothing at
    it: a write it refuses is a 507 `store_full` (sessions/store.py), never a session dropped."""
    exe = _which("redis-server")
    if exe is None:
        raise SystemExit("--replicas needs a Redis: pass --store redis://HOST:PORT/DB or install redis-server")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir, "--maxmemory", str(maxmemory or redis_maxmemory()),
                             "--maxmemory-policy", "noeviction"], stdout=subprocess.DEVNULL, preexec_fn=_ends_with_us())
    import redis
    r = redis.Redis(port=port)
    for _ in range(100):
        try:
            r.ping()
            return proc
        except redis.ConnectionError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"redis-server did not start on port {port}")


class Cluster:
    """The processes of `serve --replicas N`: replicas on ports port+1.., HAProxy on port."""

    def __init__(self, n: int, given: dict, log_level: str, allocator: str):
        self.n, self.log_level, self.allocator = n, log_level, allocator
        self.host, self.port = given.pop("host", "127.0.0.1"), given.pop("port", 8000)
        given.pop("replica_name", None)  # each replica is named by its own port (hostname:port)
        store = given.pop("store", None)
        self.check_ports(store is None)
        self.dir = tempfile.mkdtemp(prefix="linstream-cluster-")
        self.redis = None
        if store is None:
            self.redis = start_redis(self.port + n + 1, self.dir)
            store = f"redis://127.0.0.1:{self.port + n + 1}/0"
        if not store.startswith(("redis://", "rediss://", "unix://")):
            raise SystemExit(f"--replicas needs a Redis store, not {store!r}: the replicas share sessions through it")
        self.store = store
        if "threads" not in given:  # the machine's cores shared out (each replica also keeps one for its event loop)
            given["threads"] = max(1, (os.cpu_count() or 2) // n - 1)
        given.setdefault("drain_notice_s", 1.5)  # three of HAProxy's checks: it marks the replica down after two
        self.env = {**os.environ, **{f"LINSTREAM_{k.upper()}": json.dumps(v) if isinstance(v, list) else str(v)
                                      for k, v in given.items()}}
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.started = [0.0] * n  # when each replica was last started (a crashing one waits RESTART_S)
        self.haproxy = None

    def replica_port(self, i: int) -> int:
        return self.port + 1 + i

    def check_ports(self, redis: bool) -> None:
        """SystemExit in one line if a port the cluster needs is taken (another cluster on it),
        before any process is started."""
        ports = [(self.host, self.port)] + [("127.0.0.1", self.replica_port(i)) for i in range(self.n)]
        ports += [("127.0.0.1", self.port + self.n + 1)] if redis else []
        taken = [port for host, port in ports if _port_taken(host, port)]
        if taken:
            raise SystemExit(f"linstream: port {taken[0]} is in use (another `linstream serve` on it?); --replicas "
                             f"{self.n} --port {self.port} needs ports {self.port}-{ports[-1][1]} free")

    def start_replica(self, i: int) -> subprocess.Popen:
        args = [sys.executable, "-m", "linstream", "serve", "--host", "127.0.0.1", "--port", str(self.replica_port(i)),
                "--log-level", self.log_level, "--allocator", self.allocator]
        self.procs[i] = subprocess.Popen(args, env={**self.env, "LINSTREAM_STORE": self.store},  # no password in ps
                                         preexec_fn=_ends_with_us())
        self.started[i] = time.monotonic()
        return self.procs[i]

    def start(self) -> None:
        exe = _which("haproxy")
        if exe is None:
            raise SystemExit("--replicas needs HAProxy (Debian: apt-get install haproxy)")
        for i in range(self.n):
            self.start_replica(i)
        for i, p in enumerate(self.procs):
            if not wait_until_up(p, f"http://127.0.0.1:{self.replica_port(i)}/health", 300):
                raise SystemExit(f"replica {i} on port {self.replica_port(i)} did not come up")
        cfg = Path(self.dir) / "haproxy.cfg"
        bind = f"{'[' + self.host + ']' if ':' in self.host else self.host}:{self.port}"
        cfg.write_text(haproxy_config([(f"r{i}", f"127.0.0.1:{self.replica_port(i)}") for i in range(self.n)], bind))
        self.haproxy = subprocess.Popen([exe, "-f", str(cfg), "-db"], preexec_fn=_ends_with_us())
        local = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else bind.rsplit(":", 1)[0]
        if not wait_until_up(self.haproxy, f"http://{local}:{self.port}/health", 10):
            raise SystemExit(f"HAProxy did not come up on port {self.port} (config: {cfg})")
        store = re.sub(r"//[^/@]*@", "//***@", self.store)  # no password in the log
        print(f"linstream: {self.n} replicas on ports {self.replica_port(0)}-{self.replica_port(self.n - 1)}, "
              f"HAProxy on http://{bind}, store {store}", flush=True)

    def watch(self, stopping) -> int:
        """Start again any replica that exits, until `stopping()` (-> 0); -> 1 once HAProxy exits
        or a replica cannot start at all (STARTUP_FAILED: started again, it would fail forever)."""
        while not stopping():
            for i, p in enumerate(self.procs):
                if p is not None and p.poll() == STARTUP_FAILED:
                    print(f"linstream: replica {i} could not start on port {self.replica_port(i)} (exit {STARTUP_FAILED}: "
                          "its port taken?); stopping the cluster", file=sys.stderr, flush=True)
                    return 1
                if p is not None and p.poll() is not None and not stopping() \
                        and time.monotonic() - self.started[i] > RESTART_S:
                    print(f"linstream: replica {i} exited ({p.returncode}); starting it again", file=sys.stderr, flush=True)
                    self.start_replica(i)
            if self.haproxy is not None and self.haproxy.poll() is not None:
                print("linstream: HAProxy exited; stopping the replicas", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
        return 0

    def stop(self, grace: float = 60) -> None:
        """Drain the replicas (SIGTERM: each goes out of the proxy's rotation, then finishes its
        streams), then stop HAProxy and the Redis started here."""
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.terminate()
        deadline = time.time() + grace
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in (self.haproxy, self.redis):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def serve_cluster(n: int, given: dict, log_level: str, allocator: str) -> int:
    """Run `serve --replicas n` until SIGTERM or SIGINT; `given`: the serve options set."""
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    cluster = Cluster(n, dict(given), log_level, allocator)
    try:
        cluster.start()
        return cluster.watch(lambda: bool(stop))
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
