//! `libnrt.so.1`: the nrt_tensor C ABI of the Neuron runtime, over the tdrv
//! tensor layer. The declarations are in `include/nrt.h`.
//!
//! Conventions of every entry point:
//! - NULL or otherwise invalid arguments return an error status (a tensor
//!   pointer that is not a live tensor is `NRT_INVALID_HANDLE`, as far as
//!   that can be told); nothing asserts;
//! - a Rust panic never crosses the boundary: it becomes `NRT_FAILURE`;
//! - errors are logged to stderr as `nrt: <function>: <message>` unless
//!   `NEURON_RT_LOG_LEVEL` is `OFF`, `NONE` or `FATAL`.
//!
//! Handles: an `nrt_tensor_t *` is one reference to a tensor view
//! ([`tdrv::Tensor::into_raw`]). A tensor set holds references of its own,
//! so a tensor stays valid while it is in a set, and
//! `nrt_get_tensor_from_tensor_set` returns the same pointer that was added.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, OnceLock};

use tdrv::{Error, Fencing, Placement, ReadOp, SysError, Tensor, TensorSet, WriteOp};

/// Status codes (`NRT_STATUS`).
pub type NRT_STATUS = c_int;
pub const NRT_SUCCESS: NRT_STATUS = 0;
pub const NRT_FAILURE: NRT_STATUS = 1;
pub const NRT_INVALID: NRT_STATUS = 2;
pub const NRT_INVALID_HANDLE: NRT_STATUS = 3;
pub const NRT_RESOURCE: NRT_STATUS = 4;
pub const NRT_TIMEOUT: NRT_STATUS = 5;
pub const NRT_HW_ERROR: NRT_STATUS = 6;
pub const NRT_QUEUE_FULL: NRT_STATUS = 7;
pub const NRT_UNINITIALIZED: NRT_STATUS = 13;
pub const NRT_CLOSED: NRT_STATUS = 14;

/// `nrt_tensor_placement_t`.
pub type nrt_tensor_placement_t = c_int;
pub const NRT_TENSOR_PLACEMENT_DEVICE: nrt_tensor_placement_t = 0;
pub const NRT_TENSOR_PLACEMENT_HOST: nrt_tensor_placement_t = 1;
pub const NRT_TENSOR_PLACEMENT_VIRTUAL: nrt_tensor_placement_t = 2;

/// Opaque tensor.
#[repr(C)]
pub struct nrt_tensor_t {
    _private: [u8; 0],
}

/// Opaque tensor set.
pub type nrt_tensor_set_t = c_void;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nrt_tensor_batch_op_t {
    pub offset: u64,
    pub size: u64,
    pub buffer: *mut c_void,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nrt_tensor_batch_t {
    pub tensor: *const nrt_tensor_t,
    pub ops: *const nrt_tensor_batch_op_t,
    pub num_ops: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct nrt_tensor_device_allocation_info_t {
    pub physical_address: u64,
    pub size: usize,
    pub hbm_index: c_int,
}

/// The status an error maps to.
pub fn status_of(e: &Error) -> NRT_STATUS {
    match e {
        Error::Timeout { .. } => NRT_TIMEOUT,
        Error::OutOfMemory(_) => NRT_RESOURCE,
        Error::OutOfBounds { .. }
        | Error::Overflow { .. }
        | Error::NoStorage { .. }
        | Error::Unsupported { .. }
        | Error::CrossChannel { .. }
        | Error::InvalidArgument(_)
        | Error::SharedView(_) => NRT_INVALID,
        Error::Sys(s) => match s {
            SysError::TimedOut { .. } => NRT_TIMEOUT,
            SysError::NoMemory { .. } | SysError::NoSpace { .. } => NRT_RESOURCE,
            // A device-to-device copy across HBMs is NRT_INVALID.
            SysError::CrossChannel { .. }
            | SysError::InvalidArgument { .. }
            | SysError::OutOfRange { .. }
            | SysError::BadAddress { .. }
            | SysError::UnknownFields { .. } => NRT_INVALID,
            SysError::NoSuchBuffer { .. } => NRT_INVALID_HANDLE,
            SysError::DeviceRemoved { .. } => NRT_CLOSED,
            SysError::Open { .. } | SysError::NotTdrv { .. } | SysError::AbiMismatch { .. } => {
                NRT_UNINITIALIZED
            }
            _ => NRT_FAILURE,
        },
        Error::JobFailed { .. } => NRT_HW_ERROR,
        Error::Io { .. } => NRT_FAILURE,
    }
}

fn logging_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let level = std::env::var("NEURON_RT_LOG_LEVEL").unwrap_or_default();
        !matches!(
            level.to_ascii_uppercase().as_str(),
            "OFF" | "NONE" | "FATAL"
        )
    })
}

