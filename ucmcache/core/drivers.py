"""The waits of a load, and their two drivers: each decision about a load or a wait is written
once, as a generator (a sans-I/O core) that yields what it waits for and is sent the answer;
``run_blocking`` answers with blocking calls, ``run_async`` with awaits.  So get_or_load and
aget_or_load (``_single_flight``), Handle.wait's full path and wait_async (``_handle``) differ
only in their driver, and every protocol step, with its invariant, stands in the core once.

A step is a tuple ``(kind, subject, timeout)``:

    LOAD         (LOAD, loader, None): the loader's value.  Blocking: ``loader()``; async:
                 ``loader()``, awaited if it returned an awaitable.
    WAIT_HANDLE  (WAIT_HANDLE, handle, timeout): the handle, its slot Ready, or the wait's
                 exception.  Blocking: ``handle.wait`` (one C step, csrc/ucm_hit.c);
                 async: ``handle.wait_async``.
    WAIT_LOADED  (WAIT_LOADED, handle, timeout): the state of the handle's slot once it left
                 Loading.  Blocking: ``cache._wait_loaded``; async: ``_slots.wait_loaded_async``
                 (one shared wait per event loop and slot).

A step's exception is thrown into the core where it waited, so its ``except``/``with`` blocks
(an owner's Failed publish, a handle's close) run exactly as they would around a direct call.
So is an exception raised in a driver itself while the core waits at a yield (a signal
handler's, run at any call or loop edge of the driver): the core's cleanup runs at once, as it
would have with the step called in place, and not only when the generator is collected.  A
driver leaving for any other reason closes its core (GeneratorExit) as the last resort.
"""
from __future__ import annotations

import inspect
from typing import Any, Generator, Optional, Tuple, TypeVar

from .slots import wait_loaded_async

LOAD = "load"
WAIT_HANDLE = "wait_handle"
WAIT_LOADED = "wait_loaded"

Step = Tuple[str, Any, Optional[float]]
T = TypeVar("T")
Steps = Generator[Step, Any, T]


class _Returned:
    """A core's result, once it returned (see _next_step)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _next_step(steps: Steps[T], answer: Any, error: Optional[BaseException]) -> Any:
    """The core resumed with a step's answer, or with its exception (``error``): its next step,
    or _Returned(result) once it returned.  A core re-raises a step's exception after its
    cleanup; a StopIteration re-raised by a generator comes back as RuntimeError (PEP 479), so
    a loader's own StopIteration is raised again as itself: what a direct call would raise."""
    try:
        return steps.send(answer) if error is None else steps.throw(error)
    except StopIteration as done:
        return _Returned(done.value)
    except RuntimeError as wrapped:
        if isinstance(error, StopIteration) and wrapped.__cause__ is error:
            raise error from None
        raise
    finally:
        error = None  # no cycle: a raised error's traceback holds this frame


def _suspended(steps: Steps[Any]) -> bool:
    """The core waits at a yield: an exception can be thrown into it there."""
    return inspect.getgeneratorstate(steps) == inspect.GEN_SUSPENDED


def run_blocking(steps: Steps[T]) -> T:
    """Drive a core with blocking calls (the caller's thread waits; the GIL is released in the
    waits' C steps)."""
    answer: Any = None
    error: Optional[BaseException] = None
    try:
        while True:
            try:
                step = _next_step(steps, answer, error)
                if type(step) is _Returned:
                    return step.value
                answer = error = None
                kind, subject, timeout = step
                if kind is LOAD:
                    answer = subject()
                elif kind is WAIT_HANDLE:
                    answer = subject.wait(timeout)
                else:
                    answer = subject._cache._wait_loaded(subject._slot, timeout)
            except BaseException as e:
                if not _suspended(steps):
                    raise  # the core's own end (it ran its cleanup), or before it started
                answer, error = None, e  # the step's, or the driver's: the core's to handle
    finally:
        error = None  # no cycle: a raised error's traceback holds this frame
        steps.close()  # the last resort (an exception at the except's first line)


async def run_async(steps: Steps[T]) -> T:
    """Drive a core with awaits (the event loop runs while the core waits).  A loader's own
    StopIteration becomes a RuntimeError here, as in any coroutine (PEP 479)."""
    answer: Any = None
    error: Optional[BaseException] = None
    try:
        while True:
            try:
                step = _next_step(steps, answer, error)
                if type(step) is _Returned:
                    return step.value
                answer = error = None
                kind, subject, timeout = step
                if kind is LOAD:
                    answer = subject()
                    if inspect.isawaitable(answer):
                        answer = await answer
                elif kind is WAIT_HANDLE:
                    answer = await subject.wait_async(timeout)
                else:
                    answer = await wait_loaded_async(subject._cache, subject._slot, timeout)
            except BaseException as e:
                if not _suspended(steps):
                    raise  # the core's own end (it ran its cleanup), or before it started
                answer, error = None, e  # the step's, or the driver's: the core's to handle
    finally:
        error = None  # no cycle: a raised error's traceback holds this frame
        steps.close()  # the last resort (an exception at the except's first line)
