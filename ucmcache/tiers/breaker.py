"""The circuit breaker in front of tier 2's round trips (DESIGN 4.10).

Every round trip on a get's path goes through ``Breaker.allow``; ``breaker_failures``
consecutive failures open the circuit, and tier 2 is bypassed (``Bypass``) until
``breaker_reset`` seconds have passed and one probe succeeds.  A get that meets an open breaker
goes on as if tier 2 did not exist.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

log = logging.getLogger("ucmcache.tier2")


class Bypass(Exception):
    """Tier 2 was skipped (breaker open) or failed (error, timeout): go on without it."""


CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class Breaker:
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
        self.probe_at = 0.0
        # A probe out longer than this (seconds) expires and the next call probes again: a
        # probe whose verdict never came (its caller died mid-way) must not bypass the tier
        # for the life of the process.  None: probes never expire.
        self.probe_expiry: Optional[float] = None
        self.changes = 0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        if self.state == CLOSED:
            return True
        with self._lock:
            if self.state == CLOSED:
                return True
            now = self.clock()
            if self.state == OPEN and not self.probing and now - self.opened_at >= self.reset:
                self._set(HALF_OPEN)
                self.probing = True
                self.probe_at = now
                log.debug("ucmcache tier 2 %s: half-open, probing", self.label)
                return True
            if self.state == HALF_OPEN and self.probing and self.probe_expiry is not None and \
                    now - self.probe_at >= self.probe_expiry:
                self.probe_at = now
                log.debug("ucmcache tier 2 %s: probe out too long, probing again", self.label)
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