fn log_error(func: &str, msg: &dyn std::fmt::Display) {
    if logging_enabled() {
        eprintln!("nrt: {func}: {msg}");
    }
}

fn fail(func: &str, status: NRT_STATUS, msg: &str) -> NRT_STATUS {
    log_error(func, &msg);
    status
}

fn status(func: &str, r: tdrv::Result<()>) -> NRT_STATUS {
    match r {
        Ok(()) => NRT_SUCCESS,
        Err(e) => {
            log_error(func, &e);
            status_of(&e)
        }
    }
}

/// Runs an entry point, turning a panic into `NRT_FAILURE`.
fn guard(func: &str, f: impl FnOnce() -> NRT_STATUS) -> NRT_STATUS {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(s) => s,
        Err(_) => fail(func, NRT_FAILURE, "internal error (panic)"),
    }
}

/// Borrows the tensor behind a handle: NULL is `NRT_INVALID`, a pointer
/// that is not a live tensor `NRT_INVALID_HANDLE`.
///
/// # Safety
/// A non-null `t` must be readable memory (any pointer the caller got from
/// this library and has not freed).
unsafe fn borrow(func: &str, t: *const nrt_tensor_t) -> Result<ManuallyDrop<Tensor>, NRT_STATUS> {
    if t.is_null() {
        return Err(fail(func, NRT_INVALID, "tensor is NULL"));
    }
    // SAFETY: forwarded to our caller.
    unsafe { Tensor::borrow_raw(t.cast()) }
        .ok_or_else(|| fail(func, NRT_INVALID_HANDLE, "not a tensor handle"))
}

/// # Safety
/// A non-null `name` must be a NUL-terminated string.
unsafe fn name_arg(name: *const c_char) -> Option<String> {
    if name.is_null() {
        return None;
    }
    // SAFETY: forwarded to our caller.
    Some(
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    )
}

fn to_usize(func: &str, v: u64) -> Result<usize, NRT_STATUS> {
    usize::try_from(v).map_err(|_| fail(func, NRT_INVALID, "value does not fit in size_t"))
}

macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(s) => return s,
        }
    };
}

/// Allocates a tensor. DEVICE allocates a tdrv buffer on HBM channel `vnc`
/// (0 when negative) of the process-wide device; HOST and VIRTUAL allocate
/// host memory.
///
/// # Safety
/// `name` is NULL or a C string; `tensor` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_allocate(
    placement: nrt_tensor_placement_t,
    vnc: c_int,
    size: usize,
    name: *const c_char,
    tensor: *mut *mut nrt_tensor_t,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_allocate";
    guard(F, || {
        if tensor.is_null() {
            return fail(F, NRT_INVALID, "tensor is NULL");
        }
        // SAFETY: non-null and writable per the contract.
        unsafe { *tensor = std::ptr::null_mut() };
        let placement = match placement {
            NRT_TENSOR_PLACEMENT_DEVICE => Placement::Device,
            NRT_TENSOR_PLACEMENT_HOST => Placement::Host,
            NRT_TENSOR_PLACEMENT_VIRTUAL => Placement::Virtual,
            _ => return fail(F, NRT_INVALID, "unknown placement"),
        };
        // SAFETY: per the contract.
        let name = unsafe { name_arg(name) };
        let channel = u32::try_from(vnc).unwrap_or(0);
        match Tensor::allocate(placement, channel, size, name.as_deref()) {
            Ok(t) => {
                // SAFETY: as above.
                unsafe { *tensor = t.into_raw().cast_mut().cast() };
                NRT_SUCCESS
            }
            Err(e) => status(F, Err(e)),
        }
    })
}

