// SPDX-License-Identifier: MIT OR Apache-2.0
//! DLPack: the C structures of the DLPack 1.0 header (`dlpack.h`, the
//! ABI every DLPack consumer reads), the capsules `__dlpack__` returns,
//! and the import side of `tdrv.from_dlpack`.
//!
//! Export: the capsule owns a `DLManagedTensor(Versioned)` whose
//! `manager_ctx` owns a mapping guard of the tensor (see `guard.rs`):
//! the bytes stay lent, and excluded from conflicting tdrv access, until
//! the consumer calls the deleter (numpy: when the array dies) or the
//! unconsumed capsule is collected.
//!
//! Import: the producer's tensor is wrapped without a copy as `User`
//! storage; its deleter runs when the last Python tensor, mapping or
//! export over that storage is gone (`Import`'s `Drop`).

use std::ffi::{c_void, CStr};
use std::ptr;
use std::sync::Arc;

use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::dtype::{self, DType};
use crate::guard::Guard;

/// `kDLCPU`: memory the host reads and writes directly (host tensors and
/// the mapping of a device buffer).
pub const KDLCPU: i32 = 1;
/// `kDLCUDAHost`: pinned host memory, also host-addressable.
const KDLCUDAHOST: i32 = 3;
/// `DLPACK_FLAG_BITMASK_READ_ONLY`.
pub const FLAG_READ_ONLY: u64 = 1;
/// `DLPACK_FLAG_BITMASK_IS_COPIED`.
pub const FLAG_IS_COPIED: u64 = 1 << 1;

const NAME: &CStr = c"dltensor";
const USED_NAME: &CStr = c"used_dltensor";
const NAME_V: &CStr = c"dltensor_versioned";
const USED_NAME_V: &CStr = c"used_dltensor_versioned";

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DLDevice {
    pub device_type: i32,
    pub device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
pub struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

#[repr(C)]
pub struct DLManagedTensor {
    pub dl_tensor: DLTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DLPackVersion {
    pub major: u32,
    pub minor: u32,
}

#[repr(C)]
pub struct DLManagedTensorVersioned {
    pub version: DLPackVersion,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    pub flags: u64,
    pub dl_tensor: DLTensor,
}

/// What an exported tensor keeps alive: the guard lending the bytes, and
/// the shape array `dl_tensor.shape` points into.
struct ExportCtx {
    _guard: Arc<Guard>,
    shape: Vec<i64>,
}

unsafe extern "C" fn delete_legacy(p: *mut DLManagedTensor) {
    if p.is_null() {
        return;
    }
    // SAFETY: `p` is the box `export` leaked, and its `manager_ctx` the
    // `ExportCtx` box; DLPack calls the deleter once. Dropping the guard
    // takes only Rust locks, so any thread may run it, with or without
    // the GIL (as DLPack allows).
    unsafe {
        let m = Box::from_raw(p);
        drop(Box::from_raw(m.manager_ctx.cast::<ExportCtx>()));
    }
}

unsafe extern "C" fn delete_versioned(p: *mut DLManagedTensorVersioned) {
    if p.is_null() {
        return;
    }
    // SAFETY: as in `delete_legacy`.
    unsafe {
        let m = Box::from_raw(p);
        drop(Box::from_raw(m.manager_ctx.cast::<ExportCtx>()));
    }
}

/// Destructor of the capsules `export` makes: a capsule still under its
/// first name was never consumed, so it still owns its tensor.
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by CPython with the GIL held on a live capsule;
    // `PyCapsule_IsValid` sets no error, and a valid capsule of that name
    // holds the pointer `export` gave it, not yet handed to a deleter (a
    // consumer renames the capsule when it takes ownership).
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, NAME_V.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(capsule, NAME_V.as_ptr());
            delete_versioned(p.cast());
        } else if ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr());
            delete_legacy(p.cast());
        }
    }
}

/// Checks `__dlpack__`'s arguments; returns whether the consumer takes a
/// versioned (DLPack 1.x) capsule.
pub fn check_args(
    stream: Option<&Bound<'_, PyAny>>,
    max_version: Option<(u32, u32)>,
    dl_device: Option<(i32, i32)>,
) -> PyResult<bool> {
    if let Some(s) = stream {
        // CPU memory has no stream; -1 means "no synchronisation".
        if !s.is_none() && s.extract::<i64>().ok() != Some(-1) {
            return Err(PyBufferError::new_err(
                "tdrv tensors are host-addressable (kDLCPU): stream must be None",
            ));
        }
    }
    if let Some((t, id)) = dl_device {
        if (t, id) != (KDLCPU, 0) {
            return Err(PyBufferError::new_err(format!(
                "tdrv exports to the CPU device (1, 0) only, not ({t}, {id}); copy through the host"
            )));
        }
    }
    Ok(matches!(max_version, Some((major, _)) if major >= 1))
}

