"""The type stubs (python/tdrv.pyi, shipped with py.typed) checked by mypy:
code using the module as documented type-checks cleanly, misuse is
reported where it is, and mypy's stubtest finds the stubs true to the
module at run time."""

import os
import subprocess
import sys
import textwrap

import pytest

STUB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

GOOD = """
import numpy as np
import tdrv

def use(path: str) -> float:
    dev = tdrv.Device(path)
    t: tdrv.Tensor = dev.empty((2, 3), "float32", channel=0, name="x")
    u = tdrv.from_buffer(np.zeros(6, np.float32), device=dev)
    h: tdrv.JobHandle = tdrv.Job().copy(u, t).submit()
    h.wait(timeout=1.5)
    async def later() -> None:
        await tdrv.Job().copy(u, t).submit()
    t.check_output_completion(1, timeout=None)
    with t.map_read() as m:
        assert m.nbytes == t.nbytes
    shape: tuple[int, ...] = t.shape
    # The buffer protocol (PEP 688's __buffer__ in the stubs).
    view = memoryview(t)
    with t.map_write() as w:
        memoryview(w)[0:4] = bytes(4)
    view.release()
    data: bytes = t.read(0, 4)
    try:
        t.write(data, 2)
    except tdrv.TimeoutError as e:
        assert isinstance(e, TimeoutError) and e.errno is not None
    except MemoryError:
        pass
    names: list[str] = tdrv.devices() + tdrv.DTYPES
    return float(len(shape) + len(names) + t.output_completion_count())
"""

BAD = """
import tdrv

t = tdrv.empty(4)
t.read("zero")
n: str = t.nbytes
tdrv.Job().copy(t, t, size="all")
"""


def _mypy(code, tmp_path):
    pytest.importorskip("mypy", reason="no mypy here: the host venv has it (scripts/setup)")
    src = tmp_path / "use_tdrv.py"
    src.write_text(textwrap.dedent(code))
    env = dict(os.environ, MYPYPATH=STUB_DIR)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
         "--cache-dir", str(tmp_path / ".mypy_cache"), str(src)],
        capture_output=True, text=True, env=env, timeout=600,
    )


def test_documented_use_type_checks(tmp_path):
    out = _mypy(GOOD, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_misuse_is_reported_line_by_line(tmp_path):
    out = _mypy(BAD, tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = {int(l.split(":")[1]) for l in out.stdout.splitlines() if ": error:" in l}
    # read("zero"), a str annotation of an int, copy(size="all").
    assert lines == {5, 6, 7}, out.stdout


def test_stubs_match_the_module_at_run_time(tmp_path):
    pytest.importorskip("mypy", reason="no mypy here: the host venv has it (scripts/setup)")
    pytest.importorskip("tdrv", reason="the module is not installed here")
    # Known differences, each needed: maturin's package re-exports its
    # compiled module (tdrv.tdrv), whose names stubtest checks as tdrv.*;
    # CPython defines PEP 688's __buffer__ at run time from 3.12 only,
    # while type checkers need it in the stubs on every version.
    allow = ["tdrv.tdrv"]
    if sys.version_info < (3, 12):
        allow += [
            f"tdrv.{cls}.{name}"
            for cls in ("Tensor", "Mapping")
            for name in ("__buffer__", "__release_buffer__")
        ]
    allowlist = tmp_path / "allowlist"
    allowlist.write_text("\n".join(allow) + "\n")
    env = dict(os.environ, MYPYPATH=STUB_DIR)
    out = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "tdrv", "--allowlist", str(allowlist)],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
