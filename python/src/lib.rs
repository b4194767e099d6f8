//! The `tdrv` Python module (PyO3; built and installed by maturin, see the
//! project README's "Python" section): devices, host and device tensors,
//! jobs, zero-copy numpy views through the buffer protocol, and DLPack.
//!
//! A Python `Tensor` is a handle of a crate `Tensor` view plus a dtype and
//! a C-contiguous shape (the crate's tensors are bytes). Every byte a
//! Python consumer sees without a copy is lent by a mapping guard
//! (`guard.rs`), so the crate's coherency and fence rules hold for Python
//! views exactly as for Rust ones.

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

mod buffer;
mod dlpack;
mod dtype;
mod errors;
mod guard;

use std::ffi::c_int;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyBufferError, PyIndexError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PySlice, PyTuple};
use tdrv::ops::TensorOps;

use crate::dtype::DType;
use crate::errors::to_py;
use crate::guard::Guard;

type TResult<T> = tdrv::Result<T>;

fn duration(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    timeout
        .map(|s| {
            Duration::try_from_secs_f64(s).map_err(|_| {
                PyValueError::new_err(format!(
                    "timeout must be a finite number of seconds >= 0, not {s}"
                ))
            })
        })
        .transpose()
}

/// How long a blocking call waits with the GIL released before it lets
/// Python's signal handlers run (so Ctrl-C's KeyboardInterrupt arrives
/// within about this long).
const SIGNAL_SLICE: Duration = Duration::from_millis(20);

/// Runs a wait of at most `timeout` (None: without limit) in slices of
/// `SIGNAL_SLICE`, the GIL released during each, and runs Python's signal
/// handlers between them: a handler that raises (SIGINT's
/// KeyboardInterrupt) ends the wait with its exception and loses nothing,
/// since a wait changes no state. `wait(slice)` waits at most `slice` and
/// answers a time-out (`Error::is_timeout`) when the event did not come.
fn wait_interruptibly(
    py: Python<'_>,
    timeout: Option<Duration>,
    wait: impl Fn(Duration) -> TResult<()> + Sync,
) -> PyResult<()> {
    let start = Instant::now();
    let deadline = timeout.and_then(|t| start.checked_add(t));
    loop {
        let slice = match deadline {
            Some(d) => d
                .saturating_duration_since(Instant::now())
                .min(SIGNAL_SLICE),
            None => SIGNAL_SLICE,
        };
        match py.detach(|| wait(slice)) {
            Ok(()) => return Ok(()),
            Err(mut e) if e.is_timeout() => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    // Report the whole wait, not its last slice.
                    if let tdrv::Error::Timeout { waited, .. } = &mut e {
                        *waited = start.elapsed();
                    }
                    return Err(to_py(e));
                }
            }
            Err(e) => return Err(to_py(e)),
        }
        py.check_signals()?;
    }
}

/// Waits until the device work in flight on `t` that host `access` would
/// wait for has ended, in slices where Ctrl-C ends it (see
/// `wait_interruptibly`). Only that: any other outcome (idle, a failed
/// job's latch, a tensor without storage) is left to the operation that
/// follows, which reports it as its own. A job submitted between this and
/// the operation is waited for by the operation, as by any call.
fn idle_before(py: Python<'_>, t: &tdrv::Tensor, access: tdrv::Access) -> PyResult<()> {
    loop {
        match py.detach(|| t.wait_device_idle(access, Some(SIGNAL_SLICE))) {
            Err(e) if e.is_timeout() => py.check_signals()?,
            _ => return Ok(()),
        }
    }
}

/// A wait before a read or write that only makes the wait interruptible:
/// a failed job's latch ends it like idleness does, and the read (which
/// reports the latch) or the write (which clears it) decides.
fn idle_or_latched(r: TResult<()>) -> TResult<()> {
    match r {
        Err(tdrv::Error::DeviceWriteFailed { .. }) => Ok(()),
        r => r,
    }
}

/// A shape argument: an int or a sequence of ints.
fn parse_shape(obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    if let Ok(n) = obj.extract::<usize>() {
        return Ok(vec![n]);
    }
    obj.extract::<Vec<usize>>()
        .map_err(|_| PyTypeError::new_err("shape must be a non-negative int or a sequence of them"))
}

fn nbytes_of(dtype: &DType, shape: &[usize]) -> PyResult<usize> {
    shape
        .iter()
        .try_fold(dtype.size, |n, &d| n.checked_mul(d))
        .ok_or_else(|| PyValueError::new_err("tensor size overflows"))
}

