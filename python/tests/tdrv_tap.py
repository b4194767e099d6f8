"""pytest plugin (`-p tdrv_tap`): one TAP line per test ("ok N name # time=12ms",
"not ok N name # time=12ms", "ok N name # SKIP reason"), as the guest's
kselftest programs print them (tests/guest/src/lib.rs), so that scripts/test
counts the guest's pytest run the same way and lists its slowest tests. The
time is that of the phase reported: the test's call, or the setup that
failed it. Not a test module (pytest collects only test_*.py)."""

import sys

_count = 0


def _skip_reason(report):
    # A skip's longrepr is (file, line, "Skipped: reason").
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
        if reason.startswith("Skipped: "):
            reason = reason[len("Skipped: "):]
        return " ".join(reason.split())
    return ""


def pytest_runtest_logreport(report):
    global _count
    # One line per test: its call, or the setup or teardown that failed
    # or skipped it.
    if report.when != "call" and not (report.failed or report.skipped):
        return
    if report.when == "teardown" and report.skipped:
        return
    _count += 1
    name = report.nodeid.split("::", 1)[-1]
    ms = round(report.duration * 1000)
    if report.skipped:
        reason = _skip_reason(report)
        line = f"ok {_count} {name} # SKIP{' ' + reason if reason else ''}"
    elif report.passed:
        line = f"ok {_count} {name} # time={ms}ms"
    else:
        line = f"not ok {_count} {name} # time={ms}ms"
    # On a line of its own: the progress dots precede it.
    sys.__stdout__.write("\n" + line + "\n")
    sys.__stdout__.flush()