/// Drops the caller's reference and sets `*tensor` to NULL.
///
/// # Safety
/// `tensor` is NULL or points at NULL or at a handle of this library.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_free(tensor: *mut *mut nrt_tensor_t) {
    const F: &str = "nrt_tensor_free";
    guard(F, || {
        if tensor.is_null() {
            return NRT_SUCCESS;
        }
        // SAFETY: non-null per the contract.
        let t = unsafe { *tensor };
        if t.is_null() {
            return NRT_SUCCESS;
        }
        // SAFETY: per the contract.
        if let Err(s) = unsafe { borrow(F, t) } {
            return s;
        }
        // SAFETY: a live handle: this gives back the caller's reference.
        drop(unsafe { Tensor::from_raw(t.cast_const().cast()) });
        // SAFETY: as above.
        unsafe { *tensor = std::ptr::null_mut() };
        NRT_SUCCESS
    });
}

/// # Safety
/// `buf` is valid for writes of `size` bytes (may be NULL when 0).
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_read(
    tensor: *const nrt_tensor_t,
    buf: *mut c_void,
    offset: usize,
    size: usize,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_read";
    guard(F, || {
        // SAFETY: per the contract.
        let t = tri!(unsafe { borrow(F, tensor) });
        if size == 0 {
            return status(F, t.read(offset, &mut []));
        }
        if buf.is_null() {
            return fail(F, NRT_INVALID, "buffer is NULL");
        }
        // SAFETY: valid for `size` bytes per the contract.
        let dst = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), size) };
        status(F, t.read(offset, dst))
    })
}

/// # Safety
/// `buf` is valid for reads of `size` bytes (may be NULL when 0).
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_write(
    tensor: *mut nrt_tensor_t,
    buf: *const c_void,
    offset: usize,
    size: usize,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_write";
    guard(F, || {
        // SAFETY: per the contract.
        let t = tri!(unsafe { borrow(F, tensor) });
        if size == 0 {
            return status(F, t.write(offset, &[]));
        }
        if buf.is_null() {
            return fail(F, NRT_INVALID, "buffer is NULL");
        }
        // SAFETY: valid for `size` bytes per the contract.
        let src = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) };
        status(F, t.write(offset, src))
    })
}

/// Copies between tensors. Device tensors on different HBMs: NRT_INVALID.
///
/// # Safety
/// Tensor pointers are NULL or handles of this library.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_copy(
    src: *const nrt_tensor_t,
    src_offset: usize,
    dst: *mut nrt_tensor_t,
    dst_offset: usize,
    size: usize,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_copy";
    guard(F, || {
        // SAFETY: per the contract.
        let s = tri!(unsafe { borrow(F, src) });
        // SAFETY: per the contract.
        let d = tri!(unsafe { borrow(F, dst) });
        status(F, Tensor::copy(&s, src_offset, &d, dst_offset, size))
    })
}

/// Size of the tensor in bytes; 0 for NULL.
///
/// # Safety
/// `tensor` is NULL or a handle of this library.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_get_size(tensor: *const nrt_tensor_t) -> usize {
    const F: &str = "nrt_tensor_get_size";
    let mut size = 0;
    guard(F, || {
        // SAFETY: per the contract.
        let t = tri!(unsafe { borrow(F, tensor) });
        size = t.size();
        NRT_SUCCESS
    });
    size
}

