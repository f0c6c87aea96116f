"""Announcements: a write-through names its keys on a pub/sub channel; this process's listener
wakes the local waiters of those keys (DESIGN 4.10).

Announcements are best effort (a waiter polls with backoff anyway): they only wake it sooner.
One subscriber thread per process and channel, started by the first watch; a lost connection
is retried with backoff while waiters poll.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Optional

log = logging.getLogger("ucmcache.tier2")


class Listener:
    """Waiters by Redis key, and the subscriber thread that wakes them."""

    def __init__(self, client: Callable[[], Any], channel: bytes, counters: Dict[str, int],
                 label: str):
        self._client = client  # the tier's background client (made on demand)
        self.channel = channel
        self.counters = counters
        self.label = label
        self._lock = threading.Lock()
        self._watchers: Dict[bytes, List[threading.Event]] = {}
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def watch(self, vkey: bytes) -> threading.Event:
        """An event set when vkey is announced (the caller clears it and unwatches)."""
        ev = threading.Event()
        with self._lock:
            self._watchers.setdefault(vkey, []).append(ev)
            if self._thread is None:
                t = threading.Thread(target=self._loop, args=(self._stop,),
                                     name="ucmcache-tier2-notifier", daemon=True)
                self._thread = t
                t.start()
        return ev

    def unwatch(self, vkey: bytes, ev: threading.Event) -> None:
        with self._lock:
            evs = self._watchers.get(vkey)
            if evs is not None:
                try:
                    evs.remove(ev)
                except ValueError:
                    pass
                if not evs:
                    del self._watchers[vkey]

    def stop(self) -> None:
        """The running subscriber ends; a later watch starts a new one."""
        with self._lock:
            self._stop.set()
            self._stop = threading.Event()
            self._thread = None

    def _heard(self, data: Any) -> None:
        if not isinstance(data, (bytes, bytearray)):
            return
        self.counters["announcements_heard"] += 1
        with self._lock:
            for k in bytes(data).split(b"\n"):
                for ev in self._watchers.get(k, ()):
                    ev.set()

    def _loop(self, stop: threading.Event) -> None:
        backoff = 0.05
        while not stop.is_set():
            ps = None
            try:
                ps = self._client().pubsub(ignore_subscribe_messages=True)
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
