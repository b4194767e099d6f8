# SPDX-License-Identifier: MIT OR Apache-2.0
"""asyncio glue of the tdrv module: ``await job_handle``.

Compiled into the extension (lib.rs, ``aio()``). A job's completion
event (``TDRV_IOC_JOB_NOTIFY``) arrives on its device file, which the
event loop watches with ``add_reader``: one reader per device file and
loop, however many jobs are awaited, and no thread. Kernels of every
kind deliver events; only a driver older than ABI 1.4 makes a wait fall
back to the loop's default executor.
"""

import asyncio

# (id(loop), fd) -> _Dispatcher, while it has waiters.
_dispatchers = {}


class _Dispatcher:
    """Reads one device file's completion events for one event loop."""

    def __init__(self, loop, handle):
        self.loop = loop
        self.fd = handle._fileno()
        # Any handle of the device reads the file's events; holding one
        # keeps the file open while the loop watches it.
        self.reader = handle
        self.waiting = {}
        self.next_key = 1
        loop.add_reader(self.fd, self._readable)

    def wait(self, handle):
        key = self.next_key
        self.next_key += 1
        fut = self.loop.create_future()
        self.waiting[key] = fut
        try:
            handle._notify(key)
        except BaseException:
            self.forget(key)
            raise
        return key, fut

    def forget(self, key):
        self.waiting.pop(key, None)
        if not self.waiting:
            self.loop.remove_reader(self.fd)
            _dispatchers.pop((id(self.loop), self.fd), None)

    def _readable(self):
        try:
            events = self.reader._read_events()
        except Exception:
            # The device is gone (ENODEV): every waiter asks JOB_WAIT,
            # which tells it why.
            events = [(0, key, 0) for key in list(self.waiting)]
        for _job_id, key, _errno in events:
            fut = self.waiting.get(key)
            if fut is not None and not fut.done():
                fut.set_result(None)


async def wait_job(handle):
    """Waits for the job of ``handle``; raises ``JobFailedError`` if it
    failed. Cancelling the awaiting task leaves the job running."""
    if handle.try_wait():
        return None
    loop = asyncio.get_running_loop()
    if not handle._events_supported():
        await loop.run_in_executor(None, handle.wait)
        return None
    k = (id(loop), handle._fileno())
    d = _dispatchers.get(k)
    if d is None:
        d = _dispatchers[k] = _Dispatcher(loop, handle)
    key, fut = d.wait(handle)
    try:
        await fut
    finally:
        d.forget(key)
    # The event comes once the job has ended: this does not block.
    handle.wait(timeout=60)
    return None
