// SPDX-License-Identifier: MIT OR Apache-2.0
//! Python exceptions for `tdrv::Error`.
//!
//! Every exception is a subclass of `tdrv.Error`, itself an `OSError`, so
//! `e.errno` is the crate's `Error::raw_os_error()` (the driver's errno,
//! the failed job's, or the natural one of a library check) and
//! `e.strerror` its message with context.
//!
//! Each one is also a subclass of the builtin a Python caller catches for
//! that kind of failure, as numpy and the standard library raise them:
//! `tdrv.TimeoutError` is a `TimeoutError`, `tdrv.OutOfMemoryError` a
//! `MemoryError`, `tdrv.InvalidArgumentError` a `ValueError`, a device the
//! caller may not open a `PermissionError`, and so on (the table in
//! `CLASSES`). `create_exception!` takes one base only, so these classes
//! are made at module initialisation with `type(name, (tdrv.Error,
//! builtin), ...)`: both bases are `OSError`-compatible in layout.

use std::sync::OnceLock;

use pyo3::create_exception;
use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple, PyType};
use pyo3::PyErr;
use tdrv::SysError;

create_exception!(
    tdrv,
    Error,
    PyOSError,
    "A tdrv error: an OSError whose errno is the crate's errno for it."
);

/// The subclasses of `tdrv.Error`, in `CLASSES` order.
#[derive(Clone, Copy)]
enum Kind {
    Busy,
    Timeout,
    JobFailed,
    DeviceWriteFailed,
    Range,
    Unsupported,
    OutOfMemory,
    CrossChannel,
    InvalidArgument,
    Permission,
    NotFound,
    Interrupted,
}

/// A builtin base class: (module, attribute).
type Builtin = (&'static str, &'static str);

/// Name, builtin base (`None`: `tdrv.Error` only) and docstring of every
/// subclass, indexed by `Kind`.
const CLASSES: &[(&str, Option<Builtin>, &str)] = &[
    (
        "BusyError",
        None,
        "EBUSY: the bytes are lent to a mapping, view or accessor (host), or the buffer is pinned by one (device writes).",
    ),
    (
        "TimeoutError",
        Some(("builtins", "TimeoutError")),
        "ETIMEDOUT: a wait ran out of time. Also a builtin TimeoutError.",
    ),
    (
        "JobFailedError",
        None,
        "A job ended with an error; errno is the job's (EIO, ETIMEDOUT, ECANCELED, ENODEV).",
    ),
    (
        "DeviceWriteFailedError",
        None,
        "A failed job wrote this buffer: its bytes are undefined until written again; errno is the job's.",
    ),
    (
        "RangeError",
        Some(("builtins", "ValueError")),
        "ERANGE/EOVERFLOW: a byte range outside the tensor. Also a ValueError.",
    ),
    (
        "UnsupportedError",
        Some(("io", "UnsupportedOperation")),
        "EOPNOTSUPP/ENXIO: the operation does not exist for this kind of storage. Also an io.UnsupportedOperation (a ValueError).",
    ),
    (
        "OutOfMemoryError",
        Some(("builtins", "MemoryError")),
        "ENOMEM/ENOSPC: no host memory, or no room on the device channel. Also a MemoryError.",
    ),
    (
        "CrossChannelError",
        Some(("builtins", "ValueError")),
        "EXDEV: a device copy between two HBM channels. Also a ValueError.",
    ),
    (
        "InvalidArgumentError",
        Some(("builtins", "ValueError")),
        "EINVAL: a malformed argument. Also a ValueError.",
    ),
    (
        "PermissionError",
        Some(("builtins", "PermissionError")),
        "EACCES/EPERM: the device node or operation is not allowed to this user (for a device node: join its group, tdrv). Also a builtin PermissionError.",
    ),
    (
        "DeviceNotFoundError",
        Some(("builtins", "FileNotFoundError")),
        "ENOENT/ENODEV/ENXIO at open: no such device node (is the module loaded?). Also a FileNotFoundError.",
    ),
    (
        "InterruptedError",
        Some(("builtins", "InterruptedError")),
        "EINTR: a call was interrupted by a signal whose handler did not raise. Also a builtin InterruptedError.",
    ),
];