/// A capsule lending `guard`'s bytes as a C-contiguous tensor of `dtype`
/// and `shape`.
pub fn export<'py>(
    py: Python<'py>,
    guard: Arc<Guard>,
    dtype: &'static DType,
    shape: &[usize],
    versioned: bool,
    copied: bool,
) -> PyResult<Bound<'py, PyAny>> {
    // The legacy protocol has no read-only flag, and a consumer of it may
    // write what it gets (numpy and PyTorch make writable arrays of it):
    // read-only bytes go only to a consumer that can be told (numpy's
    // export refuses the same way).
    if !versioned && !guard.writable() {
        return Err(PyBufferError::new_err(
            "read-only bytes cannot be exported as a legacy (unversioned) DLPack tensor, \
             which has no read-only flag: pass max_version=(1, 0), or export a copy \
             (copy=True) or a write mapping (tensor.map_write())",
        ));
    }
    let mut ctx = Box::new(ExportCtx {
        shape: shape.iter().map(|&d| d as i64).collect(),
        _guard: guard,
    });
    let dl_tensor = DLTensor {
        data: ctx._guard.ptr().cast(),
        device: DLDevice {
            device_type: KDLCPU,
            device_id: 0,
        },
        ndim: shape.len() as i32,
        dtype: DLDataType {
            code: dtype.dl_code,
            bits: (dtype.size * 8) as u8,
            lanes: 1,
        },
        // NULL strides: compact row-major.
        shape: if shape.is_empty() {
            ptr::null_mut()
        } else {
            ctx.shape.as_mut_ptr()
        },
        strides: ptr::null_mut(),
        byte_offset: 0,
    };
    let (raw, name): (*mut c_void, &CStr) = if versioned {
        let mut flags = 0;
        if !ctx._guard.writable() {
            flags |= FLAG_READ_ONLY;
        }
        if copied {
            flags |= FLAG_IS_COPIED;
        }
        let m = Box::new(DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx: Box::into_raw(ctx).cast(),
            deleter: Some(delete_versioned),
            flags,
            dl_tensor,
        });
        (Box::into_raw(m).cast(), NAME_V)
    } else {
        let m = Box::new(DLManagedTensor {
            dl_tensor,
            manager_ctx: Box::into_raw(ctx).cast(),
            deleter: Some(delete_legacy),
        });
        (Box::into_raw(m).cast(), NAME)
    };
    // SAFETY: `raw` is a live managed tensor of the kind `name` says; the
    // capsule owns it from here, and `capsule_destructor` frees it unless a
    // consumer took it (renamed the capsule).
    let capsule = unsafe { ffi::PyCapsule_New(raw, name.as_ptr(), Some(capsule_destructor)) };
    if capsule.is_null() {
        // SAFETY: no capsule took `raw`: free it here, once.
        unsafe {
            if versioned {
                delete_versioned(raw.cast());
            } else {
                delete_legacy(raw.cast());
            }
        }
    }
    // SAFETY: a new reference, or NULL with the error set.
    unsafe { Bound::from_owned_ptr_or_err(py, capsule) }
}

/// A producer's tensor taken over by `tdrv.from_dlpack`: its deleter runs
/// when this is dropped.
pub struct Import {
    managed: *mut c_void,
    versioned: bool,
}

// SAFETY: `managed` is only passed to its own deleter, once, on drop;
// DLPack requires deleters to be callable from any thread (producers that
// need the GIL, such as numpy, take it themselves).
unsafe impl Send for Import {}
// SAFETY: `&Import` gives no access to anything.
unsafe impl Sync for Import {}

impl Drop for Import {
    fn drop(&mut self) {
        // SAFETY: `managed` is the managed tensor of the kind `versioned`
        // says, taken from a consumed capsule; its deleter has not run.
        unsafe {
            if self.versioned {
                let m = self.managed.cast::<DLManagedTensorVersioned>();
                if let Some(d) = (*m).deleter {
                    d(m);
                }
            } else {
                let m = self.managed.cast::<DLManagedTensor>();
                if let Some(d) = (*m).deleter {
                    d(m);
                }
            }
        }
    }
}

/// The producer's tensor as tdrv sees it.
pub struct Imported {
    pub import: Import,
    pub data: *mut u8,
    pub nbytes: usize,
    pub dtype: &'static DType,
    pub shape: Vec<usize>,
    pub read_only: bool,
}

