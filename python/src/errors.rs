//! Python exceptions for `tdrv::Error`.
//!
//! Every exception is a subclass of `tdrv.Error`, itself an `OSError`, so
//! `e.errno` is the crate's `Error::raw_os_error()` (the driver's errno,
//! the failed job's, or the natural one of a library check) and
//! `e.strerror` its message with context.

use pyo3::create_exception;
use pyo3::exceptions::PyOSError;
use pyo3::PyErr;
use tdrv::SysError;

create_exception!(
    tdrv,
    Error,
    PyOSError,
    "A tdrv error: an OSError whose errno is the crate's errno for it."
);
create_exception!(
    tdrv,
    BusyError,
    Error,
    "EBUSY: the bytes are lent to a mapping, view or accessor (host), or the buffer is pinned by one (device writes)."
);
create_exception!(
    tdrv,
    TimeoutError,
    Error,
    "ETIMEDOUT: a wait ran out of time."
);
create_exception!(
    tdrv,
    JobFailedError,
    Error,
    "A job ended with an error; errno is the job's (EIO, ETIMEDOUT, ECANCELED, ENODEV)."
);
create_exception!(
    tdrv,
    DeviceWriteFailedError,
    Error,
    "A failed job wrote this buffer: its bytes are undefined until written again; errno is the job's."
);
create_exception!(
    tdrv,
    RangeError,
    Error,
    "ERANGE/EOVERFLOW: a byte range outside the tensor."
);
create_exception!(
    tdrv,
    UnsupportedError,
    Error,
    "EOPNOTSUPP/ENXIO: the operation does not exist for this kind of storage."
);
create_exception!(
    tdrv,
    OutOfMemoryError,
    Error,
    "ENOMEM/ENOSPC: no host memory, or no room on the device channel."
);
create_exception!(
    tdrv,
    CrossChannelError,
    Error,
    "EXDEV: a device copy between two HBM channels."
);
create_exception!(
    tdrv,
    InvalidArgumentError,
    Error,
    "EINVAL: a malformed argument."
);

/// The Python exception for `e`, carrying `(errno, message)`.
pub fn to_py(e: tdrv::Error) -> PyErr {
    let errno = e.raw_os_error().unwrap_or(libc::EIO);
    let args = (errno, e.to_string());
    use tdrv::Error as E;
    match &e {
        E::Busy { .. } | E::SharedView(_) | E::Sys(SysError::Pinned { .. }) => {
            BusyError::new_err(args)
        }
        e if e.is_timeout() => TimeoutError::new_err(args),
        E::JobFailed { .. } => JobFailedError::new_err(args),
        E::DeviceWriteFailed { .. } => DeviceWriteFailedError::new_err(args),
        E::OutOfBounds { .. } | E::Overflow { .. } | E::Sys(SysError::OutOfRange { .. }) => {
            RangeError::new_err(args)
        }
        E::Unsupported { .. } | E::NoStorage { .. } => UnsupportedError::new_err(args),
        E::OutOfMemory(_)
        | E::DeviceAlloc { .. }
        | E::Sys(SysError::NoMemory { .. } | SysError::NoSpace { .. }) => {
            OutOfMemoryError::new_err(args)
        }
        E::CrossChannel { .. } | E::Sys(SysError::CrossChannel { .. }) => {
            CrossChannelError::new_err(args)
        }
        E::InvalidArgument(_) | E::Sys(SysError::InvalidArgument { .. }) => {
            InvalidArgumentError::new_err(args)
        }
        _ => Error::new_err(args),
    }
}

/// `to_py` for the `sys` layer's errors.
pub fn sys_to_py(e: SysError) -> PyErr {
    to_py(e.into())
}

/// Every exception class, for the module.
pub fn register(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
    use pyo3::prelude::*;
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("BusyError", py.get_type::<BusyError>())?;
    m.add("TimeoutError", py.get_type::<TimeoutError>())?;
    m.add("JobFailedError", py.get_type::<JobFailedError>())?;
    m.add(
        "DeviceWriteFailedError",
        py.get_type::<DeviceWriteFailedError>(),
    )?;
    m.add("RangeError", py.get_type::<RangeError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add("OutOfMemoryError", py.get_type::<OutOfMemoryError>())?;
    m.add("CrossChannelError", py.get_type::<CrossChannelError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    Ok(())
}
