// SPDX-License-Identifier: MIT OR Apache-2.0
//! The buffer protocol (PEP 3118) over a mapping guard: what
//! `memoryview(t)`, `numpy.asarray(t)` and `numpy.asarray(t.map_write())`
//! see.

use std::ffi::{c_int, CString};
use std::ptr;
use std::sync::Arc;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::dtype::DType;
use crate::guard::Guard;

/// What one export holds, in `Py_buffer.internal` until released.
struct Export {
    _guard: Arc<Guard>,
    shape: Vec<isize>,
    strides: Vec<isize>,
    format: Option<CString>,
}

/// Fills `view` with `guard`'s bytes as a C-contiguous array of `dtype`
/// and `shape` (or as plain bytes when the consumer asks for no format),
/// owned by `owner`.
///
/// # Safety
/// `view` must be the `Py_buffer` CPython passed to `__getbuffer__`.
pub unsafe fn fill(
    view: *mut ffi::Py_buffer,
    flags: c_int,
    guard: Arc<Guard>,
    dtype: &'static DType,
    shape: &[usize],
    owner: Bound<'_, PyAny>,
) -> PyResult<()> {
    if view.is_null() {
        return Err(PyBufferError::new_err("NULL Py_buffer"));
    }
    if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE && !guard.writable() {
        return Err(PyBufferError::new_err(
            "read-only: the bytes are lent for reading; use map_write() or numpy(writable=True)",
        ));
    }
    let want_nd = flags & ffi::PyBUF_ND == ffi::PyBUF_ND;
    let want_strides = flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES;
    let want_format = flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT;
    let len = guard.len();
    // Typed only for consumers that read the format; others get bytes.
    let (itemsize, format, dims): (usize, Option<&str>, Vec<usize>) = if want_format {
        let Some(f) = dtype.format else {
            return Err(PyBufferError::new_err(format!(
                "{} has no buffer-protocol format: use .view(\"uint16\") or DLPack",
                dtype.name
            )));
        };
        (dtype.size, Some(f), shape.to_vec())
    } else {
        (1, None, vec![len])
    };
    let f_only = flags & ffi::PyBUF_F_CONTIGUOUS == ffi::PyBUF_F_CONTIGUOUS
        && flags & ffi::PyBUF_ANY_CONTIGUOUS != ffi::PyBUF_ANY_CONTIGUOUS;
    if f_only && dims.iter().filter(|&&d| d > 1).count() > 1 {
        return Err(PyBufferError::new_err("tdrv tensors are C-contiguous"));
    }
    if !want_nd && want_format && dims.len() != 1 {
        // Without a shape the consumer sees len / itemsize items.
        return Err(PyBufferError::new_err(
            "a typed tensor of more than one dimension needs PyBUF_ND",
        ));
    }
    let mut strides = vec![0isize; dims.len()];
    let mut step = itemsize as isize;
    for (s, d) in strides.iter_mut().zip(&dims).rev() {
        *s = step;
        step *= *d as isize;
    }
    let mut export = Box::new(Export {
        _guard: guard,
        shape: dims.iter().map(|&d| d as isize).collect(),
        strides,
        format: format.map(|f| CString::new(f).expect("formats have no NUL")),
    });
    let ndim = export.shape.len() as c_int;
    // SAFETY: `view` is CPython's `Py_buffer` (our caller's contract);
    // every pointer stored in it points into `export` (heap, never moved
    // again) or the guard's bytes, both kept until `release` drops the box
    // that `internal` holds; `obj` takes a strong reference to `owner`,
    // which CPython drops after calling `__releasebuffer__`.
    unsafe {
        (*view).buf = export._guard.ptr().cast();
        (*view).len = len as isize;
        (*view).readonly = c_int::from(!export._guard.writable());
        (*view).itemsize = itemsize as isize;
        (*view).format = export
            .format
            .as_ref()
            .map_or(ptr::null_mut(), |f| f.as_ptr().cast_mut());
        (*view).ndim = ndim;
        (*view).shape = if want_nd && ndim > 0 {
            export.shape.as_mut_ptr()
        } else {
            ptr::null_mut()
        };
        (*view).strides = if want_strides && ndim > 0 {
            export.strides.as_mut_ptr()
        } else {
            ptr::null_mut()
        };
        (*view).suboffsets = ptr::null_mut();
        (*view).internal = Box::into_raw(export).cast();
        (*view).obj = owner.into_ptr();
    }
    Ok(())
}

/// Drops what `fill` stored: the guard's share and the arrays.
///
/// # Safety
/// `view` must be a `Py_buffer` that `fill` filled, released once.
pub unsafe fn release(view: *mut ffi::Py_buffer) {
    // SAFETY: `internal` is the box `fill` leaked, freed only here.
    unsafe {
        let internal = (*view).internal;
        if !internal.is_null() {
            (*view).internal = ptr::null_mut();
            drop(Box::from_raw(internal.cast::<Export>()));
        }
    }
}
