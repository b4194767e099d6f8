"""asyncio's event loop wakes itself through socket.socketpair(), which
needs AF_UNIX. The test and bench kernels have no networking (no
CONFIG_NET): there a pipe stands in for the pair. Used by the pytest suite
and by tests/bench/aio.py (which the bench ships next to this file)."""

import os
import socket


class PipeEnd:
    """One end of a pipe with the socket methods asyncio's self-pipe uses."""

    def __init__(self, fd):
        self._fd = fd

    def fileno(self):
        return self._fd

    def setblocking(self, flag):
        os.set_blocking(self._fd, flag)

    def recv(self, n):
        return os.read(self._fd, n)

    def send(self, data):
        return os.write(self._fd, data)

    def close(self):
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def pipe_pair(*_args, **_kwargs):
    """A stand-in for socket.socketpair(): the two ends of a pipe."""
    r, w = os.pipe()
    return PipeEnd(r), PipeEnd(w)


def socketpair_works():
    """Whether this kernel can make an AF_UNIX socket pair."""
    try:
        a, b = socket.socketpair()
    except OSError:
        return False
    a.close()
    b.close()
    return True