/// Runs `f` on the bytes of a C-contiguous buffer of `obj` (address and
/// length), its dtype and its shape (bytes when the format is unknown to
/// tdrv), while the buffer is held. `f` must only copy from the address:
/// Python code that shares the buffer may change it after `f` returns.
fn with_buffer<R>(
    obj: &Bound<'_, PyAny>,
    f: impl FnOnce(*const u8, usize, &'static DType, Vec<usize>) -> PyResult<R>,
) -> PyResult<R> {
    let mut view = std::mem::MaybeUninit::<ffi::Py_buffer>::zeroed();
    // SAFETY: `obj` is live and `view` is writable storage for a Py_buffer.
    let rc = unsafe {
        ffi::PyObject_GetBuffer(
            obj.as_ptr(),
            view.as_mut_ptr(),
            ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_FORMAT,
        )
    };
    if rc != 0 {
        return Err(PyErr::fetch(obj.py()));
    }
    // SAFETY: GetBuffer succeeded: the view is initialised.
    let mut view = unsafe { view.assume_init() };
    let result = {
        let len = usize::try_from(view.len).unwrap_or(0);
        let itemsize = usize::try_from(view.itemsize).unwrap_or(1);
        let format = if view.format.is_null() {
            "B".to_owned()
        } else {
            // SAFETY: a non-NULL format is a NUL-terminated string owned
            // by the exporter while the view is held.
            unsafe { std::ffi::CStr::from_ptr(view.format) }
                .to_string_lossy()
                .into_owned()
        };
        let ndim = usize::try_from(view.ndim).unwrap_or(0);
        let shape: Vec<usize> = if view.shape.is_null() || ndim == 0 {
            vec![len / itemsize.max(1)]
        } else {
            // SAFETY: PyBUF_ND: `shape` has `ndim` entries.
            unsafe { std::slice::from_raw_parts(view.shape, ndim) }
                .iter()
                .map(|&d| d as usize)
                .collect()
        };
        let (dtype, shape) = match dtype::from_format(&format, itemsize) {
            Some(d) => (d, shape),
            None => (dtype::uint8(), vec![len]),
        };
        f(view.buf.cast::<u8>().cast_const(), len, dtype, shape)
    };
    // SAFETY: the view GetBuffer filled, released once.
    unsafe { ffi::PyBuffer_Release(&mut view) };
    result
}

/// Copies a C-contiguous buffer of `obj` into a new vector, with its dtype
/// and shape (bytes when the format is unknown to tdrv).
fn buffer_bytes(obj: &Bound<'_, PyAny>) -> PyResult<(Vec<u8>, &'static DType, Vec<usize>)> {
    with_buffer(obj, |buf, len, dtype, shape| {
        let mut bytes = Vec::new();
        bytes
            .try_reserve_exact(len)
            .map_err(|_| to_py(tdrv::Error::OutOfMemory(len)))?;
        // SAFETY: the exporter's buffer is `len` readable contiguous bytes
        // while the view is held (`with_buffer`); copied by address (no
        // Rust reference to memory Python code may share) into the
        // vector's spare room.
        unsafe {
            std::ptr::copy_nonoverlapping(buf, bytes.as_mut_ptr(), len);
            bytes.set_len(len);
        }
        Ok((bytes, dtype, shape))
    })
}

/// An open tdrv device node.
#[pyclass(module = "tdrv", name = "Device", frozen)]
struct PyDevice {
    dev: Arc<tdrv::Device>,
}

#[pymethods]
impl PyDevice {
    /// Opens a device node (`/dev/tdrv0` by default). Errors: `tdrv.Error`
    /// with the errno of the open or of the version check (ENOTTY: not a
    /// tdrv node).
    #[new]
    #[pyo3(signature = (path = "/dev/tdrv0"))]
    fn new(py: Python<'_>, path: &str) -> PyResult<Self> {
        let dev = py.detach(|| tdrv::Device::open(path)).map_err(to_py)?;
        Ok(PyDevice { dev })
    }

    /// The device node's path.
    #[getter]
    fn path(&self) -> String {
        self.dev.path().display().to_string()
    }

    /// `"soft"`, `"edu"`, `"sim"` or `"unknown(N)"`.
    #[getter]
    fn kind(&self) -> String {
        match self.dev.kind() {
            tdrv::DeviceKind::Soft => "soft".into(),
            tdrv::DeviceKind::Edu => "edu".into(),
            tdrv::DeviceKind::Sim => "sim".into(),
            tdrv::DeviceKind::Unknown(n) => format!("unknown({n})"),
        }
    }

    /// The driver's ABI version `(major, minor)`.
    #[getter]
    fn abi(&self) -> (u32, u32) {
        let v = self.dev.info();
        (v.abi_major, v.abi_minor)
    }

    /// Number of HBM channels.
    #[getter]
    fn num_channels(&self) -> u32 {
        self.dev.num_channels()
    }

    /// Largest buffer the driver allocates, in bytes.
    #[getter]
    fn max_buffer_size(&self) -> u64 {
        self.dev.max_buffer_size()
    }

    /// The open file descriptor (borrowed: the device keeps owning it).
    fn fileno(&self) -> i32 {
        self.dev.as_fd().as_raw_fd()
    }

    /// A zeroed device tensor; see `tdrv.empty`.
    #[pyo3(signature = (shape, dtype = None, *, channel = 0, name = None))]
    fn empty(
        slf: &Bound<'_, Self>,
        shape: &Bound<'_, PyAny>,
        dtype: Option<&Bound<'_, PyAny>>,
        channel: u32,
        name: Option<&str>,
    ) -> PyResult<PyTensor> {
        empty(slf.py(), shape, dtype, Some(slf.as_any()), channel, name)
    }

    fn __repr__(&self) -> String {
        format!("tdrv.Device({:?}, kind={:?})", self.path(), self.kind())
    }
}

/// Where a new tensor goes: `None` host memory, a `Device`, or a path.
fn target_device(device: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Arc<tdrv::Device>>> {
    let Some(d) = device.filter(|d| !d.is_none()) else {
        return Ok(None);
    };
    if let Ok(d) = d.cast::<PyDevice>() {
        return Ok(Some(d.get().dev.clone()));
    }
    if let Ok(p) = d.extract::<String>() {
        let dev = d.py().detach(|| tdrv::Device::open(&p)).map_err(to_py)?;
        return Ok(Some(dev));
    }
    Err(PyTypeError::new_err(
        "device must be None (host memory), a tdrv.Device or a device path",
    ))
}

/// A tensor: a view of host memory or a device buffer, with a dtype and
/// a C-contiguous shape.
///
/// Zero-copy access: `memoryview(t)` / `numpy.asarray(t)` (read-only),
/// `t.numpy(writable=True)`, `t.map_read()` / `t.map_write()`,
/// `numpy.from_dlpack(t)` (read-write). Each holds a mapping guard of the
/// crate while it lives (see the module's README section).
#[pyclass(module = "tdrv", name = "Tensor", frozen)]
struct PyTensor {
    t: tdrv::Tensor,
    dtype: &'static DType,
    shape: Vec<usize>,
    /// The DLPack producer whose memory a `User` storage borrows.
    keep: Option<Arc<dlpack::Import>>,
}

impl PyTensor {
    fn with(&self, t: tdrv::Tensor, dtype: &'static DType, shape: Vec<usize>) -> PyTensor {
        PyTensor {
            t,
            dtype,
            shape,
            keep: self.keep.clone(),
        }
    }

    /// A mapping guard of the whole view. Taking it waits for the device
    /// work in flight, which happens first in slices where Ctrl-C ends it.
    fn guard(&self, py: Python<'_>, write: bool) -> PyResult<Arc<Guard>> {
        let access = if write {
            tdrv::Access::Write
        } else {
            tdrv::Access::Read
        };
        idle_before(py, &self.t, access)?;
        let keep = self.keep.clone();
        let g = py
            .detach(|| Guard::new(&self.t, write, keep))
            .map_err(to_py)?;
        Ok(Arc::new(g))
    }

    /// Bytes per step of the first axis.
    fn row_bytes(&self) -> PyResult<(usize, usize)> {
        let Some(&rows) = self.shape.first() else {
            return Err(PyTypeError::new_err("a 0-d tensor cannot be indexed"));
        };
        let row = self.shape[1..].iter().product::<usize>() * self.dtype.size;
        Ok((rows, row))
    }
}

#[pymethods]
impl PyTensor {
    /// Size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.t.size()
    }

    /// The shape (C order).
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// Number of dimensions.
    #[getter]
    fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// The element type's name (numpy's).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name
    }

    /// Bytes per element.
    #[getter]
    fn itemsize(&self) -> usize {
        self.dtype.size
    }

    /// The view's name.
    #[getter]
    fn name(&self) -> String {
        self.t.name().to_owned()
    }

    /// `"malloc"` (host), `"dma"` (device buffer), `"user"` (borrowed
    /// memory, from `from_dlpack`), `"fake"`, or None (no storage).
    #[getter]
    fn kind(&self) -> Option<&'static str> {
        self.t.kind().map(|k| match k {
            tdrv::StorageKind::Malloc => "malloc",
            tdrv::StorageKind::Dma => "dma",
            tdrv::StorageKind::Fake => "fake",
            tdrv::StorageKind::User => "user",
        })
    }

    /// Offset of the view in its storage, in bytes.
    #[getter]
    fn offset(&self) -> usize {
        self.t.offset()
    }

    /// HBM channel of a device tensor, else None.
    #[getter]
    fn channel(&self) -> Option<u32> {
        self.t.channel()
    }

    /// The device node of a device tensor, else None.
    #[getter]
    fn device(&self) -> Option<PyDevice> {
        self.t.device().map(|d| PyDevice { dev: d.clone() })
    }

    /// Host address of the first byte (the mapping for a device buffer),
    /// or None. For comparing views; use the views themselves to access
    /// the bytes.
    #[getter]
    fn address(&self) -> Option<usize> {
        self.t.va().map(|p| p.as_ptr() as usize)
    }

    /// Whether `other` views the same storage.
    fn shares_storage_with(&self, other: &Bound<'_, PyTensor>) -> bool {
        self.t.shares_storage_with(&other.get().t)
    }

    /// The same bytes with another dtype and/or shape (default: 1-D).
    #[pyo3(signature = (dtype = None, shape = None))]
    fn view(
        &self,
        dtype: Option<&Bound<'_, PyAny>>,
        shape: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyTensor> {
        let dt = dtype.map(dtype::parse).transpose()?.unwrap_or(self.dtype);
        let shape = match shape {
            Some(s) => parse_shape(s)?,
            None => {
                if self.t.size() % dt.size != 0 {
                    return Err(PyValueError::new_err(format!(
                        "{} bytes are not a whole number of {}",
                        self.t.size(),
                        dt.name
                    )));
                }
                vec![self.t.size() / dt.size]
            }
        };
        if nbytes_of(dt, &shape)? != self.t.size() {
            return Err(PyValueError::new_err(format!(
                "shape {shape:?} of {} does not cover the tensor's {} bytes",
                dt.name,
                self.t.size()
            )));
        }
        Ok(self.with(self.t.clone(), dt, shape))
    }

    /// A 1-D `uint8` view of bytes `[start, stop)` (default: all).
    #[pyo3(signature = (start = None, stop = None, *, name = None))]
    fn byte_slice(
        &self,
        start: Option<usize>,
        stop: Option<usize>,
        name: Option<&str>,
    ) -> PyResult<PyTensor> {
        let start = start.unwrap_or(0);
        let stop = stop.unwrap_or(self.t.size());
        let size = stop
            .checked_sub(start)
            .ok_or_else(|| PyValueError::new_err(format!("slice {start}..{stop} is inverted")))?;
        let name = name.unwrap_or(self.t.name());
        let s = self.t.slice(start, size, Some(name)).map_err(to_py)?;
        Ok(self.with(s, dtype::uint8(), vec![size]))
    }

    /// `t[i]` (one row of the first axis) or `t[a:b]` (rows a..b, step 1):
    /// a view of the same storage, no copy.
    fn __getitem__(&self, key: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
        let (rows, row) = self.row_bytes()?;
        let name = Some(self.t.name());
        if let Ok(s) = key.cast::<PySlice>() {
            let idx = s.indices(rows as isize)?;
            if idx.step != 1 {
                return Err(PyIndexError::new_err(
                    "only step 1 slices (tdrv views are contiguous)",
                ));
            }
            let (start, n) = (idx.start as usize, idx.slicelength);
            let t = self.t.slice(start * row, n * row, name).map_err(to_py)?;
            let mut shape = self.shape.clone();
            shape[0] = n;
            return Ok(self.with(t, self.dtype, shape));
        }
        let i: isize = key
            .extract()
            .map_err(|_| PyTypeError::new_err("index with an int or a slice"))?;
        let j = if i < 0 { i + rows as isize } else { i };
        if j < 0 || j as usize >= rows {
            return Err(PyIndexError::new_err(format!(
                "index {i} out of range for {rows} rows"
            )));
        }
        let t = self.t.slice(j as usize * row, row, name).map_err(to_py)?;
        Ok(self.with(t, self.dtype, self.shape[1..].to_vec()))
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.row_bytes()?.0)
    }

    /// Copies `size` bytes at `offset` (default: to the end) into `bytes`.
    /// Waits for device writes in flight.
    #[pyo3(signature = (offset = 0, size = None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: usize,
        size: Option<usize>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let size = match size {
            Some(s) => s,
            None => self.t.size().checked_sub(offset).ok_or_else(|| {
                to_py(tdrv::Error::OutOfBounds {
                    op: "read",
                    offset,
                    size: 0,
                    len: self.t.size(),
                })
            })?,
        };
        let mut buf = Vec::new();
        buf.try_reserve_exact(size)
            .map_err(|_| to_py(tdrv::Error::OutOfMemory(size)))?;
        buf.resize(size, 0);
        // Device writes in flight are waited for where Ctrl-C can end the
        // wait; the read then finds none (or waits for a job submitted
        // since, like any read).
        wait_interruptibly(py, None, |slice| {
            idle_or_latched(self.t.wait_device_idle(tdrv::Access::Read, Some(slice)))
        })?;
        py.detach(|| self.t.read(offset, &mut buf)).map_err(to_py)?;
        Ok(PyBytes::new(py, &buf))
    }

    /// All bytes, copied.
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.read(py, 0, None)
    }

    /// Copies a C-contiguous buffer (bytes, bytearray, numpy array, ...)
    /// into the tensor at byte `offset`. Waits for device access in flight.
    #[pyo3(signature = (data, offset = 0))]
    fn write(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: usize) -> PyResult<()> {
        let (bytes, _, _) = buffer_bytes(data)?;
        wait_interruptibly(py, None, |slice| {
            idle_or_latched(self.t.wait_device_idle(tdrv::Access::Write, Some(slice)))
        })?;
        py.detach(|| self.t.write(offset, &bytes)).map_err(to_py)
    }

    /// Sets `size` bytes at `offset` (default: to the end) to `value`.
    #[pyo3(signature = (value, offset = 0, size = None))]
    fn memset(
        &self,
        py: Python<'_>,
        value: u8,
        offset: usize,
        size: Option<usize>,
    ) -> PyResult<()> {
        let size = size.unwrap_or_else(|| self.t.size().saturating_sub(offset));
        idle_before(py, &self.t, tdrv::Access::Write)?;
        py.detach(|| self.t.memset(offset, value, size))
            .map_err(to_py)
    }

    /// Copies `size` bytes (default: all of `src` from `src_offset`) from
    /// `src` into this tensor: the device's copy between two device
    /// tensors of one channel, a host round trip otherwise.
    #[pyo3(signature = (src, *, src_offset = 0, dst_offset = 0, size = None))]
    fn copy_from(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyTensor>,
        src_offset: usize,
        dst_offset: usize,
        size: Option<usize>,
    ) -> PyResult<()> {
        let src = &src.get().t;
        let size = size.unwrap_or_else(|| src.size().saturating_sub(src_offset));
        idle_before(py, src, tdrv::Access::Read)?;
        idle_before(py, &self.t, tdrv::Access::Write)?;
        py.detach(|| tdrv::Tensor::copy(src, src_offset, &self.t, dst_offset, size))
            .map_err(to_py)
    }

    /// This tensor on `device` (a `Device`, a device path, or None for host
    /// memory), with the same dtype and shape, without a copy where the
    /// memory can be shared: the same bytes if the tensor is already there
    /// (`channel` is then ignored), and on another tdrv device a view of
    /// this tensor's memory imported through a dma-buf (`Tensor.share_to`
    /// of the crate; docs/sharing.md says which devices share). Writes
    /// through either side are then seen by the other, and jobs there use
    /// the memory. Otherwise the bytes are copied into a new tensor, on
    /// HBM `channel` of a device. As numpy's `copy`: `copy=True` always
    /// copies, `copy=False` never does and raises a `ValueError` (an
    /// `UnsupportedError` where the driver refuses the share) where a copy
    /// would be needed.
    #[pyo3(signature = (device, *, channel = 0, copy = None))]
    fn to(
        &self,
        py: Python<'_>,
        device: Option<&Bound<'_, PyAny>>,
        channel: u32,
        copy: Option<bool>,
    ) -> PyResult<PyTensor> {
        let dev = target_device(device)?;
        let here = self.t.device();
        let same = match (&dev, here) {
            (None, None) => true,
            (Some(d), Some(h)) => d.path() == h.path(),
            _ => false,
        };
        if copy != Some(true) {
            if same {
                return Ok(self.with(self.t.clone(), self.dtype, self.shape.clone()));
            }
            match (&dev, here) {
                (Some(d), Some(_)) => match py.detach(|| self.t.share_to(d, channel)) {
                    Ok(t) => return Ok(self.with(t, self.dtype, self.shape.clone())),
                    // Memory another device cannot reach: copy, if allowed.
                    Err(e) if copy.is_none() && e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
                    Err(e) => return Err(to_py(e)),
                },
                _ if copy == Some(false) => {
                    return Err(PyValueError::new_err(
                        "moving a tensor between host memory and a device needs a copy, \
                         and copy=False forbids it",
                    ))
                }
                _ => {}
            }
        }
        let size = self.t.size();
        let name = Some(self.t.name());
        let new = py
            .detach(|| match &dev {
                None => tdrv::Tensor::allocate_host(size, name),
                Some(d) => tdrv::Tensor::allocate_on(d, channel, size, name),
            })
            .map_err(to_py)?;
        idle_before(py, &self.t, tdrv::Access::Read)?;
        py.detach(|| tdrv::Tensor::copy(&self.t, 0, &new, 0, size))
            .map_err(to_py)?;
        Ok(PyTensor {
            t: new,
            dtype: self.dtype,
            shape: self.shape.clone(),
            keep: None,
        })
    }

    /// Waits until no device job writes the tensor (`write=False`: safe to
    /// read) or touches it (`write=True`: safe to write). `timeout` in
    /// seconds, None without limit.
    #[pyo3(signature = (*, write = false, timeout = None))]
    fn wait_idle(&self, py: Python<'_>, write: bool, timeout: Option<f64>) -> PyResult<()> {
        let access = if write {
            tdrv::Access::Write
        } else {
            tdrv::Access::Read
        };
        let timeout = duration(timeout)?;
        wait_interruptibly(py, timeout, |slice| {
            self.t.wait_device_idle(access, Some(slice))
        })
    }

    /// Waits until `expected` jobs have completed writing this view;
    /// `DeviceWriteFailedError` if one failed instead.
    #[pyo3(signature = (expected, *, timeout = None))]
    fn check_output_completion(
        &self,
        py: Python<'_>,
        expected: u64,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let timeout = duration(timeout)?;
        wait_interruptibly(py, timeout, |slice| {
            self.t.completion().wait(expected, Some(slice))
        })
    }

    /// This view's output-completion count.
    fn output_completion_count(&self) -> PyResult<u64> {
        self.t.completion().count().map_err(to_py)
    }

    /// Lends the bytes for reading, without a copy: a `tdrv.Mapping`
    /// (buffer protocol, DLPack with the read-only flag).
    fn map_read(&self, py: Python<'_>) -> PyResult<PyMapping> {
        PyMapping::new(self.guard(py, false)?, self.dtype, self.shape.clone())
    }

    /// Lends the bytes for reading and writing, without a copy: a
    /// `tdrv.Mapping` (writable buffer, DLPack).
    fn map_write(&self, py: Python<'_>) -> PyResult<PyMapping> {
        PyMapping::new(self.guard(py, true)?, self.dtype, self.shape.clone())
    }

    /// A numpy array over the tensor's bytes, without a copy, holding a
    /// read (default) or write mapping while it lives.
    #[pyo3(signature = (*, writable = false))]
    fn numpy<'py>(&self, py: Python<'py>, writable: bool) -> PyResult<Bound<'py, PyAny>> {
        let np = py.import("numpy")?;
        let m = Bound::new(
            py,
            PyMapping::new(self.guard(py, writable)?, self.dtype, self.shape.clone())?,
        )?;
        np.call_method1("asarray", (m,))
    }

    /// numpy's conversion (`numpy.asarray(t)`): the read-only view of
    /// `numpy()`, converted to `dtype` if given; `copy=True` returns a copy
    /// that holds no mapping. numpy tries the buffer protocol first but
    /// drops its errors; this reports them (`BusyError`, ...).
    #[pyo3(signature = (dtype = None, copy = None))]
    fn __array__<'py>(
        &self,
        py: Python<'py>,
        dtype: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut a = self.numpy(py, false)?;
        if let Some(d) = dtype.filter(|d| !d.is_none()) {
            a = a.call_method1("astype", (d,))?;
        }
        if copy == Some(true) {
            a = a.call_method0("copy")?;
        }
        Ok(a)
    }

    /// Buffer protocol: a read mapping, or a write mapping when the
    /// consumer asks for a writable buffer; held until it releases it.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let me = slf.get();
        let write = flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE;
        let guard = me.guard(slf.py(), write)?;
        let (dtype, shape) = (me.dtype, me.shape.clone());
        // SAFETY: `view` is CPython's, passed through.
        unsafe { buffer::fill(view, flags, guard, dtype, &shape, slf.into_any()) }
    }

    unsafe fn __releasebuffer__(&self, view: *mut ffi::Py_buffer) {
        // SAFETY: `view` is one `__getbuffer__` filled, released once.
        unsafe { buffer::release(view) }
    }

    /// DLPack export, read-only by default: a DLPack 1.0 consumer
    /// (`max_version >= (1, 0)`, as numpy passes) gets the bytes lent by a
    /// read mapping, with the read-only flag, until its array is gone; so
    /// several consumers hold views at once, and a writer (`write`,
    /// `map_write`, a job writing the buffer) is refused with `BusyError`
    /// meanwhile. A consumer of the legacy protocol (no `max_version`, as
    /// JAX calls it) cannot be told that bytes are read-only, so it gets a
    /// host copy of its own (`copy=False` then: `BufferError`).
    /// Writable exports are asked for explicitly: `copy=True` exports a
    /// host copy that is the consumer's alone (flagged as copied), and
    /// `t.map_write().__dlpack__()` lends the bytes for writing, without a
    /// copy, excluding every other view while the consumer holds them.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let versioned = dlpack::check_args(stream, max_version, dl_device)?;
        if !versioned && copy == Some(false) {
            return Err(PyBufferError::new_err(
                "a legacy (unversioned) DLPack tensor has no read-only flag: tdrv lends \
                 its bytes to DLPack 1.0 consumers (max_version=(1, 0)), or for writing \
                 through tensor.map_write()",
            ));
        }
        if copy == Some(true) || !versioned {
            idle_before(py, &self.t, tdrv::Access::Read)?;
            let bytes = py.detach(|| self.t.to_vec()).map_err(to_py)?;
            let c = tdrv::Tensor::from_vec(bytes).map_err(to_py)?.into_tensor();
            let guard = Arc::new(Guard::new(&c, true, None).map_err(to_py)?);
            return dlpack::export(py, guard, self.dtype, &self.shape, versioned, true);
        }
        let guard = self.guard(py, false)?;
        dlpack::export(py, guard, self.dtype, &self.shape, versioned, false)
    }

    /// `(kDLCPU, 0)`: host memory and device mappings are host-addressable.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (dlpack::KDLCPU, 0)
    }

    fn __repr__(&self) -> String {
        format!(
            "tdrv.Tensor(name={:?}, kind={}, dtype={}, shape={:?}, nbytes={})",
            self.t.name(),
            self.kind().unwrap_or("none"),
            self.dtype.name,
            self.shape,
            self.t.size()
        )
    }
}

