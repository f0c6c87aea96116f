"""The waits of a load, and their two drivers: each decision about a load or a wait is written
once, as a generator (a sans-I/O core) that yields what it waits for and is sent the answer;
``run_blocking`` answers with blocking calls, ``run_async`` with awaits.  So get_or_load and
aget_or_load (``_single_flight``), Handle.wait's full path and wait_async (``_handle``) differ
only in their driver, and every protocol step, with its invariant, stands in the core once.

A step is a tuple ``(kind, subject, timeout)``:

    LOAD         (LOAD, loader, None): the loader's value.  Blocking: ``loader()``; async:
                 ``loader()``, awaited if it returned an awaitable.
    WAIT_HANDLE  (WAIT_HANDLE, handle, timeout): the handle's slot Ready (the answer is None),
                 or the wait's exception.  Blocking: ``handle.wait`` (one C step, csrc/ucm_hit.c);
                 async: ``handle.wait_async``.
    WAIT_LOADED  (WAIT_LOADED, handle, timeout): the state of the handle's slot once it left
                 Loading.  Blocking: ``cache._wait_loaded``; async: ``_slots.wait_loaded_async``
                 (one shared wait per event loop and slot).

A step's exception is thrown into the core where it waited, so its ``except``/``with`` blocks
(an owner's Failed publish, a handle's close) run exactly as they would around a direct call.
"""
from __future__ import annotations

import inspect
from typing import Any, Generator, Optional, Tuple, TypeVar

from ._slots import wait_loaded_async

LOAD = "load"
WAIT_HANDLE = "wait_handle"
WAIT_LOADED = "wait_loaded"

Step = Tuple[str, Any, Optional[float]]
T = TypeVar("T")
Steps = Generator[Step, Any, T]


def _resume(steps: Steps[T], answer: Any, error: Optional[BaseException]) -> Step:
    """The core resumed with a step's answer, or with its exception (``error``): its next step,
    or StopIteration(result) once it returned.  A core re-raises a step's exception after its
    cleanup; a StopIteration re-raised by a generator comes back as RuntimeError (PEP 479), so
    a loader's own StopIteration is raised again as itself: what a direct call would raise."""
    if error is None:
        return steps.send(answer)
    try:
        return steps.throw(error)
    except RuntimeError as wrapped:
        if isinstance(error, StopIteration) and wrapped.__cause__ is error:
            raise error from None
        raise


def run_blocking(steps: Steps[T]) -> T:
    """Drive a core with blocking calls (the caller's thread waits; the GIL is released in the
    waits' C steps)."""
    answer: Any = None
    error: Optional[BaseException] = None
    while True:
        try:
            step = _resume(steps, answer, error)
        except StopIteration as done:
            if done is error:
                raise  # a step's own StopIteration (see _resume), not the core's return
            return done.value
        finally:
            error = None  # no cycle: a raised error's traceback holds this frame
        kind, subject, timeout = step
        answer = None
        try:
            if kind is LOAD:
                answer = subject()
            elif kind is WAIT_HANDLE:
                subject.wait(timeout)
            else:
                answer = subject._cache._wait_loaded(subject._slot, timeout)
        except BaseException as e:
            error = e


async def run_async(steps: Steps[T]) -> T:
    """Drive a core with awaits (the event loop runs while the core waits)."""
    answer: Any = None
    error: Optional[BaseException] = None
    while True:
        try:
            step = _resume(steps, answer, error)
        except StopIteration as done:
            if done is error:
                raise  # a step's own StopIteration (see _resume); a coroutine makes it a
                # RuntimeError (PEP 479), as it did a loader's raised in an async def
            return done.value
        finally:
            error = None  # no cycle: a raised error's traceback holds this frame
        kind, subject, timeout = step
        answer = None
        try:
            if kind is LOAD:
                answer = subject()
                if inspect.isawaitable(answer):
                    answer = await answer
            elif kind is WAIT_HANDLE:
                await subject.wait_async(timeout)
            else:
                answer = await wait_loaded_async(subject._cache, subject._slot, timeout)
        except BaseException as e:
            error = e
