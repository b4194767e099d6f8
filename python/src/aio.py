# SPDX-License-Identifier: MIT OR Apache-2.0
"""asyncio glue of the tdrv module: ``await job_handle``.

Compiled into the extension (lib.rs, ``aio()``). A job's completion
event (``TDRV_IOC_JOB_NOTIFY``) arrives on its device file, which the
event loops watch with ``add_reader``: no thread, however many jobs are
awaited. Kernels of every kind deliver events; only a driver older than
ABI 1.4 makes a wait fall back to the loop's default executor.

One device file has one event stream, shared by every loop of the
process. So there is one dispatcher per file for the whole process, and
one key counter for every event ever asked for:

- a key is never reused, so the event of a wait that was cancelled (its
  job still running) resolves nothing when it arrives later;
- each loop with a waiter watches the file; whichever loop reads an
  event hands it to the waiter's own loop (``call_soon_threadsafe``), so
  two loops in two threads never lose each other's events;
- a woken waiter asks the driver (a JOB_WAIT poll) whether its job ended
  and asks for a new event if not; nothing here blocks a loop.
"""

import asyncio
import itertools
import threading

# Guards _dispatchers and every dispatcher's tables: loops of several
# threads register, read and forget concurrently.
_lock = threading.Lock()
# fd -> _Dispatcher, while it has waiters. A dispatcher holds a handle of
# its device, so the fd stays open (its number is not reused) while the
# entry exists.
_dispatchers = {}
# Keys of every event the process asks for; next() on a count is atomic.
_keys = itertools.count(1)


def _settle(fut, exc):
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


class _Dispatcher:
    """Hands one device file's completion events to the waiters of every
    loop of the process. Its tables change under ``_lock`` only."""

    def __init__(self, handle):
        self.fd = handle._fileno()
        # Any handle of the device reads the file's events; holding one
        # keeps the file open while a loop watches it.
        self.reader = handle
        self.waiting = {}  # key -> future (of its own loop)
        self.loops = {}  # loop -> number of its waiters

    def _readable(self):
        exc = None
        try:
            events = self.reader._read_events()
        except Exception as e:  # noqa: BLE001 - every waiter is told
            # The device file fails (ENODEV after removal): every waiter
            # gets the error unless JOB_WAIT says its job ended.
            events, exc = None, e
        with _lock:
            if events is None:
                futs = list(self.waiting.values())
            else:
                futs = [self.waiting.get(key) for _job_id, key, _errno in events]
        for fut in futs:
            if fut is None:
                continue  # an event of a wait that was cancelled meanwhile
            loop = fut.get_loop()
            try:
                here = asyncio.get_running_loop() is loop
            except RuntimeError:
                here = False
            if here:
                _settle(fut, exc)
            else:
                try:
                    loop.call_soon_threadsafe(_settle, fut, exc)
                except RuntimeError:
                    pass  # that loop is closed: nobody waits there any more


def _register(handle, loop):
    """Asks for the completion event of ``handle``'s job under a new key;
    returns the dispatcher, the key and the future the event resolves."""
    with _lock:
        fd = handle._fileno()
        d = _dispatchers.get(fd)
        if d is None:
            d = _dispatchers[fd] = _Dispatcher(handle)
        key = next(_keys)
        fut = loop.create_future()
        d.waiting[key] = fut
        n = d.loops.get(loop, 0)
        d.loops[loop] = n + 1
        if n == 0:
            # Called on `loop`'s own thread (from its coroutine).
            loop.add_reader(d.fd, d._readable)
    try:
        handle._notify(key)
    except BaseException:
        _forget(d, key, loop)
        raise
    return d, key, fut


def _forget(d, key, loop):
    with _lock:
        d.waiting.pop(key, None)
        n = d.loops.get(loop, 0) - 1
        if n > 0:
            d.loops[loop] = n
        else:
            d.loops.pop(loop, None)
            if not loop.is_closed():
                loop.remove_reader(d.fd)
        if not d.waiting and _dispatchers.get(d.fd) is d:
            del _dispatchers[d.fd]


async def wait_job(handle):
    """Waits for the job of ``handle``; raises ``JobFailedError`` if it
    failed. Cancelling the awaiting task leaves the job running."""
    if handle.try_wait():
        return None
    loop = asyncio.get_running_loop()
    if not handle._events_supported():
        await loop.run_in_executor(None, handle.wait)
        return None
    while True:
        d, key, fut = _register(handle, loop)
        try:
            await fut
        except Exception:
            # The file failed: the job's own status, if it has ended,
            # says more than the read's error.
            if handle.try_wait():
                return None
            raise
        finally:
            _forget(d, key, loop)
        # The event comes once the job has ended, so this JOB_WAIT poll
        # finds it done and gives its status; were it pending, a new
        # event is asked for rather than the loop blocked.
        if handle.try_wait():
            return None