/// Bytes of a tensor lent without a copy (from `Tensor.map_read` or
/// `map_write`): export them with the buffer protocol (`numpy.asarray(m)`,
/// `memoryview(m)`) or DLPack (`numpy.from_dlpack(m)`). The mapping
/// guard is held while the mapping or any export of it lives;
/// `release()` (or leaving a `with` block) drops the mapping's own share.
#[pyclass(module = "tdrv", name = "Mapping", frozen)]
struct PyMapping {
    guard: Mutex<Option<Arc<Guard>>>,
    writable: bool,
    dtype: &'static DType,
    shape: Vec<usize>,
}

impl PyMapping {
    fn new(guard: Arc<Guard>, dtype: &'static DType, shape: Vec<usize>) -> PyResult<Self> {
        Ok(PyMapping {
            writable: guard.writable(),
            guard: Mutex::new(Some(guard)),
            dtype,
            shape,
        })
    }

    fn current(&self) -> PyResult<Arc<Guard>> {
        self.guard
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| PyValueError::new_err("the mapping was released"))
    }
}

#[pymethods]
impl PyMapping {
    /// Whether the bytes are lent for writing.
    #[getter]
    fn writable(&self) -> bool {
        self.writable
    }

    /// Size in bytes.
    #[getter]
    fn nbytes(&self) -> PyResult<usize> {
        Ok(self.current()?.len())
    }

