"""pytest plugin (`-p tdrv_tap`): one TAP line per test ("ok N name",
"not ok N name", "ok N name # SKIP"), as the guest's kselftest programs
print them, so that scripts/test counts the guest's pytest run the same
way. Not a test module (pytest collects only test_*.py)."""

import sys

_count = 0


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
    if report.skipped:
        line = f"ok {_count} {name} # SKIP"
    elif report.passed:
        line = f"ok {_count} {name}"
    else:
        line = f"not ok {_count} {name}"
    # On a line of its own: the progress dots precede it.
    sys.__stdout__.write("\n" + line + "\n")
    sys.__stdout__.flush()
