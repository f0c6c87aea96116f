"""The write-through queue (DESIGN 4.10, 4.14): what a tier does with an owner's published
payload, off the owner's path.  The owner's thread only queues a copy; one daemon writer thread
per process (started on the first write-through, ended by ``stop`` once the queue is empty)
writes them.  The queue is bounded in bytes (``max_pending_bytes``): a write-through past the
bound is refused (the tier counts the drop), except into an empty queue, so one payload larger
than the bound still goes.  A fork leaves the thread behind: the tier makes a new queue in the
child.  Both tiers (``RedisTier``, ``DiskTier``) write through one of these; this module imports
nothing of the package.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, List, Optional

from ..core.timeouts import check_timeout


class WriteThroughQueue:
    """Items queued by the owners' threads, written in batches by one writer thread.

    ``write(batch)`` writes a list of items (at most ``batch_items`` of them, and no more once
    their bytes reach ``batch_bytes``).  An exception of ``write`` is logged on ``log`` as
    "<what>: write-through failed" and the writer goes on: it never dies silently.
    """

    def __init__(self, write: Callable[[List[Any]], None], *, max_pending_bytes: int,
                 thread_name: str, log: logging.Logger, what: str, batch_items: int = 1,
                 batch_bytes: Optional[int] = None):
        self._write = write
        self._max_pending = max_pending_bytes
        self._thread_name = thread_name
        self._log = log
        self._what = what
        self._batch_items = batch_items
        self._batch_bytes = batch_bytes
        self._cond = threading.Condition()
        self._queue: deque = deque()  # (item, its bytes)
        self._queued_bytes = 0
        self._enqueued = 0   # items ever queued; flush waits for _done to reach it
        self._done = 0       # items written (or failed: they will not be written)
        self._writer: Optional[threading.Thread] = None
        self._stopping = False

    def put(self, item: Any, nbytes: int) -> bool:
        """Queue item (nbytes of payload; 0 for an item that carries none, never refused) for
        the writer thread, starting it if none runs; False when the bound refused it."""
        with self._cond:
            if nbytes and self._queue and self._queued_bytes + nbytes > self._max_pending:
                return False
            self._queue.append((item, nbytes))
            self._queued_bytes += nbytes
            self._enqueued += 1
            if self._writer is None:
                self._stopping = False
                t = threading.Thread(target=self._writer_loop, name=self._thread_name,
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
                batch: List[Any] = []
                size = 0
                while self._queue and len(batch) < self._batch_items and (
                        self._batch_bytes is None or size < self._batch_bytes):
                    item, nbytes = self._queue.popleft()
                    batch.append(item)
                    size += nbytes
                self._queued_bytes -= size
            try:
                self._write(batch)
            except BaseException:  # never let the writer die silently
                self._log.exception("%s: write-through failed", self._what)
            finally:
                with self._cond:
                    self._done += len(batch)
                    self._cond.notify_all()

    def flush(self, timeout: object) -> bool:
        """Wait until every item queued so far is written (or failed), at most ``timeout``
        seconds (check_timeout's rule: None or inf, no deadline); False if the time ran out
        first (or the writer stopped short of them)."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._enqueued
            while self._done < target:
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or self._writer is None:
                    return self._done >= target
                self._cond.wait(left)
        return True

    def stop(self) -> None:
        """The writer thread ends once the queue is empty (a later put starts a new one)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