/// Fills `size` bytes at `offset` with `(unsigned char)value`.
///
/// # Safety
/// `tensor` is NULL or a handle of this library.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_memset(
    tensor: *mut nrt_tensor_t,
    offset: u64,
    value: c_int,
    size: usize,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_memset";
    guard(F, || {
        // SAFETY: per the contract.
        let t = tri!(unsafe { borrow(F, tensor) });
        let offset = tri!(to_usize(F, offset));
        // memset(3) semantics: the value converted to unsigned char.
        status(F, t.memset(offset, value as u8, size))
    })
}

/// A tensor with no storage, to attach a buffer to.
///
/// # Safety
/// `name` is NULL or a C string; `tensor` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_allocate_empty(
    name: *const c_char,
    tensor: *mut *mut nrt_tensor_t,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_allocate_empty";
    guard(F, || {
        if tensor.is_null() {
            return fail(F, NRT_INVALID, "tensor is NULL");
        }
        // SAFETY: per the contract.
        let name = unsafe { name_arg(name) };
        let t = Tensor::allocate_empty(name.as_deref());
        // SAFETY: non-null and writable per the contract.
        unsafe { *tensor = t.into_raw().cast_mut().cast() };
        NRT_SUCCESS
    })
}

/// Makes the tensor cover the caller's buffer, which the library never
/// frees; the storage it had is released (slices made earlier keep it).
/// Fails (NRT_INVALID) while the tensor is in a tensor set: attach first.
///
/// # Safety
/// `buffer` is valid for reads and writes of `size` bytes for as long as
/// the tensor or any slice of it lives; no other call may use this tensor
/// concurrently.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_attach_buffer(
    tensor: *mut nrt_tensor_t,
    buffer: *mut c_void,
    size: usize,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_attach_buffer";
    guard(F, || {
        // SAFETY: per the contract.
        tri!(unsafe { borrow(F, tensor) });
        if buffer.is_null() && size > 0 {
            return fail(F, NRT_INVALID, "buffer is NULL");
        }
        // SAFETY: a live handle; the reference is given back below with
        // `into_raw`, which returns the same pointer (the view is changed
        // in place).
        let mut t = ManuallyDrop::new(unsafe { Tensor::from_raw(tensor.cast_const().cast()) });
        // SAFETY: buffer validity per the contract.
        let r = unsafe { t.attach_buffer(buffer.cast(), size) };
        let back = ManuallyDrop::into_inner(t).into_raw();
        debug_assert_eq!(back, tensor.cast_const().cast());
        status(F, r)
    })
}

/// A slice sharing `source`'s storage.
///
/// # Safety
/// `source` is NULL or a handle; `name` NULL or a C string; `slice` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_allocate_slice(
    source: *const nrt_tensor_t,
    offset: usize,
    size: usize,
    name: *const c_char,
    slice: *mut *mut nrt_tensor_t,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_allocate_slice";
    guard(F, || {
        if slice.is_null() {
            return fail(F, NRT_INVALID, "slice is NULL");
        }
        // SAFETY: non-null and writable per the contract.
        unsafe { *slice = std::ptr::null_mut() };
        // SAFETY: per the contract.
        let src = tri!(unsafe { borrow(F, source) });
        // SAFETY: per the contract.
        let name = unsafe { name_arg(name) };
        match src.slice(offset, size, name.as_deref()) {
            Ok(s) => {
                // SAFETY: as above.
                unsafe { *slice = s.into_raw().cast_mut().cast() };
                NRT_SUCCESS
            }
            Err(e) => status(F, Err(e)),
        }
    })
}

/// Host address of the tensor's first byte; NULL for fake, empty or NULL
/// tensors.
///
/// # Safety
/// `tensor` is NULL or a handle of this library.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_get_va(tensor: *const nrt_tensor_t) -> *mut c_void {
    const F: &str = "nrt_tensor_get_va";
    let mut va = std::ptr::null_mut();
    guard(F, || {
        // SAFETY: per the contract.
        let t = tri!(unsafe { borrow(F, tensor) });
        va = t.va().map_or(std::ptr::null_mut(), |p| p.as_ptr().cast());
        NRT_SUCCESS
    });
    va
}