    /// Whether `release()` has run.
    #[getter]
    fn released(&self) -> bool {
        self.guard
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }

    /// Drops this mapping's share of the guard. Exports made from it
    /// (numpy arrays, DLPack tensors) keep theirs: the bytes stay lent
    /// until the last of them is gone.
    fn release(&self) {
        self.guard.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        self.release();
        false
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let me = slf.get();
        let guard = me.current()?;
        let (dtype, shape) = (me.dtype, me.shape.clone());
        // SAFETY: `view` is CPython's, passed through.
        unsafe { buffer::fill(view, flags, guard, dtype, &shape, slf.into_any()) }
    }

    unsafe fn __releasebuffer__(&self, view: *mut ffi::Py_buffer) {
        // SAFETY: `view` is one `__getbuffer__` filled, released once.
        unsafe { buffer::release(view) }
    }

    /// DLPack export sharing this mapping's guard, without a copy: a write
    /// mapping to any consumer, a read mapping to a DLPack 1.0 consumer
    /// only (with the read-only flag; the legacy protocol has none, so
    /// `BufferError`).
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let versioned = dlpack::check_args(stream, max_version, dl_device)?;
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "a Mapping exports its own bytes; copy from the Tensor instead",
            ));
        }
        dlpack::export(
            py,
            self.current()?,
            self.dtype,
            &self.shape,
            versioned,
            false,
        )
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (dlpack::KDLCPU, 0)
    }

    fn __repr__(&self) -> String {
        format!(
            "tdrv.Mapping({}, dtype={}, shape={:?}{})",
            if self.writable { "write" } else { "read" },
            self.dtype.name,
            self.shape,
            if self.released() { ", released" } else { "" }
        )
    }
}

