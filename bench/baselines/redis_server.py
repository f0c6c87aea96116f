"""A private redis-server for the benchmark: unix socket in a temporary directory, no TCP port,
no persistence; started and stopped by the bench (never a system service)."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Optional


class RedisServer:
    def __init__(self, workdir: str):
        self.dir = os.path.join(workdir, "redis")
        self.sock = os.path.join(self.dir, "redis.sock")
        self.proc: Optional[subprocess.Popen] = None
        self.version = ""

    @staticmethod
    def binary() -> Optional[str]:
        return shutil.which("redis-server")

    def start(self, timeout: float = 10.0) -> None:
        exe = self.binary()
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        import redis  # the client must exist too

        os.makedirs(self.dir, exist_ok=True)
        cmd = [exe, "--port", "0", "--unixsocket", self.sock, "--unixsocketperm", "700",
               "--save", "", "--appendonly", "no", "--dir", self.dir, "--daemonize", "no",
               "--protected-mode", "no", "--loglevel", "warning", "--databases", "1"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace").strip() if self.proc.stderr else ""
                self.proc = None
                raise RuntimeError(f"redis-server exited at start: {err[-300:]}")
            if os.path.exists(self.sock):
                try:
                    c = redis.Redis(unix_socket_path=self.sock)
                    c.ping()
                    self.version = c.info("server").get("redis_version", "")
                    c.close()
                    return
                except Exception:
                    pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on {self.sock} within {timeout} s")
            time.sleep(0.02)

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        p.terminate()
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
        if p.stderr:
            p.stderr.close()
