"""Tier 2: an optional Redis tier (standalone or Redis Cluster) beneath the shared-memory cache.

Without it nothing changes: the shared-memory cache needs no server.  With it
(``SlotCache.create/attach(..., tier2=RedisTier(...))``), the one local owner of a cold key asks
Redis before its loader runs:

* found (and valid): the value is copied into the slot and published Ready; the caller gets a
  non-owner Ready handle (``get_many``: ``owner[i]`` False) and no loader runs on this node;
* not found: a lease elects one computing node across machines (``SET lease token NX PX ttl``,
  taken in the same round trip as a second read of the value, so a value written between the
  two reads is never recomputed).  The lease holder stays owner; what it publishes Ready is
  written through by a background thread (pipelined, never on a waiter's path), which also
  drops the lease and announces the key on a pub/sub channel.  A node that finds the lease
  held keeps its local owner slot (its local processes wait on it as usual) and waits for the
  value: woken by the announcement, checked by polling with backoff (announcements are best
  effort), bounded by the lease's remaining time: when the lease is gone (its holder failed,
  or died and the lease expired) it takes the lease and loads.  So with tier 2 a get() can
  block while another node loads the key, never longer than the get's ``timeout`` (when given)
  or twice ``lease_ttl``; past that it loads the key itself.

``clear()`` is local: it does not touch tier 2 (change the namespace to drop tier-2 values).

Deadlocks across nodes: a caller that already owns other unpublished slots (in its context)
never waits for another node (it loads itself), and ``get_many`` takes leases in one global
order (the Redis key), dropping any taken past the first one held elsewhere before it waits, so
no two batches can wait on each other.

Keys carry the namespace, the layout version, the block id and the offset, with the id and
offset as the Redis Cluster hash tag, so a value and its lease live in the same hash slot:
``ucm:v<L>:<namespace>:{<id hex>:<offset>}`` and ``...:lease``.  Values carry a header (magic,
format and layout version, length, a fingerprint of the Redis key, crc32 over all of it), so a
corrupt, truncated, oversized or foreign value (another key's, another namespace's) is a miss,
counted in ``t2_bad_values``, never returned.

Faults: every round trip is bounded by ``timeout`` (socket and connect timeouts; connection
errors are retried once at once, timeouts not), and a circuit breaker (closed, open,
half-open) bypasses tier 2 after ``breaker_failures`` consecutive failures, lets one probe
through every ``breaker_reset`` seconds, and logs each opening and closing once on the
``ucmcache.tier2`` logger.  A get that meets a fault or an open breaker goes on as if tier 2 did
not exist (the local owner loads), counted in ``t2_bypasses``.

Counters (shared memory, the caller's rank; ``stats()`` and ``ucmcache inspect``): each owner
that consulted tier 2 ends in exactly one of ``t2_hits``, ``t2_misses`` (it loads) or
``t2_bypasses``; ``t2_bad_values`` and ``t2_lease_waits`` count events on the way;
``t2_writes`` counts write-throughs queued.  Process-local counters of the background writer
are in ``RedisTier.counters``.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import struct
import threading
import time
import weakref
import zlib
from collections import deque
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, NamedTuple, Optional,
                    Sequence, Tuple)

import numpy as np

from ._core import lib
from ._handle import Handle, HandleBatch, _owned_slots, publish_ready, slot_length
from ._keys import split_key

if TYPE_CHECKING:  # pragma: no cover
    from ._cache import SlotCache

log = logging.getLogger("ucmcache.tier2")

LAYOUT_VERSION = int(lib.UCM_LAYOUT_VERSION)
MAGIC = b"UCT2"
FORMAT = 1
# magic, format, layout version, flags, payload length, crc32, fingerprint of the Redis key
HEADER = struct.Struct("<4sBBHII8s")
HEADER_SIZE = HEADER.size  # 24

POLL_MIN = 0.002        # first re-check of a value another node is computing (seconds)
POLL_MAX = 0.1          # longest gap between re-checks (the pub/sub wake-up usually comes first)
WRITE_BATCH = 64        # write-throughs per pipeline
WRITE_BATCH_BYTES = 8 << 20

_CAD = ("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) "
        "end return 0")

# Test points: name -> callable(**info), fired where a test must order events across processes.
_points: Dict[str, Callable[..., None]] = {}


def _fire(name: str, **info: Any) -> None:
    fn = _points.get(name)
    if fn is not None:
        fn(**info)


class _Bypass(Exception):
    """Tier 2 was skipped (breaker open) or failed (error, timeout): go on without it."""


class _Lease(NamedTuple):
    vkey: bytes
    lkey: bytes
    token: Optional[bytes]  # None: we load without a lease (bypass, or we may not wait)


# ---------------------------------------------------------------- circuit breaker

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class _Breaker:
    """Closed: calls go through; ``threshold`` consecutive failures open it.  Open: calls are
    refused until ``reset`` seconds have passed, then one probe goes through (half-open):
    success closes it, failure opens it again.  Opening and closing are logged once each."""

    def __init__(self, threshold: int, reset: float, clock: Callable[[], float], label: str):
        self.threshold = threshold
        self.reset = reset
        self.clock = clock
        self.label = label
        self.state = CLOSED
        self.fails = 0
        self.opened_at = 0.0
        self.probing = False
        self.changes = 0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        if self.state == CLOSED:
            return True
        with self._lock:
            if self.state == CLOSED:
                return True
            if self.state == OPEN and not self.probing and \
                    self.clock() - self.opened_at >= self.reset:
                self._set(HALF_OPEN)
                self.probing = True
                log.debug("ucmcache tier 2 %s: half-open, probing", self.label)
                return True
            return False

    def would_allow(self) -> bool:
        """allow() without taking the probe."""
        s = self.state
        return s == CLOSED or (s == OPEN and self.clock() - self.opened_at >= self.reset)

    def success(self) -> None:
        if self.state == CLOSED and self.fails == 0:
            return
        with self._lock:
            self.fails = 0
            self.probing = False
            if self.state != CLOSED:
                self._set(CLOSED)
                log.warning("ucmcache tier 2 %s: circuit closed, tier 2 resumes", self.label)

    def failure(self, err: BaseException) -> None:
        with self._lock:
            self.fails += 1
            self.probing = False
            if self.state == HALF_OPEN:
                self.opened_at = self.clock()
                self._set(OPEN)
                log.debug("ucmcache tier 2 %s: probe failed (%s: %s), open again", self.label,
                          type(err).__name__, err)
            elif self.state == CLOSED and self.fails >= self.threshold:
                self.opened_at = self.clock()
                self._set(OPEN)
                log.warning("ucmcache tier 2 %s: circuit open after %d consecutive failures "
                            "(last: %s: %s); bypassing tier 2, next probe in %.1f s", self.label,
                            self.fails, type(err).__name__, err, self.reset)

    def abort(self) -> None:
        """A probe ended without a verdict (interrupted): let the next call probe again."""
        with self._lock:
            if self.state == HALF_OPEN:
                self._set(OPEN)
            self.probing = False

    def _set(self, state: str) -> None:
        self.state = state
        self.changes += 1


# ---------------------------------------------------------------- values

def _fingerprint(vkey: bytes) -> bytes:
    return hashlib.blake2b(vkey, digest_size=8).digest()


def encode_into(vkey: bytes, buf: bytearray) -> None:
    """Fill the header of buf (HEADER_SIZE bytes, then the payload) for Redis key vkey."""
    n = len(buf) - HEADER_SIZE
    fp = _fingerprint(vkey)
    HEADER.pack_into(buf, 0, MAGIC, FORMAT, LAYOUT_VERSION & 0xFF, 0, n, 0, fp)
    mv = memoryview(buf)
    crc = zlib.crc32(mv[HEADER_SIZE:], zlib.crc32(fp, zlib.crc32(mv[:12])))
    struct.pack_into("<I", buf, 12, crc)
    mv.release()


def encode(vkey: bytes, payload: bytes) -> bytes:
    buf = bytearray(HEADER_SIZE + len(payload))
    buf[HEADER_SIZE:] = payload
    encode_into(vkey, buf)
    return bytes(buf)


def decode(vkey: bytes, blob: Any, limit: int) -> Optional[memoryview]:
    """The payload of a stored value, or None when it is not a whole, valid value for vkey of
    at most limit bytes."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < HEADER_SIZE:
        return None
    magic, fmt, layout, flags, n, crc, fp = HEADER.unpack_from(blob)
    if magic != MAGIC or fmt != FORMAT or layout != (LAYOUT_VERSION & 0xFF) or flags != 0:
        return None
    if n != len(blob) - HEADER_SIZE or n > limit or fp != _fingerprint(vkey):
        return None
    mv = memoryview(blob)
    if zlib.crc32(mv[HEADER_SIZE:], zlib.crc32(fp, zlib.crc32(mv[:12]))) != crc:
        return None
    return mv[HEADER_SIZE:]