/// A copy job under construction: `Job().copy(a, b).submit().wait()`.
/// Both tensors of a copy are device tensors of one device and channel.
#[pyclass(module = "tdrv", name = "Job")]
#[derive(Default)]
struct PyJob {
    job: tdrv::Job,
}

#[pymethods]
impl PyJob {
    #[new]
    fn new() -> Self {
        PyJob::default()
    }

    /// Adds a copy of `size` bytes (default: all of `src`, which must then
    /// be as large as `dst`) from `src` to `dst`; returns the job.
    #[pyo3(signature = (src, dst, *, src_offset = 0, dst_offset = 0, size = None))]
    fn copy<'py>(
        mut slf: PyRefMut<'py, Self>,
        src: &Bound<'py, PyTensor>,
        dst: &Bound<'py, PyTensor>,
        src_offset: usize,
        dst_offset: usize,
        size: Option<usize>,
    ) -> PyResult<PyRefMut<'py, Self>> {
        let (s, d) = (&src.get().t, &dst.get().t);
        let r: TResult<_> = match size {
            None if src_offset == 0 && dst_offset == 0 => slf.job.copy_all(s, d).map(drop),
            None => slf
                .job
                .copy(
                    s,
                    src_offset,
                    d,
                    dst_offset,
                    s.size().saturating_sub(src_offset),
                )
                .map(drop),
            Some(n) => slf.job.copy(s, src_offset, d, dst_offset, n).map(drop),
        };
        r.map_err(to_py)?;
        Ok(slf)
    }

    /// Number of copies so far.
    fn __len__(&self) -> usize {
        self.job.len()
    }

    /// Queues the job and returns its handle at once; the job is empty
    /// afterwards.
    fn submit(&mut self) -> PyResult<PyJobHandle> {
        let h = self.job.submit().map_err(to_py)?;
        Ok(PyJobHandle { h })
    }
}