/// A batch whose handle, pointers and ranges were checked.
type CheckedBatch<'a> = (ManuallyDrop<Tensor>, &'a [nrt_tensor_batch_op_t]);

/// Checks every batch (handles, pointers, ranges) before any byte moves.
///
/// # Safety
/// `batches` is NULL or valid for `num_batches` entries, each with `ops`
/// valid for `num_ops` entries.
unsafe fn check_batches<'a>(
    func: &str,
    batches: *const nrt_tensor_batch_t,
    num_batches: u64,
) -> Result<Vec<CheckedBatch<'a>>, NRT_STATUS> {
    if num_batches == 0 {
        return Ok(Vec::new());
    }
    if batches.is_null() {
        return Err(fail(func, NRT_INVALID, "batches is NULL"));
    }
    let n = to_usize(func, num_batches)?;
    // SAFETY: valid for `n` entries per the contract.
    let batches = unsafe { std::slice::from_raw_parts(batches, n) };
    let mut out = Vec::with_capacity(n);
    for b in batches {
        // SAFETY: per the contract.
        let t = unsafe { borrow(func, b.tensor) }?;
        let ops: &[nrt_tensor_batch_op_t] = match (b.ops.is_null(), b.num_ops) {
            (_, 0) => &[],
            (true, _) => return Err(fail(func, NRT_INVALID, "batch ops is NULL")),
            // SAFETY: valid for `num_ops` entries per the contract.
            (false, n) => unsafe { std::slice::from_raw_parts(b.ops, n as usize) },
        };
        for op in ops {
            let (offset, size) = (to_usize(func, op.offset)?, to_usize(func, op.size)?);
            if op.buffer.is_null() && size > 0 {
                return Err(fail(func, NRT_INVALID, "batch op buffer is NULL"));
            }
            match offset.checked_add(size) {
                Some(end) if end <= t.size() => {}
                _ => {
                    return Err(fail(
                        func,
                        NRT_INVALID,
                        &format!(
                            "bytes [{offset}, +{size}) are outside the {}-byte tensor {:?}",
                            t.size(),
                            t.name()
                        ),
                    ))
                }
            }
        }
        out.push((t, ops));
    }
    Ok(out)
}

/// Reads several ranges of several tensors; each tensor is fenced once
/// (not at all with `unsafe_`). The destination buffers of one batch must
/// not overlap.
///
/// # Safety
/// See `check_batches`; each op buffer is valid for writes of its size.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_read_batch(
    batches: *const nrt_tensor_batch_t,
    num_batches: u64,
    unsafe_: bool,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_read_batch";
    guard(F, || {
        // SAFETY: per the contract.
        let checked = tri!(unsafe { check_batches(F, batches, num_batches) });
        let fencing = if unsafe_ {
            Fencing::Skip
        } else {
            Fencing::Wait
        };
        for (t, ops) in checked {
            let mut rops: Vec<ReadOp<'_>> = ops
                .iter()
                .map(|op| ReadOp {
                    offset: op.offset as usize,
                    buf: if op.size == 0 {
                        &mut []
                    } else {
                        // SAFETY: non-null (checked) and valid for `size`
                        // bytes per the contract.
                        unsafe {
                            std::slice::from_raw_parts_mut(op.buffer.cast(), op.size as usize)
                        }
                    },
                })
                .collect();
            let s = status(F, t.read_batch(&mut rops, fencing));
            if s != NRT_SUCCESS {
                return s;
            }
        }
        NRT_SUCCESS
    })
}

