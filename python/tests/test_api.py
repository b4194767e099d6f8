"""Host tests of the Python conventions of the tdrv module: exceptions that
are also the builtins a Python caller catches, and blocking calls that
Ctrl-C (SIGINT) interrupts without losing anything."""

import errno
import io
import signal
import threading

import numpy as np
import pytest

import tdrv


def test_exceptions_subclass_the_builtins():
    pairs = [
        (tdrv.TimeoutError, TimeoutError),
        (tdrv.OutOfMemoryError, MemoryError),
        (tdrv.InvalidArgumentError, ValueError),
        (tdrv.RangeError, ValueError),
        (tdrv.CrossChannelError, ValueError),
        (tdrv.UnsupportedError, io.UnsupportedOperation),
        (tdrv.PermissionError, PermissionError),
        (tdrv.DeviceNotFoundError, FileNotFoundError),
        (tdrv.InterruptedError, InterruptedError),
    ]
    for cls, builtin in pairs:
        assert issubclass(cls, tdrv.Error) and issubclass(cls, builtin), cls
        assert cls.__module__ == "tdrv" and cls.__doc__
    for cls in (tdrv.BusyError, tdrv.JobFailedError, tdrv.DeviceWriteFailedError):
        assert issubclass(cls, tdrv.Error) and issubclass(cls, OSError)


def test_raised_errors_are_caught_as_builtins_with_their_errno():
    t = tdrv.empty(8)
    with pytest.raises(ValueError) as e:
        t.write(b"123", 6)
    assert isinstance(e.value, tdrv.RangeError) and e.value.errno in (errno.ERANGE, errno.EOVERFLOW)
    with pytest.raises(MemoryError) as e:
        tdrv.empty(1 << 62)
    assert isinstance(e.value, tdrv.OutOfMemoryError) and e.value.errno == errno.ENOMEM
    with pytest.raises(FileNotFoundError) as e:
        tdrv.Device("/nonexistent/tdrv0")
    assert isinstance(e.value, tdrv.DeviceNotFoundError) and e.value.errno == errno.ENOENT
    with pytest.raises(TimeoutError) as e:
        t.check_output_completion(1, timeout=0.01)
    assert isinstance(e.value, tdrv.TimeoutError) and e.value.errno == errno.ETIMEDOUT


def test_ctrl_c_interrupts_a_blocking_wait_and_loses_nothing():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT does not raise KeyboardInterrupt in this process")
    t = tdrv.from_buffer(np.arange(4, dtype=np.int32))
    main = threading.main_thread().ident
    started, done = threading.Event(), threading.Event()

    def ctrl_c():
        # Ctrl-C once the main thread is (very likely) inside the wait,
        # then again until it saw one: a SIGINT is never lost.
        started.wait()
        while not done.wait(0.2):
            signal.pthread_kill(main, signal.SIGINT)

    sender = threading.Thread(target=ctrl_c)
    sender.start()
    try:
        # Nothing ever completes this host tensor: without Ctrl-C the wait
        # ends only at its 60 s bound, with TimeoutError (a failure here).
        with pytest.raises(KeyboardInterrupt):
            started.set()
            t.check_output_completion(1, timeout=60)
    finally:
        done.set()
        sender.join()
    # Nothing was lost: the tensor, its count and its bytes are intact.
    assert t.output_completion_count() == 0
    t.check_output_completion(0, timeout=0)
    assert np.frombuffer(t.read(), np.int32).tolist() == [0, 1, 2, 3]


def test_from_buffer_copies_once():
    # The peak resident memory of a fresh interpreter grows by the new
    # tensor alone (one copy), not by a staging copy as well.
    import subprocess
    import sys

    code = """
import resource, numpy as np, tdrv
n = 128 << 20
a = np.ones(n, np.uint8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = tdrv.from_buffer(a)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert t.nbytes == n and t.read(n - 4) == b"\\x01" * 4
print((after - before) * 1024 / n)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grown = float(out.stdout)
    # One copy grows the peak by at most the tensor's size (less when
    # memory freed earlier is reused); a staging copy would add as much
    # again (about 2.0).
    assert grown < 1.5, grown