/// A submitted job. Its failure is reported only by waiting for it (and
/// by reads of the buffers it wrote: `DeviceWriteFailedError`).
#[pyclass(module = "tdrv", name = "JobHandle", frozen)]
struct PyJobHandle {
    h: tdrv::JobHandle,
}

#[pymethods]
impl PyJobHandle {
    /// The driver's job id.
    #[getter]
    fn id(&self) -> u64 {
        self.h.id()
    }

    /// Waits for the job (`timeout` in seconds, None without limit):
    /// `JobFailedError` if it failed, `TimeoutError` if time ran out.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = duration(timeout)?;
        wait_interruptibly(py, timeout, |slice| self.h.wait_for(Some(slice)))
    }

    /// Whether the job is done (`JobFailedError` if it failed).
    fn try_wait(&self) -> PyResult<bool> {
        self.h.try_wait().map_err(to_py)
    }

    /// `await handle` in asyncio waits for the job without blocking the
    /// event loop and without a thread: the loop watches the device file
    /// for the job's completion event (`TDRV_IOC_JOB_NOTIFY`, every
    /// kernel). `JobFailedError` if it failed; cancelling the awaiting task
    /// leaves the job running.
    fn __await__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        aio(py)?
            .call_method1("wait_job", (slf,))?
            .call_method0("__await__")
    }

    /// For the asyncio glue (`aio.py`): the device file's descriptor.
    fn _fileno(&self) -> i32 {
        self.h.device().as_fd().as_raw_fd()
    }

    /// For the asyncio glue: whether it may read the device file's
    /// completion events: the driver delivers them, and this process
    /// reads them (not a child after `fork` sharing its parent's file;
    /// the glue then waits in an executor thread).
    fn _events_supported(&self) -> bool {
        let d = self.h.device();
        d.supports_events() && d.claim_events().is_ok()
    }

    /// For the asyncio glue: asks for the job's completion event, tagged
    /// with `key`.
    fn _notify(&self, key: u64) -> PyResult<()> {
        self.h.device().job_notify(self.h.id(), key).map_err(to_py)
    }

    /// For the asyncio glue: the device file's ready events, as
    /// `(job_id, key, errno)` tuples (errno 0 for success); never blocks.
    fn _read_events(&self) -> PyResult<Vec<(u64, u64, i32)>> {
        let mut evs = Vec::new();
        self.h.device().read_events(&mut evs).map_err(to_py)?;
        Ok(evs
            .into_iter()
            .map(|e| {
                let errno = match e.status {
                    tdrv::sys::JobStatus::Failed(errno) => errno,
                    _ => 0,
                };
                (e.job_id, e.user_data, errno)
            })
            .collect())
    }

    fn __repr__(&self) -> String {
        format!("tdrv.JobHandle(id={})", self.h.id())
    }
}