/// Writes several ranges of several tensors; each tensor is fenced once
/// (not at all with `unsafe_`).
///
/// # Safety
/// See `check_batches`; each op buffer is valid for reads of its size.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_write_batch(
    batches: *const nrt_tensor_batch_t,
    num_batches: u64,
    unsafe_: bool,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_write_batch";
    guard(F, || {
        // SAFETY: per the contract.
        let checked = tri!(unsafe { check_batches(F, batches, num_batches) });
        let fencing = if unsafe_ {
            Fencing::Skip
        } else {
            Fencing::Wait
        };
        for (t, ops) in checked {
            let wops: Vec<WriteOp<'_>> = ops
                .iter()
                .map(|op| WriteOp {
                    offset: op.offset as usize,
                    buf: if op.size == 0 {
                        &[]
                    } else {
                        // SAFETY: non-null (checked) and valid for `size`
                        // bytes per the contract.
                        unsafe { std::slice::from_raw_parts(op.buffer.cast(), op.size as usize) }
                    },
                })
                .collect();
            let s = status(F, t.write_batch(&wops, fencing));
            if s != NRT_SUCCESS {
                return s;
            }
        }
        NRT_SUCCESS
    })
}

/// Physical address, size and HBM of a device tensor; NRT_INVALID for
/// other tensors.
///
/// # Safety
/// `tensor` is NULL or a handle; `info` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_get_device_allocation_info(
    tensor: *const nrt_tensor_t,
    info: *mut nrt_tensor_device_allocation_info_t,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_get_device_allocation_info";
    guard(F, || {
        // SAFETY: per the contract.
        let t = tri!(unsafe { borrow(F, tensor) });
        if info.is_null() {
            return fail(F, NRT_INVALID, "info is NULL");
        }
        match t.device_allocation_info() {
            Ok(i) => {
                // SAFETY: non-null and writable per the contract.
                unsafe {
                    *info = nrt_tensor_device_allocation_info_t {
                        physical_address: i.physical_address,
                        size: i.size,
                        hbm_index: c_int::try_from(i.hbm_index).unwrap_or(-1),
                    }
                };
                NRT_SUCCESS
            }
            Err(e) => status(F, Err(e)),
        }
    })
}

/// Waits until the output tensor's completion count reaches `expected`:
/// NRT_SUCCESS, NRT_TIMEOUT, or NRT_INVALID for a NULL tensor. Negative
/// timeouts wait forever (with a warning every 30 s), 0 polls.
///
/// # Safety
/// `output` is NULL or a handle of this library.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_check_output_completion(
    output: *const nrt_tensor_t,
    timeout_us: i64,
    expected_completion_count: u64,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_check_output_completion";
    guard(F, || {
        // SAFETY: per the contract.
        let t = tri!(unsafe { borrow(F, output) });
        match t.check_output_completion(timeout_us, expected_completion_count) {
            Ok(()) => NRT_SUCCESS,
            // A time-out is an answer, not an error worth a log line.
            Err(e) if e.is_timeout() => NRT_TIMEOUT,
            Err(e) => status(F, Err(e)),
        }
    })
}

/// Sets the output tensor's completion count to 0.
///
/// # Safety
/// `output` is NULL or a handle of this library.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_reset_output_completion(
    output: *mut nrt_tensor_t,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_reset_output_completion";
    guard(F, || {
        // SAFETY: per the contract.
        let t = tri!(unsafe { borrow(F, output) });
        status(F, t.reset_output_completion())
    })
}

const SET_MAGIC: u64 = 0x7464_7276_5f73_6574; // "tdrv_set"

struct CTensorSet {
    magic: u64,
    set: Mutex<TensorSet>,
}

impl Drop for CTensorSet {
    fn drop(&mut self) {
        self.magic = 0;
    }
}

/// # Safety
/// A non-null `set` must be readable (a pointer from this library).
unsafe fn borrow_set<'a>(
    func: &str,
    set: *mut nrt_tensor_set_t,
) -> Result<&'a CTensorSet, NRT_STATUS> {
    if set.is_null() {
        return Err(fail(func, NRT_INVALID, "tensor set is NULL"));
    }
    // SAFETY: readable per the contract.
    let s = unsafe { &*set.cast::<CTensorSet>() };
    if s.magic != SET_MAGIC {
        return Err(fail(func, NRT_INVALID_HANDLE, "not a tensor set"));
    }
    Ok(s)
}