def _escape(namespace: str) -> str:
    # '{' and '}' would change the Cluster hash tag; ':' stays readable.
    return namespace.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def _token() -> bytes:
    return os.urandom(12).hex().encode()


# ---------------------------------------------------------------- the tier

_live_tiers: "weakref.WeakSet[RedisTier]" = weakref.WeakSet()


class RedisTier:
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
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if isinstance(breaker_failures, bool) or not isinstance(breaker_failures, int) \
                or breaker_failures < 1:
            raise ValueError(f"breaker_failures must be an int >= 1, got {breaker_failures!r}")
        if isinstance(breaker_reset, bool) or not isinstance(breaker_reset, (int, float)) \
                or breaker_reset < 0:
            raise ValueError(f"breaker_reset must be >= 0 seconds, got {breaker_reset!r}")
        if value_ttl is not None and (isinstance(value_ttl, bool) or
                                      not isinstance(value_ttl, (int, float)) or value_ttl <= 0):
            raise ValueError(f"value_ttl must be None or a positive number, got {value_ttl!r}")
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
        self._prefix = f"ucm:v{LAYOUT_VERSION}:{_escape(namespace)}:".encode()
        self.channel = self._prefix + b"ready"
        self._breaker = _Breaker(breaker_failures, float(breaker_reset), self._clock, self.label)
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
        self._cond = threading.Condition()
        self._queue: deque = deque()
        self._queued_bytes = 0
        self._enqueued = 0
        self._done = 0
        self._writer: Optional[threading.Thread] = None
        self._stopping = False
        self._watch_lock = threading.Lock()
        self._watchers: Dict[bytes, List[threading.Event]] = {}
        self._notifier: Optional[threading.Thread] = None
        self._stop = threading.Event()

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
        cfg = self._config
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
        """fn(client) under the breaker; _Bypass when tier 2 is skipped or fails."""
        b = self._breaker
        if not b.allow():
            raise _Bypass("circuit open")
        try:
            r = fn(self._client())
        except Exception as e:
            b.failure(e)
            log.debug("ucmcache tier 2 %s: %s: %s", self.label, type(e).__name__, e)
            raise _Bypass(f"{type(e).__name__}: {e}") from e
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

    def _put(self, lease: _Lease, buf: bytearray) -> bool:
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
            self._enqueue(("release", _Lease(b"", lkey, token), None), 0)

    def _enqueue(self, item, nbytes: int) -> bool:
        self._check_pid()
        with self._cond:
            if nbytes and self._queue and self._queued_bytes + nbytes > self._max_pending:
                self.counters["writes_dropped"] += 1
                return False
            self._queue.append(item)
            self._queued_bytes += nbytes
            self._enqueued += 1
            if self._writer is None:
                self._stopping = False
                t = threading.Thread(target=self._writer_loop, name="ucmcache-tier2-writer",
                                     daemon=True)
                self._writer = t
                t.start()
            self._cond.notify_all()
        return True

    def _writer_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    self._writer = None
                    return
                batch = []
                size = 0
                while self._queue and len(batch) < WRITE_BATCH and size < WRITE_BATCH_BYTES:
                    item = self._queue.popleft()
                    n = len(item[2]) if item[2] is not None else 0
                    batch.append(item)
                    size += n
                self._queued_bytes -= size
            try:
                self._write(batch)
            except BaseException:  # never let the writer die silently
                log.exception("ucmcache tier 2 %s: write-through failed", self.label)
            finally:
                with self._cond:
                    self._done += len(batch)
                    self._cond.notify_all()

    def _write(self, batch: list) -> None:
        _fire("before_write", n=len(batch))  # a test holds the writer here
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

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every write-through queued so far is done (or dropped); False on
        timeout."""
        if self._pid != os.getpid():
            return True
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._enqueued
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0 or self._writer is None:
                    return self._done >= target
                self._cond.wait(left)
        return True

    # ---------------------------------------------------------------- announcements (pub/sub)

    def _watch(self, vkey: bytes) -> threading.Event:
        self._check_pid()
        ev = threading.Event()
        with self._watch_lock:
            self._watchers.setdefault(vkey, []).append(ev)
            if self._notifier is None:
                t = threading.Thread(target=self._notifier_loop, args=(self._stop,),
                                     name="ucmcache-tier2-notifier", daemon=True)
                self._notifier = t
                t.start()
        return ev

    def _unwatch(self, vkey: bytes, ev: threading.Event) -> None:
        with self._watch_lock:
            evs = self._watchers.get(vkey)
            if evs is not None:
                try:
                    evs.remove(ev)
                except ValueError:
                    pass
                if not evs:
                    del self._watchers[vkey]

    def _heard(self, data: Any) -> None:
        if not isinstance(data, (bytes, bytearray)):
            return
        self.counters["announcements_heard"] += 1
        with self._watch_lock:
            for k in bytes(data).split(b"\n"):
                for ev in self._watchers.get(k, ()):
                    ev.set()

    def _notifier_loop(self, stop: threading.Event) -> None:
        backoff = 0.05
        while not stop.is_set():
            ps = None
            try:
                ps = self._bg_client().pubsub(ignore_subscribe_messages=True)
                ps.subscribe(self.channel)
                backoff = 0.05
                while not stop.is_set():
                    msg = ps.get_message(timeout=0.2)
                    if msg is not None and msg.get("type") == "message":
                        self._heard(msg.get("data"))
            except Exception as e:
                log.debug("ucmcache tier 2 %s: subscriber: %s: %s", self.label,
                          type(e).__name__, e)
            finally:
                if ps is not None:
                    try:
                        ps.close()
                    except Exception:
                        pass
            stop.wait(backoff)  # the waiters poll meanwhile; announcements only speed them up
            backoff = min(backoff * 2, 2.0)

    # ---------------------------------------------------------------- lifecycle

    def close(self, timeout: float = 5.0) -> None:
        """Flush write-throughs (bounded), stop the threads, close the connections.  The tier
        can be used again afterwards (threads and connections come back on demand)."""
        if self._pid != os.getpid():
            self._after_fork()
            return
        self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        with self._watch_lock:
            self._stop.set()  # the running subscriber ends; a later wait starts a new one
            self._stop = threading.Event()
            self._notifier = None
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

    def _bind(self, cache: "SlotCache") -> "_Bound":
        return _Bound(self, cache)


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


def check_tier2(tier2: Any) -> None:
    if tier2 is not None and not isinstance(tier2, RedisTier):
        raise TypeError(f"tier2 must be a ucmcache.RedisTier or None, got "
                        f"{type(tier2).__name__}")


def bind_tier2(tier2: Any, cache: "SlotCache") -> Optional["_Bound"]:
    check_tier2(tier2)
    return None if tier2 is None else tier2._bind(cache)


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


# ---------------------------------------------------------------- one cache's use of the tier

class _Bound:
    """A RedisTier as one SlotCache uses it: the hooks SlotCache calls, and the leases its
    owners hold (slot -> lease) until they publish."""

    def __init__(self, tier: RedisTier, cache: "SlotCache"):
        self.tier = tier
        self.cache = cache
        self.pending: Dict[int, _Lease] = {}

    def _stat(self, counter: int, n: int = 1) -> None:
        ctx = self.cache._ctx
        if ctx is not None and n:
            lib.ucm_stat_add(ctx, counter, n)

    # ---------------------------------------------------------------- hooks from SlotCache

    handle_cls: type = None  # set below, once the classes exist
    batch_cls: type = None

    def owner_handle(self, h: "_T2Handle", block_id: bytes, offset: int,
                     timeout: Optional[float]) -> Handle:
        """get(): h owns a cold slot.  Returns it Ready and no longer owner when tier 2 had
        the value, else still the owner, its ready() writing through."""
        cache = self.cache
        slot = h._slot
        h._t2 = self
        try:
            alone = not (_owned_slots(cache) - {slot})
            payload = self._resolve([(slot, block_id, offset)], alone, timeout)[0]
            if payload is not None:
                self._publish_hit(slot, payload)
                h._owner = False
                h._published = True
                h._owned.discard(slot)
        except BaseException as e:
            h.__exit__(type(e), e, e.__traceback__)
            raise
        return h

    def owner_batch(self, batch: "_T2Batch", split: Sequence[Tuple[bytes, int]],
                    timeout: Optional[float]) -> HandleBatch:
        """get_many(): the owned positions ask tier 2 together; those it serves come back
        Ready and not owned."""
        cache = self.cache
        slots, owner = batch._slots, batch.owner
        batch._t2 = self
        try:
            idx = [int(i) for i in np.flatnonzero(owner)]
            mine = {int(slots[i]) for i in idx}
            alone = not (_owned_slots(cache) - mine)
            items = [(int(slots[i]), split[i][0], split[i][1]) for i in idx]
            payloads = self._resolve(items, alone, timeout)
            for i, p in zip(idx, payloads):
                if p is not None:
                    self._publish_hit(int(slots[i]), p)
                    owner[i] = False
                    batch._owned.discard(int(slots[i]))
        except BaseException as e:
            batch.__exit__(type(e), e, e.__traceback__)
            raise
        return batch

    def exist_prefix(self, split: Sequence[Tuple[bytes, int]]) -> int:
        """How many leading keys tier 2 holds, one pipelined round trip (0 when bypassed)."""
        vkeys = [self.tier._keys(b, o)[0] for b, o in split]
        try:
            found = self.tier._exists(vkeys)
        except _Bypass:
            self._stat(lib.UCM_ST_T2_BYPASSES)
            return 0
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n

    def published(self, slot: int) -> None:
        """The owner published slot Ready: write it through (the copy is taken here, while the
        slot is pinned; the rest happens on the writer thread)."""
        lease = self.pending.pop(slot, None)
        if lease is None:
            return
        cache = self.cache
        if cache._ctx is None or lib.ucm_slot_state(cache._ctx, slot) != lib.UCM_READY:
            self.tier._release(lease.lkey, lease.token)
            return
        n = slot_length(cache, slot)
        off = cache._layout.data(slot)
        buf = bytearray(HEADER_SIZE + n)
        buf[HEADER_SIZE:] = cache._seg.view[off:off + n]
        if self.tier._put(lease, buf):
            self._stat(lib.UCM_ST_T2_WRITES)

    def abandon(self, slot: int) -> None:
        """The owner's handle closes without having published Ready: drop our lease now, so
        another node takes over without waiting for it to expire."""
        lease = self.pending.pop(slot, None)
        if lease is not None:
            self.tier._release(lease.lkey, lease.token)

    def close(self) -> None:
        for slot in list(self.pending):
            self.abandon(slot)
        self.tier.flush(2.0)

    # ---------------------------------------------------------------- the protocol

    def _publish_hit(self, slot: int, payload: memoryview) -> None:
        cache = self.cache
        n = payload.nbytes
        off = cache._layout.data(slot)
        cache._seg.view[off:off + n] = payload
        publish_ready(cache, slot, True, n)
        self._stat(lib.UCM_ST_T2_HITS)

    def _resolve(self, items: List[Tuple[int, bytes, int]], may_wait: bool,
                 timeout: Optional[float]) -> List[Optional[memoryview]]:
        """For each owned (slot, block_id, offset): the payload tier 2 has (to publish), or
        None (the caller loads; a lease, if we took one, is in self.pending)."""
        try:
            return self._resolve_inner(items, may_wait, timeout)
        except Exception:
            # A bug of ours must not fail a get: log it, load as if tier 2 were absent.
            log.exception("ucmcache tier 2 %s: unexpected error; bypassing", self.tier.label)
            out: List[Optional[memoryview]] = []
            for slot, _, _ in items:
                self.pending.pop(slot, None)
                out.append(None)
            self._stat(lib.UCM_ST_T2_BYPASSES, len(items))
            return out

    def _resolve_inner(self, items, may_wait, timeout):
        tier = self.tier
        limit = self.cache._layout.slot_size
        n = len(items)
        out: List[Optional[memoryview]] = [None] * n
        keys = [tier._keys(b, o) for _, b, o in items]
        for slot, _, _ in items:
            self.pending.pop(slot, None)

        def load(i: int, token: Optional[bytes], counter: int) -> None:
            v, l = keys[i]
            self.pending[items[i][0]] = _Lease(v, l, token)
            self._stat(counter)

        def bypass(positions: Iterable[int]) -> List[Optional[memoryview]]:
            for i in positions:
                load(i, None, lib.UCM_ST_T2_BYPASSES)
            return out

        # Round trip 1: the values.
        try:
            blobs = tier._get_all([k[0] for k in keys])
        except _Bypass:
            return bypass(range(n))
        rest = []
        bad = set()  # positions whose bad value is counted already (once per get)

        def count_bad(i: int) -> None:
            if i not in bad:
                bad.add(i)
                self._stat(lib.UCM_ST_T2_BAD_VALUES)

        for i, blob in enumerate(blobs):
            if blob is not None:
                p = decode(keys[i][0], blob, limit)
                if p is not None:
                    out[i] = p
                    continue
                count_bad(i)
            rest.append(i)
        if not rest:
            return out

        # Round trip 2 (and more only after waits): leases, in one global order.
        rest.sort(key=lambda i: keys[i][0])
        start = tier._clock()
        deadline = start + 2 * tier.lease_ttl
        if timeout is not None:
            deadline = min(deadline, start + timeout)
        while rest:
            tokens = {i: _token() for i in rest}
            try:
                got = tier._acquire([(keys[i][0], keys[i][1], tokens[i]) for i in rest])
            except _Bypass:
                return bypass(rest)
            held: Optional[int] = None
            retry: List[int] = []
            drops: List[bytes] = []
            for i, (ok, blob) in zip(rest, got):
                p = decode(keys[i][0], blob, limit) if blob is not None else None
                if blob is not None and p is None:
                    count_bad(i)
                if p is not None:
                    out[i] = p
                    if ok:  # the value arrived between our two reads: the lease is not needed
                        tier._release(keys[i][1], tokens[i])
                elif ok and (held is None or not may_wait):
                    load(i, tokens[i], lib.UCM_ST_T2_MISSES)  # we compute it for all nodes
                elif ok:
                    # Past the first lease held elsewhere: hold none while we wait (drop what
                    # we just took, in the wait's first round trip), take them again after.
                    drops.append(keys[i][1])
                    retry.append(i)
                else:
                    if held is None:
                        held = i
                    retry.append(i)
            if held is None:
                break
            if not may_wait:
                # This caller owns other unpublished slots: waiting could close a cycle, so it
                # loads what another node is loading too.
                for i in retry:
                    load(i, None, lib.UCM_ST_T2_MISSES)
                break
            self._stat(lib.UCM_ST_T2_LEASE_WAITS)
            r = self._wait(keys[held], drops, deadline, limit, lambda: count_bad(held))
            if r == "bypass":
                return bypass(retry)
            if r == "timeout":
                for i in retry:
                    load(i, None, lib.UCM_ST_T2_MISSES)
                break
            if isinstance(r, memoryview):
                out[held] = r
                retry.remove(held)
            rest = retry  # "free": the lease is gone (failed or expired holder): try again
        return out

    def _wait(self, key: Tuple[bytes, bytes], drops: List[bytes], deadline: float,
              limit: int, count_bad: Callable[[], None]) -> Any:
        """Wait for another node's value: the payload, 'free' (no lease any more),
        'timeout' or 'bypass'."""
        tier = self.tier
        vkey, lkey = key
        ev = tier._watch(vkey)
        first = True
        try:
            delay = POLL_MIN
            while True:
                try:
                    blob, pttl = tier._poll(vkey, lkey, drops)
                except _Bypass:
                    return "bypass"
                drops = []
                if first:
                    first = False
                    _fire("lease_wait", vkey=vkey)  # watching, and holding no lease of ours
                if blob is not None:
                    p = decode(vkey, blob, limit)
                    if p is not None:
                        return p
                    count_bad()
                if pttl == -2:
                    return "free"
                now = tier._clock()
                if now >= deadline or pttl == -1:  # -1: a lease without expiry is not ours
                    return "timeout"
                ev.wait(max(0.0, min(delay, pttl / 1000.0 + 0.001, deadline - now)))
                ev.clear()
                delay = min(delay * 2, POLL_MAX)
        finally:
            tier._unwatch(vkey, ev)


class _T2Handle(Handle):
    """An owner's handle with tier 2: ready() writes through, closing unpublished drops the
    lease."""

    __slots__ = ("_t2",)

    def ready(self, nbytes: Optional[int] = None) -> None:
        super().ready(nbytes)
        t2 = getattr(self, "_t2", None)
        if t2 is not None:
            t2.published(self._slot)

    def _close(self, message: bytes) -> None:
        t2 = getattr(self, "_t2", None)
        try:
            if not self._closed and t2 is not None and self._cache._ctx is not None:
                t2.abandon(self._slot)
        finally:
            super()._close(message)


class _T2Batch(HandleBatch):
    """A batch with tier 2: ready(i) writes through, closing drops unpublished leases."""

    _t2: Optional[_Bound] = None

    def ready(self, i: int, nbytes: Optional[int] = None) -> None:
        super().ready(i, nbytes)
        if self._t2 is not None:
            self._t2.published(int(self._slots[self._index(i)]))

    def _close(self, message: bytes) -> None:
        try:
            if not self._closed and self._t2 is not None and self._cache._ctx is not None:
                for s in self._slots[self.owner]:
                    self._t2.abandon(int(s))
        finally:
            super()._close(message)


_Bound.handle_cls = _T2Handle
_Bound.batch_cls = _T2Batch
