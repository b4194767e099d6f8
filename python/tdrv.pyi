# SPDX-License-Identifier: MIT OR Apache-2.0
"""Type information of the `tdrv` extension module (PEP 561): devices,
host and device tensors, mappings, copy jobs, numpy views and DLPack.

Every blocking call (waits, reads and writes that wait for device jobs)
can be interrupted with Ctrl-C: it raises KeyboardInterrupt and changes
nothing. Every exception is a `tdrv.Error` (an `OSError` with the errno)
and also the builtin a caller catches for its kind."""

import builtins
import io
from collections.abc import Generator, Sequence
from types import TracebackType
from typing import Any, Final, Literal, Optional, Union, final

__all__ = [
    "__version__",
    "DTYPES",
    "Device",
    "Tensor",
    "Mapping",
    "Job",
    "JobHandle",
    "empty",
    "from_buffer",
    "from_dlpack",
    "devices",
    "Error",
    "BusyError",
    "TimeoutError",
    "JobFailedError",
    "DeviceWriteFailedError",
    "RangeError",
    "UnsupportedError",
    "OutOfMemoryError",
    "CrossChannelError",
    "InvalidArgumentError",
    "PermissionError",
    "DeviceNotFoundError",
    "InterruptedError",
]

__version__: Final[str]
DTYPES: Final[list[str]]

# A dtype: a name of DTYPES, or anything numpy.dtype() accepts for one.
_DTypeLike = Any
_Shape = Union[int, Sequence[int]]
_DeviceLike = Union["Device", str]

class Error(builtins.OSError):
    """A tdrv error: an OSError whose errno is the crate's errno for it."""

class BusyError(Error): ...
class TimeoutError(Error, builtins.TimeoutError): ...
class JobFailedError(Error): ...
class DeviceWriteFailedError(Error): ...
class RangeError(Error, builtins.ValueError): ...
class UnsupportedError(Error, io.UnsupportedOperation): ...
class OutOfMemoryError(Error, builtins.MemoryError): ...
class CrossChannelError(Error, builtins.ValueError): ...
class InvalidArgumentError(Error, builtins.ValueError): ...
class PermissionError(Error, builtins.PermissionError): ...
class DeviceNotFoundError(Error, builtins.FileNotFoundError): ...
class InterruptedError(Error, builtins.InterruptedError): ...

@final
class Device:
    """An open tdrv device node."""

    def __new__(cls, path: str = "/dev/tdrv0") -> Device: ...
    @property
    def path(self) -> str: ...
    @property
    def kind(self) -> str:
        """"soft", "edu", "sim" or "unknown(N)"."""
    @property
    def abi(self) -> tuple[int, int]: ...
    @property
    def num_channels(self) -> int: ...
    @property
    def max_buffer_size(self) -> int: ...
    def fileno(self) -> int: ...
    def empty(
        self,
        shape: _Shape,
        dtype: Optional[_DTypeLike] = None,
        *,
        channel: int = 0,
        name: Optional[str] = None,
    ) -> Tensor: ...

@final
class Tensor:
    """A view of host or device memory with a dtype and a C-contiguous
    shape."""

    @property
    def nbytes(self) -> int: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def ndim(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def itemsize(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> Optional[str]:
        """The storage kind: "malloc", "dma", "user", ... (None: no storage)."""
    @property
    def offset(self) -> int: ...
    @property
    def channel(self) -> Optional[int]: ...
    @property
    def device(self) -> Optional[Device]: ...
    @property
    def address(self) -> Optional[int]: ...
    def shares_storage_with(self, other: Tensor) -> bool: ...
    def view(
        self, dtype: Optional[_DTypeLike] = None, shape: Optional[_Shape] = None
    ) -> Tensor: ...
    def byte_slice(
        self,
        start: Optional[int] = None,
        stop: Optional[int] = None,
        *,
        name: Optional[str] = None,
    ) -> Tensor: ...
    def __getitem__(self, key: Union[int, slice], /) -> Tensor: ...
    def __len__(self) -> int: ...
    def read(self, offset: int = 0, size: Optional[int] = None) -> bytes: ...
    def to_bytes(self) -> bytes: ...
    def write(self, data: Any, offset: int = 0) -> None: ...
    def memset(self, value: int, offset: int = 0, size: Optional[int] = None) -> None: ...
    def to(
        self,
        device: Optional[_DeviceLike],
        *,
        channel: int = 0,
        copy: Optional[bool] = None,
    ) -> Tensor:
        """This tensor on `device` (None: host memory): the same bytes where
        the memory can be shared, else a copy; `copy` as numpy's."""
    def copy_from(
        self,
        src: Tensor,
        *,
        src_offset: int = 0,
        dst_offset: int = 0,
        size: Optional[int] = None,
    ) -> None: ...
    def wait_idle(self, *, write: bool = False, timeout: Optional[float] = None) -> None: ...
    def check_output_completion(self, expected: int, *, timeout: Optional[float] = None) -> None: ...
    def output_completion_count(self) -> int: ...
    def map_read(self) -> Mapping: ...
    def map_write(self) -> Mapping: ...
    def numpy(self, *, writable: bool = False) -> Any: ...
    def __array__(self, dtype: Optional[_DTypeLike] = None, copy: Optional[bool] = None) -> Any: ...
    def __dlpack__(
        self,
        *,
        stream: Optional[Any] = None,
        max_version: Optional[tuple[int, int]] = None,
        dl_device: Optional[tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    # PEP 688. CPython defines them at run time from 3.12; type checkers
    # use them to accept the object as a buffer (memoryview, numpy, bytes)
    # on every version.
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

@final
class Mapping:
    """Bytes of a tensor lent without a copy (map_read / map_write)."""

    @property
    def writable(self) -> bool: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def release(self) -> None: ...
    def __enter__(self) -> Mapping: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> Literal[False]: ...
    def __dlpack__(
        self,
        *,
        stream: Optional[Any] = None,
        max_version: Optional[tuple[int, int]] = None,
        dl_device: Optional[tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    # PEP 688. CPython defines them at run time from 3.12; type checkers
    # use them to accept the object as a buffer (memoryview, numpy, bytes)
    # on every version.
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

@final
class Job:
    """A list of device copies, submitted together."""

    def __init__(self) -> None: ...
    def copy(
        self,
        src: Tensor,
        dst: Tensor,
        *,
        src_offset: int = 0,
        dst_offset: int = 0,
        size: Optional[int] = None,
    ) -> Job: ...
    def __len__(self) -> int: ...
    def submit(self) -> JobHandle: ...

@final
class JobHandle:
    """A submitted job."""

    @property
    def id(self) -> int: ...
    def wait(self, timeout: Optional[float] = None) -> None: ...
    def try_wait(self) -> bool: ...
    def __await__(self) -> Generator[Any, None, None]: ...

def empty(
    shape: _Shape,
    dtype: Optional[_DTypeLike] = None,
    *,
    device: Optional[_DeviceLike] = None,
    channel: int = 0,
    name: Optional[str] = None,
) -> Tensor: ...
def from_buffer(
    obj: Any,
    *,
    device: Optional[_DeviceLike] = None,
    channel: int = 0,
    name: Optional[str] = None,
) -> Tensor: ...
def from_dlpack(obj: Any, *, copy: Optional[bool] = None, name: Optional[str] = None) -> Tensor: ...
def devices() -> list[str]: ...