/// # Safety
/// `result` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn nrt_allocate_tensor_set(result: *mut *mut nrt_tensor_set_t) -> NRT_STATUS {
    const F: &str = "nrt_allocate_tensor_set";
    guard(F, || {
        if result.is_null() {
            return fail(F, NRT_INVALID, "result is NULL");
        }
        let set = Box::new(CTensorSet {
            magic: SET_MAGIC,
            set: Mutex::new(TensorSet::new()),
        });
        // SAFETY: non-null and writable per the contract.
        unsafe { *result = Box::into_raw(set).cast() };
        NRT_SUCCESS
    })
}

/// Destroys the set (dropping its references, not the caller's) and sets
/// `*tensor_set` to NULL.
///
/// # Safety
/// `tensor_set` is NULL or points at NULL or at a set of this library.
#[no_mangle]
pub unsafe extern "C" fn nrt_destroy_tensor_set(tensor_set: *mut *mut nrt_tensor_set_t) {
    const F: &str = "nrt_destroy_tensor_set";
    guard(F, || {
        if tensor_set.is_null() {
            return NRT_SUCCESS;
        }
        // SAFETY: non-null per the contract.
        let set = unsafe { *tensor_set };
        if set.is_null() {
            return NRT_SUCCESS;
        }
        // SAFETY: per the contract.
        tri!(unsafe { borrow_set(F, set) });
        // SAFETY: a live set made by Box::into_raw, freed once here.
        drop(unsafe { Box::from_raw(set.cast::<CTensorSet>()) });
        // SAFETY: as above.
        unsafe { *tensor_set = std::ptr::null_mut() };
        NRT_SUCCESS
    });
}

/// Adds `tensor` under `name` (replacing any tensor of that name). The set
/// takes a reference of its own.
///
/// # Safety
/// Pointers are NULL or objects of this library; `name` a C string.
#[no_mangle]
pub unsafe extern "C" fn nrt_add_tensor_to_tensor_set(
    set: *mut nrt_tensor_set_t,
    name: *const c_char,
    tensor: *mut nrt_tensor_t,
) -> NRT_STATUS {
    const F: &str = "nrt_add_tensor_to_tensor_set";
    guard(F, || {
        // SAFETY: per the contract.
        let s = tri!(unsafe { borrow_set(F, set) });
        // SAFETY: per the contract.
        let Some(name) = (unsafe { name_arg(name) }) else {
            return fail(F, NRT_INVALID, "name is NULL");
        };
        // SAFETY: per the contract.
        let t = tri!(unsafe { borrow(F, tensor) });
        let old = s
            .set
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(&name, Tensor::clone(&t));
        drop(old);
        NRT_SUCCESS
    })
}

/// Looks a tensor up by name: the pointer that was added, or NRT_FAILURE
/// when no tensor has that name.
///
/// # Safety
/// Pointers are NULL or objects of this library; `name` a C string;
/// `tensor` writable.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_tensor_from_tensor_set(
    set: *mut nrt_tensor_set_t,
    name: *const c_char,
    tensor: *mut *mut nrt_tensor_t,
) -> NRT_STATUS {
    const F: &str = "nrt_get_tensor_from_tensor_set";
    guard(F, || {
        if tensor.is_null() {
            return fail(F, NRT_INVALID, "tensor is NULL");
        }
        // SAFETY: non-null and writable per the contract.
        unsafe { *tensor = std::ptr::null_mut() };
        // SAFETY: per the contract.
        let s = tri!(unsafe { borrow_set(F, set) });
        // SAFETY: per the contract.
        let Some(name) = (unsafe { name_arg(name) }) else {
            return fail(F, NRT_INVALID, "name is NULL");
        };
        let set = s.set.lock().unwrap_or_else(|e| e.into_inner());
        match set.get(&name) {
            Some(t) => {
                // SAFETY: as above. The set keeps this view alive.
                unsafe { *tensor = t.as_raw().cast_mut().cast() };
                NRT_SUCCESS
            }
            None => fail(
                F,
                NRT_FAILURE,
                &format!("no tensor named {name:?} in the set"),
            ),
        }
    })
}