static TYPES: OnceLock<Vec<Py<PyType>>> = OnceLock::new();

/// The class of `kind`, `tdrv.Error` until the module made them.
fn class(py: Python<'_>, kind: Kind) -> Bound<'_, PyType> {
    match TYPES.get() {
        Some(t) => t[kind as usize].bind(py).clone(),
        None => py.get_type::<Error>(),
    }
}

/// The subclass for `e`, if any.
fn kind_of(e: &tdrv::Error) -> Option<Kind> {
    use tdrv::Error as E;
    Some(match e {
        E::Busy { .. }
        | E::SharedView(_)
        | E::Sys(SysError::Pinned { .. } | SysError::EventsBusy { .. }) => Kind::Busy,
        e if e.is_timeout() => Kind::Timeout,
        E::JobFailed { .. } => Kind::JobFailed,
        E::DeviceWriteFailed { .. } => Kind::DeviceWriteFailed,
        E::OutOfBounds { .. } | E::Overflow { .. } | E::Sys(SysError::OutOfRange { .. }) => {
            Kind::Range
        }
        E::Unsupported { .. } | E::NoStorage { .. } => Kind::Unsupported,
        E::OutOfMemory(_)
        | E::DeviceAlloc { .. }
        | E::Sys(SysError::NoMemory { .. } | SysError::NoSpace { .. }) => Kind::OutOfMemory,
        E::CrossChannel { .. } | E::Sys(SysError::CrossChannel { .. }) => Kind::CrossChannel,
        E::InvalidArgument(_) | E::Sys(SysError::InvalidArgument { .. }) => Kind::InvalidArgument,
        E::Sys(SysError::Open { .. }) => match e.raw_os_error() {
            Some(libc::EACCES | libc::EPERM) => Kind::Permission,
            Some(libc::ENOENT | libc::ENODEV | libc::ENXIO) => Kind::NotFound,
            _ => return None,
        },
        _ => match e.raw_os_error() {
            Some(libc::EACCES | libc::EPERM) => Kind::Permission,
            Some(libc::EINTR) => Kind::Interrupted,
            // The driver refuses the operation for this memory or device
            // (e.g. sharing a sim device's HBM).
            Some(libc::EOPNOTSUPP) => Kind::Unsupported,
            _ => return None,
        },
    })
}

/// The Python exception for `e`, carrying `(errno, message)`.
pub fn to_py(e: tdrv::Error) -> PyErr {
    let errno = e.raw_os_error().unwrap_or(libc::EIO);
    let args = (errno, e.to_string());
    match kind_of(&e) {
        Some(kind) => Python::attach(|py| PyErr::from_type(class(py, kind), args)),
        None => Error::new_err(args),
    }
}

/// `tdrv.Error` and every subclass, for the module.
pub fn register(m: &Bound<'_, pyo3::types::PyModule>) -> PyResult<()> {
    let py = m.py();
    let base = py.get_type::<Error>();
    m.add("Error", &base)?;
    // A second initialisation (a subinterpreter) shares the first classes,
    // which `to_py` raises.
    if let Some(types) = TYPES.get() {
        for ((name, _, _), cls) in CLASSES.iter().zip(types) {
            m.add(*name, cls.bind(py))?;
        }
        return Ok(());
    }
    let type_fn = py.import("builtins")?.getattr("type")?;
    let mut made = Vec::with_capacity(CLASSES.len());
    for (name, builtin, doc) in CLASSES {
        let bases = match builtin {
            Some((module, attr)) => PyTuple::new(
                py,
                [base.clone().into_any(), py.import(*module)?.getattr(*attr)?],
            )?,
            None => PyTuple::new(py, [base.clone().into_any()])?,
        };
        let dict = PyDict::new(py);
        dict.set_item("__doc__", *doc)?;
        dict.set_item("__module__", "tdrv")?;
        let cls = type_fn.call1((*name, bases, dict))?.cast_into::<PyType>()?;
        m.add(*name, &cls)?;
        made.push(cls.unbind());
    }
    let _ = TYPES.set(made);
    Ok(())
}