/// The asyncio glue (`aio.py`), compiled once per process.
static AIO: std::sync::OnceLock<Py<PyModule>> = std::sync::OnceLock::new();

fn aio(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    if AIO.get().is_none() {
        let m = PyModule::from_code(
            py,
            ffi::c_str!(include_str!("aio.py")),
            ffi::c_str!("tdrv/aio.py"),
            ffi::c_str!("tdrv._aio"),
        )?;
        let _ = AIO.set(m.unbind());
    }
    AIO.get()
        .map(|m| m.bind(py))
        .ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("tdrv: asyncio glue missing"))
}

/// A zeroed tensor of `shape` and `dtype` (default `uint8`): in host
/// memory, or on `device` (a `Device` or a device path) and its HBM
/// `channel`.
#[pyfunction]
#[pyo3(signature = (shape, dtype = None, *, device = None, channel = 0, name = None))]
fn empty(
    py: Python<'_>,
    shape: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
    channel: u32,
    name: Option<&str>,
) -> PyResult<PyTensor> {
    let dt = dtype
        .map(dtype::parse)
        .transpose()?
        .unwrap_or(dtype::uint8());
    let shape = parse_shape(shape)?;
    let nbytes = nbytes_of(dt, &shape)?;
    let dev = target_device(device)?;
    let t = py
        .detach(|| match &dev {
            None => tdrv::Tensor::allocate_host(nbytes, name),
            Some(d) => tdrv::Tensor::allocate_on(d, channel, nbytes, name),
        })
        .map_err(to_py)?;
    Ok(PyTensor {
        t,
        dtype: dt,
        shape,
        keep: None,
    })
}

