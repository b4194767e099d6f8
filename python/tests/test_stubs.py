"""The type stubs (python/tdrv.pyi, shipped with py.typed) checked by mypy:
code using the module as documented type-checks cleanly, and misuse is
reported where it is."""

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
