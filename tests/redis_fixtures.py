"""Real redis-server processes for the tier-2 tests, in a temporary folder, always stopped.

Import the fixtures into a test module (``from redis_fixtures import ...``).  Every server runs
in the foreground of a child process (no daemonize, no persistence) on a unix socket or a
loopback port; teardown kills it, pass or fail.  Without redis-server (or redis-py) the tests
that need one skip, saying how to get it (``scripts/test`` installs it).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import List, Optional

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
try:
    import redis  # noqa: F401
    HAVE_REDIS_PY = True
except ImportError:  # pragma: no cover
    HAVE_REDIS_PY = False

START_TIMEOUT = 10.0


def need_redis(cli: bool = False) -> None:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (scripts/test installs it: "
                    "apt-get install redis-server)")
    if cli and REDIS_CLI is None:
        pytest.skip("redis-cli is not installed (apt-get install redis-tools)")
    if not HAVE_REDIS_PY:
        pytest.skip("redis-py is not installed: pip install 'ucmcache[tier2]'")


def _port_free(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_port(bus: bool = False) -> int:
    """A loopback port free now (with bus: port + 10000 free too, for a cluster node)."""
    for _ in range(200):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        if not bus or (port + 10000 < 65536 and _port_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port")


class RedisProc:
    """One redis-server: on a unix socket (port=None) or a loopback port, optionally a cluster
    node.  start/kill/restart/pause/resume; kill() is idempotent."""

    def __init__(self, workdir: str, name: str, *, port: Optional[int] = None,
                 cluster: bool = False):
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.port = port
        self.cluster = cluster
        self.sock = None if port is not None else os.path.join(self.dir, "redis.sock")
        self.proc: Optional[subprocess.Popen] = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"unix://{self.sock}" if self.sock else f"redis://127.0.0.1:{self.port}/0"

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, **kw):
        import redis
        if self.sock:
            return redis.Redis(unix_socket_path=self.sock, **kw)
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def start(self) -> "RedisProc":
        cmd = [REDIS_SERVER, "--save", "", "--appendonly", "no", "--dir", self.dir,
               "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning",
               "--logfile", os.path.join(self.dir, "redis.log")]
        if self.sock:
            cmd += ["--port", "0", "--unixsocket", self.sock, "--unixsocketperm", "700"]
        else:
            cmd += ["--port", str(self.port), "--bind", "127.0.0.1"]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file",
                    os.path.join(self.dir, "nodes.conf"), "--cluster-node-timeout", "5000"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.paused = False
        # Bounded polling, only for an external server to come up.
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                log = self._log_tail()
                self.proc = None
                raise RuntimeError(f"redis-server exited at start: {log}")
            try:
                c = self.client(socket_timeout=1.0, socket_connect_timeout=1.0)
                try:
                    if c.ping():
                        return self
                finally:
                    c.close()
            except Exception:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer within {START_TIMEOUT} s")
            time.sleep(0.01)

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.dir, "redis.log")) as f:
                return f.read()[-500:]
        except OSError:
            return ""

    def kill(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        if p.poll() is None:
            p.kill()  # SIGKILL works on a stopped process too
        p.wait(10)
        self.paused = False

    def restart(self) -> "RedisProc":
        self.kill()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections (the kernel does) and answers nothing."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.proc is not None and self.paused:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.paused = False


def _start_with_port(workdir: str, name: str, cluster: bool) -> RedisProc:
    last: Optional[Exception] = None
    for _ in range(5):  # another process may take the port between our probe and the bind
        r = RedisProc(workdir, name, port=free_port(bus=cluster), cluster=cluster)
        try:
            return r.start()
        except RuntimeError as e:
            last = e
    raise RuntimeError(f"could not start redis-server: {last}")


@pytest.fixture
def redis_workdir():
    d = tempfile.mkdtemp(prefix="ucmcache-redis-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def redis_unix(redis_workdir):
    """A redis-server on a unix socket in a temporary folder."""
    need_redis()
    r = RedisProc(redis_workdir, "unix").start()
    try:
        yield r
    finally:
        r.kill()


@pytest.fixture
def redis_tcp(redis_workdir):
    """A redis-server on a free loopback port."""
    need_redis()
    r = _start_with_port(redis_workdir, "tcp", cluster=False)
    try:
        yield r
    finally:
        r.kill()


class RedisCluster3:
    """Three masters on loopback, all 16384 slots covered, no replicas."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.nodes: List[RedisProc] = []

    @property
    def startup(self) -> List[str]:
        return [n.addr for n in self.nodes]

    def start(self) -> "RedisCluster3":
        for i in range(3):
            self.nodes.append(_start_with_port(self.workdir, f"node{i}", cluster=True))
        r = subprocess.run([REDIS_CLI, "--cluster", "create", *self.startup,
                            "--cluster-replicas", "0", "--cluster-yes"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: "
                               f"{r.stdout.decode(errors='replace')[-800:]}")
        # Bounded polling, only for the external cluster to agree on its state.
        deadline = time.monotonic() + 30
        while True:
            ok = 0
            for n in self.nodes:
                c = n.client(socket_timeout=1.0)
                try:
                    info = c.execute_command("CLUSTER", "INFO")
                    if isinstance(info, bytes):
                        info = info.decode()
                    if "cluster_state:ok" in str(info) and "cluster_known_nodes:3" in str(info):
                        ok += 1
                except Exception:
                    pass
                finally:
                    c.close()
            if ok == len(self.nodes):
                return self
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok within 30 s")
            time.sleep(0.05)

    def node_ids(self) -> dict:
        """port -> node id."""
        out = {}
        for n in self.nodes:
            c = n.client()
            try:
                out[n.port] = c.execute_command("CLUSTER", "MYID").decode()
            finally:
                c.close()
        return out

    def owner_of(self, slot: int) -> RedisProc:
        c = self.nodes[0].client()
        try:
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        finally:
            c.close()
        raise RuntimeError(f"slot {slot} is not covered")

    def begin_migration(self, slot: int, src: RedisProc, dst: RedisProc) -> None:
        """IMPORTING on dst, MIGRATING on src, and move every key of the slot (keys created
        from now on at src are redirected with ASK)."""
        ids = self.node_ids()
        d, s = dst.client(), src.client()
        try:
            d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src.port])
            s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst.port])
            while True:
                keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
                if not keys:
                    break
                s.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys)
        finally:
            d.close()
            s.close()

    def end_migration(self, slot: int, dst: RedisProc) -> None:
        ids = self.node_ids()
        for n in [dst] + [n for n in self.nodes if n is not dst]:
            c = n.client()
            try:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst.port])
            finally:
                c.close()

    def flush(self) -> None:
        for n in self.nodes:
            c = n.client()
            try:
                c.flushall()
            finally:
                c.close()

    def kill(self) -> None:
        for n in self.nodes:
            n.kill()


@pytest.fixture(scope="module")
def redis_cluster():
    """A 3-master Redis Cluster on loopback, shared by a module's tests (flushed by each
    user as needed), killed at the module's end."""
    need_redis(cli=True)
    d = tempfile.mkdtemp(prefix="ucmcache-rcluster-")
    cl = RedisCluster3(d)
    try:
        cl.start()
        yield cl
    finally:
        cl.kill()
        shutil.rmtree(d, ignore_errors=True)