/// Asks `obj` for a capsule (DLPack 1.0 first, then the legacy protocol)
/// and takes its tensor over, if tdrv can describe it: host memory,
/// C-contiguous, a supported dtype. A refused tensor is left to its
/// capsule (whose destructor frees it).
pub fn import(obj: &Bound<'_, PyAny>) -> PyResult<Imported> {
    let py = obj.py();
    if !obj.hasattr("__dlpack__")? {
        return Err(PyTypeError::new_err(format!(
            "{} does not support DLPack (no __dlpack__)",
            obj.get_type().name()?
        )));
    }
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("max_version", PyTuple::new(py, [1u32, 0])?)?;
    let capsule = match obj.call_method("__dlpack__", (), Some(&kwargs)) {
        Ok(c) => c,
        Err(e) if e.is_instance_of::<PyTypeError>(py) => obj.call_method0("__dlpack__")?,
        Err(e) => return Err(e),
    };
    let cap = capsule.as_ptr();
    // SAFETY: `cap` is a live object (held by `capsule`); IsValid only
    // checks its type and name and sets no error.
    let versioned = unsafe { ffi::PyCapsule_IsValid(cap, NAME_V.as_ptr()) } == 1;
    // SAFETY: as above.
    if !versioned && unsafe { ffi::PyCapsule_IsValid(cap, NAME.as_ptr()) } != 1 {
        return Err(PyTypeError::new_err(
            "__dlpack__ returned no unconsumed \"dltensor\" capsule",
        ));
    }
    let name = if versioned { NAME_V } else { NAME };
    // SAFETY: a valid capsule of that name: its pointer is the producer's
    // live managed tensor of the matching kind, owned by the capsule
    // until renamed.
    let managed = unsafe { ffi::PyCapsule_GetPointer(cap, name.as_ptr()) };
    if managed.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: as above: the struct is live and readable.
    let (t, flags) = unsafe {
        if versioned {
            let m = &*managed.cast::<DLManagedTensorVersioned>();
            if m.version.major != 1 {
                return Err(PyBufferError::new_err(format!(
                    "DLPack {}.{} tensor: tdrv reads major version 1",
                    m.version.major, m.version.minor
                )));
            }
            (&m.dl_tensor, m.flags)
        } else {
            (&(*managed.cast::<DLManagedTensor>()).dl_tensor, 0)
        }
    };
    if t.device.device_type != KDLCPU && t.device.device_type != KDLCUDAHOST {
        return Err(PyBufferError::new_err(format!(
            "DLPack device ({}, {}) is not host memory",
            t.device.device_type, t.device.device_id
        )));
    }
    let Some(dtype) = dtype::from_dlpack(t.dtype.code, t.dtype.bits, t.dtype.lanes) else {
        return Err(PyBufferError::new_err(format!(
            "unsupported DLPack dtype (code {}, bits {}, lanes {})",
            t.dtype.code, t.dtype.bits, t.dtype.lanes
        )));
    };
    let ndim =
        usize::try_from(t.ndim).map_err(|_| PyBufferError::new_err("negative DLPack ndim"))?;
    let shape: Vec<i64> = if ndim == 0 {
        Vec::new()
    } else {
        // SAFETY: DLPack: `shape` points to `ndim` integers.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }.to_vec()
    };
    let shape: Vec<usize> = shape
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<_, _>>()
        .map_err(|_| PyBufferError::new_err("negative DLPack dimension"))?;
    if !t.strides.is_null() && ndim > 0 {
        // SAFETY: DLPack: non-NULL `strides` points to `ndim` integers.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        let mut expect = 1i64;
        for (d, s) in shape.iter().zip(strides).rev() {
            // Dimensions of size 1 may have any stride.
            if *d != 1 && *s != expect {
                return Err(PyBufferError::new_err(
                    "tdrv.from_dlpack needs a C-contiguous tensor (make one with numpy.ascontiguousarray)",
                ));
            }
            expect *= *d as i64;
        }
    }
    let nbytes = shape
        .iter()
        .try_fold(dtype.size, |n, &d| n.checked_mul(d))
        .ok_or_else(|| PyBufferError::new_err("DLPack tensor size overflows"))?;
    let data = if nbytes == 0 {
        ptr::null_mut()
    } else {
        let offset = usize::try_from(t.byte_offset)
            .map_err(|_| PyBufferError::new_err("DLPack byte_offset overflows"))?;
        t.data.cast::<u8>().wrapping_add(offset)
    };
    // Ours from here: rename so the producer's capsule destructor leaves
    // it alone.
    let used = if versioned { USED_NAME_V } else { USED_NAME };
    // SAFETY: `cap` is a live capsule.
    if unsafe { ffi::PyCapsule_SetName(cap, used.as_ptr()) } != 0 {
        return Err(PyErr::fetch(py));
    }
    Ok(Imported {
        import: Import { managed, versioned },
        data,
        nbytes,
        dtype,
        shape,
        read_only: flags & FLAG_READ_ONLY != 0,
    })
}