/// A new tensor holding a copy of a C-contiguous buffer (numpy array,
/// bytes, ...), with its dtype and shape when tdrv knows the format
/// (else as bytes). Host memory unless `device` is given.
#[pyfunction]
#[pyo3(signature = (obj, *, device = None, channel = 0, name = None))]
fn from_buffer(
    obj: &Bound<'_, PyAny>,
    device: Option<&Bound<'_, PyAny>>,
    channel: u32,
    name: Option<&str>,
) -> PyResult<PyTensor> {
    let dev = target_device(device)?;
    // One copy: straight from the exporter's bytes into the new tensor.
    // The GIL stays held, so no Python code changes them meanwhile.
    with_buffer(obj, |buf, len, dtype, shape| {
        let t = match &dev {
            None => tdrv::Tensor::allocate_host(len, name),
            Some(d) => tdrv::Tensor::allocate_on(d, channel, len, name),
        }
        .map_err(to_py)?;
        // SAFETY: `buf` is `len` readable bytes while the view is held
        // (`with_buffer`), and nothing writes them during the call: the GIL
        // is held, and native code writing an exported buffer without it
        // breaks the buffer protocol's contract. A new tensor has no job
        // in flight, so the write does not wait.
        unsafe { t.write_raw(0, buf, len) }.map_err(to_py)?;
        Ok(PyTensor {
            t,
            dtype,
            shape,
            keep: None,
        })
    })
}

/// A tensor over another library's DLPack tensor (anything with
/// `__dlpack__`: numpy arrays, tdrv tensors, ...). Host memory,
/// C-contiguous. Without a copy by default: the tensor borrows the
/// producer's memory (storage kind `"user"`) and keeps it alive, and
/// writes through either side are seen by the other. A read-only
/// producer is copied unless `copy=False` (then `BufferError`);
/// `copy=True` always copies into host memory.
#[pyfunction]
#[pyo3(signature = (obj, *, copy = None, name = None))]
fn from_dlpack(
    obj: &Bound<'_, PyAny>,
    copy: Option<bool>,
    name: Option<&str>,
) -> PyResult<PyTensor> {
    // A tdrv tensor is imported through a write mapping of it (its own
    // export is read-only): the new tensor aliases its bytes and excludes
    // every other view while it lives.
    let imp = match obj.cast::<PyTensor>() {
        Ok(t) => dlpack::import(Bound::new(obj.py(), t.get().map_write(obj.py())?)?.as_any())?,
        Err(_) => dlpack::import(obj)?,
    };
    let must_copy = copy == Some(true) || imp.read_only;
    if imp.read_only && copy == Some(false) {
        return Err(PyBufferError::new_err(
            "the DLPack tensor is read-only: tdrv tensors are writable, so it must be copied",
        ));
    }
    let (dtype, shape, nbytes, data) = (imp.dtype, imp.shape, imp.nbytes, imp.data);
    let import = Arc::new(imp.import);
    if must_copy {
        let t = tdrv::Tensor::allocate_host(nbytes, name).map_err(to_py)?;
        // SAFETY: the producer's `nbytes` bytes at `data` are readable while
        // `import` (not yet released) holds its tensor; a read-only
        // producer does not write them.
        unsafe { t.write_raw(0, data, nbytes) }.map_err(to_py)?;
        drop(import);
        return Ok(PyTensor {
            t,
            dtype,
            shape,
            keep: None,
        });
    }
    // SAFETY: `data` is valid for reads and writes of `nbytes` bytes (a
    // writable host DLPack tensor) until its deleter runs, which happens
    // when `import` is dropped; every view of the new storage (this
    // tensor, its slices and views, the mapping guards they lend) lives in
    // an object holding a clone of `import`, and jobs refuse `User`
    // storage. Writes by the producer racing with a tdrv call on the same
    // bytes are the caller's, as between any two DLPack consumers.
    let t = unsafe { tdrv::Tensor::from_user_buffer(data, nbytes, name) }.map_err(to_py)?;
    Ok(PyTensor {
        t,
        dtype,
        shape,
        keep: Some(import),
    })
}

/// The tdrv device nodes present (`/dev/tdrv*`).
#[pyfunction]
fn devices() -> Vec<String> {
    tdrv::Device::enumerate()
        .into_iter()
        .map(|p| p.display().to_string())
        .collect()
}

/// The `tdrv` Python module.
#[pymodule(name = "tdrv")]
fn tdrv_py(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    aio(m.py())?;
    m.add(
        "DTYPES",
        dtype::DTYPES.iter().map(|d| d.name).collect::<Vec<_>>(),
    )?;
    m.add_class::<PyDevice>()?;
    m.add_class::<PyTensor>()?;
    m.add_class::<PyMapping>()?;
    m.add_class::<PyJob>()?;
    m.add_class::<PyJobHandle>()?;
    m.add_function(wrap_pyfunction!(empty, m)?)?;
    m.add_function(wrap_pyfunction!(from_buffer, m)?)?;
    m.add_function(wrap_pyfunction!(from_dlpack, m)?)?;
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    errors::register(m)?;
    Ok(())
}
