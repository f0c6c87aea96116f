"""RedisTier: tier 2 on Redis (standalone or Redis Cluster), its connections, round trips,
background writer and pub/sub listener (DESIGN 4.10).

Every round trip on a get's path is bounded by ``timeout`` (socket and connect timeouts;
connection errors are retried once at once, timeouts not) and goes through the circuit breaker
(ucmcache.tier2.breaker).  Write-throughs and lease drops are queued to one writer thread per
process (pipelined, never on a waiter's path), which announces written keys on a pub/sub
channel; one listener thread (ucmcache.tier2.announce) wakes the local waiters of an announced
key.  Threads and
connections are per process: after a fork the child starts its own on demand.  Counters of the
writer (process-local) are in ``RedisTier.counters``.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ...core import hooks as _hooks
from ...core.keys import split_key
from ...core.tier import Tier
from ...core.timeouts import check_bound, check_timeout
from ..write_through import WriteThroughQueue
from .announce import Listener
from ..breaker import Breaker, Bypass
from .codec import LAYOUT_VERSION, encode_into, escape_namespace
from .leases import Lease, Leases

log = logging.getLogger("ucmcache.tier2")

WRITE_BATCH = 64        # write-throughs per pipeline
WRITE_BATCH_BYTES = 8 << 20

_CAD = ("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) "
        "end return 0")

_live_tiers: "weakref.WeakSet[RedisTier]" = weakref.WeakSet()


class RedisTier(Tier):
    """A second tier on Redis, shared by every node (machine) that uses the same server or
    cluster and ``namespace``.  Give it to ``SlotCache.create``/``attach`` as ``tier2=``.

    Where: exactly one of ``url`` (``redis://host:port/db``, ``rediss://``, ``unix:///path``),
    ``unix_socket`` (a path), ``cluster_nodes`` (Redis Cluster startup nodes, ``"host:port"``
    or ``(host, port)``) or ``client`` (a redis-py client you made; its timeouts are yours).

    ``namespace`` (required) names the deployment (model, version, dtype...): caches share
    tier-2 values only within one namespace.  ``timeout`` bounds each round trip on a get's
    path (seconds); ``write_timeout`` each write-through (off the path).  ``lease_ttl`` is how
    long another node waits for this one's load before taking over: make it longer than the
    slowest load.  ``breaker_failures`` consecutive failures open the circuit for
    ``breaker_reset`` seconds.  ``value_ttl`` (seconds, optional) expires values in Redis.
    ``max_pending_bytes`` bounds write-throughs queued in this process (more are dropped and
    counted).  ``client_options`` go to the redis-py client.

    One RedisTier may serve several caches of a process.  It is picklable (the configuration
    travels, not the connections) unless built from ``client``.
    """

    def __init__(self, url: Optional[str] = None, *, unix_socket: Optional[str] = None,
                 cluster_nodes: Optional[Sequence[Any]] = None, client: Any = None,
                 namespace: str, timeout: float = 0.05, write_timeout: float = 1.0,
                 lease_ttl: float = 10.0, breaker_failures: int = 3, breaker_reset: float = 5.0,
                 value_ttl: Optional[float] = None, max_pending_bytes: int = 64 << 20,
                 client_options: Optional[Dict[str, Any]] = None,
                 clock: Optional[Callable[[], float]] = None):
        given = [name for name, v in (("url", url), ("unix_socket", unix_socket),
                                      ("cluster_nodes", cluster_nodes), ("client", client))
                 if v is not None]
        if len(given) != 1:
            raise ValueError("RedisTier needs exactly one of url, unix_socket, cluster_nodes or "
                             f"client, got {given or 'none'}")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty str, got {namespace!r}")
        for name, v in (("timeout", timeout), ("write_timeout", write_timeout),
                        ("lease_ttl", lease_ttl)):
            check_bound(v, name)  # finite: inf would make no socket bound, no lease's ms
        if isinstance(breaker_failures, bool) or not isinstance(breaker_failures, int) \
                or breaker_failures < 1:
            raise ValueError(f"breaker_failures must be an int >= 1, got {breaker_failures!r}")
        if isinstance(breaker_reset, bool) or not isinstance(breaker_reset, (int, float)) \
                or breaker_reset < 0:
            raise ValueError(f"breaker_reset must be >= 0 seconds, got {breaker_reset!r}")
        if value_ttl is not None:
            check_bound(value_ttl, "value_ttl")  # None: values kept without an expiry
        if client is None:
            try:
                import redis  # noqa: F401
            except ImportError:
                raise ImportError("RedisTier needs redis-py: pip install 'ucmcache[tier2]' "
                                  "(redis[hiredis])") from None
        nodes: Optional[List[Tuple[str, int]]] = None
        if cluster_nodes is not None:
            nodes = [_parse_node(n) for n in cluster_nodes]
            if not nodes:
                raise ValueError("cluster_nodes is empty")
        self._config = dict(url=url, unix_socket=unix_socket, cluster_nodes=nodes,
                            namespace=namespace, timeout=float(timeout),
                            write_timeout=float(write_timeout), lease_ttl=float(lease_ttl),
                            breaker_failures=breaker_failures, breaker_reset=float(breaker_reset),
                            value_ttl=value_ttl, max_pending_bytes=int(max_pending_bytes),
                            client_options=dict(client_options or {}))
        self._user_client = client
        self.namespace = namespace
        self.timeout = float(timeout)
        self.lease_ttl = float(lease_ttl)
        self._lease_ms = max(1, int(self.lease_ttl * 1000))
        self._value_ms = None if value_ttl is None else max(1, int(value_ttl * 1000))
        self._max_pending = int(max_pending_bytes)
        self._clock = clock or time.monotonic
        where = url or unix_socket or (",".join(f"{h}:{p}" for h, p in nodes) if nodes else
                                       "client")
        self.label = f"{where} ns={namespace!r}"
        self._prefix = f"ucm:v{LAYOUT_VERSION}:{escape_namespace(namespace)}:".encode()
        self.channel = self._prefix + b"ready"
        self._breaker = Breaker(breaker_failures, float(breaker_reset), self._clock, self.label)
        self.counters = {"writes_done": 0, "writes_failed": 0, "writes_dropped": 0,
                         "releases": 0, "announcements_heard": 0}
        self._reset_process_state()
        _live_tiers.add(self)

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._breaker._lock = threading.Lock()
        self._lock = threading.Lock()
        self._fg = self._user_client
        self._bg = self._user_client
        self._writes = WriteThroughQueue(self._write, max_pending_bytes=self._max_pending,
                                         thread_name="ucmcache-tier2-writer", log=log,
                                         what=f"ucmcache tier 2 {self.label}",
                                         batch_items=WRITE_BATCH, batch_bytes=WRITE_BATCH_BYTES)
        self._listener = Listener(self._bg_client, self.channel, self.counters, self.label)

    # ---------------------------------------------------------------- facts

    @property
    def state(self) -> str:
        """The circuit breaker: 'closed' (tier 2 in use), 'open' (bypassed) or 'half-open'."""
        return self._breaker.state

    def key_for(self, key: Any) -> bytes:
        """The Redis key that holds the value of a cache key (its lease: this + b':lease')."""
        block_id, offset = split_key(key)
        return self._keys(block_id, offset)[0]

    def _keys(self, block_id: bytes, offset: int) -> Tuple[bytes, bytes]:
        v = b"%s{%s:%d}" % (self._prefix, block_id.hex().encode(), offset)
        return v, v + b":lease"

    def __repr__(self) -> str:
        return f"<RedisTier {self.label} {self.state}>"

    def __reduce__(self):
        if self._user_client is not None:
            raise TypeError("a RedisTier built from a client object cannot be pickled; build it "
                            "from url, unix_socket or cluster_nodes")
        return (_rebuild, (self._config,))

    # ---------------------------------------------------------------- clients

    def _make_client(self, timeout: float):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        cfg: Dict[str, Any] = self._config
        opts: Dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=timeout)
        if cfg["cluster_nodes"]:
            from redis.cluster import ClusterNode, RedisCluster
            opts["retry"] = Retry(NoBackoff(), 1)
            opts.update(cfg["client_options"])
            opts["decode_responses"] = False
            return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cfg["cluster_nodes"]],
                                **opts)
        # A stale pooled connection (server restarted) is retried once at once; a timeout is not.
        opts["retry"] = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
        opts.update(cfg["client_options"])
        opts["decode_responses"] = False
        if cfg["unix_socket"]:
            return redis.Redis(unix_socket_path=cfg["unix_socket"], **opts)
        return redis.Redis.from_url(cfg["url"], **opts)

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            self._after_fork()

    def _client(self):
        self._check_pid()
        c = self._fg
        return c if c is not None else self._new_client("_fg", self.timeout)

    def _bg_client(self):
        self._check_pid()
        c = self._bg
        return c if c is not None else self._new_client("_bg", self._config["write_timeout"])

    def _new_client(self, attr: str, timeout: float):
        # Built outside the lock (a cluster client connects while it is built): no thread
        # waits on another's connect timeouts.  Two racing builders keep the first.
        c = self._make_client(timeout)
        with self._lock:
            have = getattr(self, attr)
            if have is None:
                setattr(self, attr, c)
                return c
        try:
            c.close()
        except Exception:
            pass
        return have

    def _run(self, fn: Callable[[Any], Any]) -> Any:
        """fn(client) under the breaker; Bypass when tier 2 is skipped or fails."""
        b = self._breaker
        if not b.allow():
            raise Bypass("circuit open")
        try:
            r = fn(self._client())
        except Exception as e:
            b.failure(e)
            log.debug("ucmcache tier 2 %s: %s: %s", self.label, type(e).__name__, e)
            raise Bypass(f"{type(e).__name__}: {e}") from e
        except BaseException:
            b.abort()
            raise
        b.success()
        return r

    # ---------------------------------------------------------------- round trips

    @staticmethod
    def _pipe(client):
        return client.pipeline(transaction=False)

    def _get_all(self, vkeys: List[bytes]) -> List[Any]:
        def go(c):
            if len(vkeys) == 1:
                return [c.get(vkeys[0])]
            p = self._pipe(c)
            for k in vkeys:
                p.get(k)
            return p.execute()
        return self._run(go)

    def _acquire(self, items: List[Tuple[bytes, bytes, bytes]]) -> List[Tuple[bool, Any]]:
        """For each (vkey, lkey, token): take the lease if free, then read the value (in this
        order, on the same node: a value written before its lease was dropped is seen)."""
        def go(c):
            p = self._pipe(c)
            for vkey, lkey, token in items:
                p.set(lkey, token, nx=True, px=self._lease_ms)
                p.get(vkey)
            r = p.execute()
            return [(bool(r[2 * i]), r[2 * i + 1]) for i in range(len(items))]
        return self._run(go)

    def _poll(self, vkey: bytes, lkey: bytes, drops: Sequence[bytes]) -> Tuple[Any, int]:
        """(value, lease pttl), dropping first the leases in drops (ours, just taken)."""
        def go(c):
            p = self._pipe(c)
            for k in drops:
                p.delete(k)
            p.get(vkey)
            p.pttl(lkey)
            r = p.execute()
            return r[-2], int(r[-1])
        return self._run(go)

    def _exists(self, vkeys: List[bytes]) -> List[bool]:
        def go(c):
            p = self._pipe(c)
            for k in vkeys:
                p.exists(k)
            return [bool(x) for x in p.execute()]
        return self._run(go)

    # ---------------------------------------------------------------- write-through (background)

    def _put(self, lease: Lease, buf: bytearray) -> bool:
        """Queue a write-through of buf (header space + payload); False when dropped."""
        if not self._breaker.would_allow():
            self.counters["writes_dropped"] += 1
            return False
        if self._enqueue(("put", lease, buf), len(buf)):
            return True
        self._release(lease.lkey, lease.token)  # dropped: at least let another node load it
        return False

    def _release(self, lkey: bytes, token: Optional[bytes]) -> None:
        """Queue dropping our lease (compare and delete: never someone else's)."""
        if token is not None and self._breaker.would_allow():
            self._enqueue(("release", Lease(b"", lkey, token), None), 0)

    def _enqueue(self, item, nbytes: int) -> bool:
        self._check_pid()
        if not self._writes.put(item, nbytes):
            self.counters["writes_dropped"] += 1
            return False
        return True

    def _write(self, batch: list) -> None:
        """The writer thread's work: a batch of puts in one pipeline, then the releases."""
        if _hooks._armed:
            _hooks.fire("before_write")  # a test holds the writer here
        puts = [it for it in batch if it[0] == "put"]
        rels = [it[1] for it in batch if it[0] == "release"]
        b = self._breaker
        if not b.allow():
            self.counters["writes_dropped"] += len(puts)
            return
        try:
            c = self._bg_client()
            if puts:
                p = self._pipe(c)
                for _, lease, buf in puts:
                    encode_into(lease.vkey, buf)
                    p.set(lease.vkey, memoryview(buf), px=self._value_ms)
                    # Our lease (or one taken after ours expired): the value is there now, so
                    # whoever looks next finds it; a node still computing just writes it again.
                    p.delete(lease.lkey)
                p.execute()
                c.publish(self.channel, b"\n".join(lease.vkey for _, lease, _ in puts))
            for lease in rels:
                c.eval(_CAD, 1, lease.lkey, lease.token)
        except Exception as e:
            b.failure(e)
            self.counters["writes_failed"] += len(puts)
            log.debug("ucmcache tier 2 %s: write-through: %s: %s", self.label,
                      type(e).__name__, e)
            return
        except BaseException:
            b.abort()
            raise
        b.success()
        self.counters["writes_done"] += len(puts)
        self.counters["releases"] += len(rels)

    def flush(self, timeout: Optional[float] = 5.0) -> bool:
        """Wait until every write-through queued so far is done (or dropped); False on
        timeout (None or inf: no deadline)."""
        check_timeout(timeout)
        if self._pid != os.getpid():
            return True
        return self._writes.flush(timeout)

    # ---------------------------------------------------------------- announcements (pub/sub)

    def _watch(self, vkey: bytes) -> threading.Event:
        self._check_pid()
        return self._listener.watch(vkey)

    def _unwatch(self, vkey: bytes, ev: threading.Event) -> None:
        self._listener.unwatch(vkey, ev)

    # ---------------------------------------------------------------- lifecycle

    def close(self, timeout: Optional[float] = 5.0) -> None:
        """Flush write-throughs (bounded), stop the threads, close the connections.  The tier
        can be used again afterwards (threads and connections come back on demand)."""
        check_timeout(timeout)  # refused before anything stops
        if self._pid != os.getpid():
            self._after_fork()
            return
        self.flush(timeout)
        self._writes.stop()
        self._listener.stop()  # the running subscriber ends; a later wait starts a new one
        with self._lock:
            fg, bg = self._fg, self._bg
            if self._user_client is None:
                self._fg = self._bg = None
        if self._user_client is None:
            for c in {id(fg): fg, id(bg): bg}.values():
                if c is not None:
                    try:
                        c.close()
                    except Exception:
                        pass

    def _after_fork(self) -> None:
        # Threads did not follow the fork; connections are the parent's.
        self._reset_process_state()

    def bind(self, count: Callable[[int, int], None], slot_size: int) -> Leases:
        """This tier as one cache uses it (ucmcache.core.tier): that cache's leases."""
        return Leases(self, count, slot_size)


def _rebuild(config: Dict[str, Any]) -> RedisTier:
    cfg = dict(config)
    url = cfg.pop("url")
    return RedisTier(url, **cfg)


def _parse_node(node: Any) -> Tuple[str, int]:
    if isinstance(node, str):
        host, sep, port = node.rpartition(":")
        if not sep or not host:
            raise ValueError(f"a cluster node must be 'host:port' or (host, port), got {node!r}")
        return host.strip("[]"), int(port)
    if isinstance(node, (tuple, list)) and len(node) == 2:
        return str(node[0]), int(node[1])
    raise ValueError(f"a cluster node must be 'host:port' or (host, port), got {node!r}")


@atexit.register
def _flush_at_exit() -> None:
    for t in list(_live_tiers):
        try:
            if t._pid == os.getpid():
                t.flush(2.0)
        except Exception:
            pass


def _forget_after_fork() -> None:
    for t in list(_live_tiers):
        t._after_fork()


os.register_at_fork(after_in_child=_forget_after_fork)
