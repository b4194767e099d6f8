// SPDX-License-Identifier: MIT OR Apache-2.0
//! `libnrt.so.1`: the nrt_tensor C ABI of the Neuron runtime, over the tdrv
//! tensor layer. The declarations are in `include/nrt/nrt.h` and
//! `include/nrt/nrt_status.h`, libnrt's header layout, and tdrv's copy jobs
//! (module [`job`]) in `include/tdrv/job.h`.
//!
//! Conventions of every entry point:
//! - NULL or otherwise invalid arguments return an error status; a tensor
//!   or set pointer that is not a live handle of this library (freed
//!   already, foreign, garbage) is `NRT_INVALID_HANDLE`; nothing asserts;
//! - a Rust panic never crosses the boundary: it becomes `NRT_FAILURE`;
//! - errors are logged to stderr as `nrt: <function>: <message>` unless
//!   `NEURON_RT_LOG_LEVEL` is `OFF`, `NONE` or `FATAL`.
//!
//! Handles: an `nrt_tensor_t *` or `nrt_tensor_set_t *` is an opaque token
//! of a [`tdrv::handles::HandleTable`], never dereferenced: every entry
//! point looks it up first, so a stale or foreign pointer is
//! `NRT_INVALID_HANDLE` and a double `nrt_tensor_free` is a logged error,
//! not a double free. A tensor set holds references of its own, so a tensor
//! stays valid while it is in a set, and `nrt_get_tensor_from_tensor_set`
//! returns the same pointer that was added.
//!
//! Caller memory (the buffers of read, write and the batches) is only ever
//! reached through raw pointers and copied with memmove semantics: buffers
//! may overlap each other and the tensors' own memory (see `nrt/nrt.h`).

#![allow(non_camel_case_types)]
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use tdrv::compat::TensorCompat;
use tdrv::handles::{HandleTable, HandlesMut};
use tdrv::ops::TensorOps;
use tdrv::{Error, Fencing, Placement, RawReadOp, RawWriteOp, SysError, Tensor};

/// Status codes (`NRT_STATUS`, `nrt/nrt_status.h`): every value of
/// libnrt's enum, including those of model loading and execution that this
/// library never returns.
pub type NRT_STATUS = c_int;
pub const NRT_SUCCESS: NRT_STATUS = 0;
pub const NRT_FAILURE: NRT_STATUS = 1;
pub const NRT_INVALID: NRT_STATUS = 2;
pub const NRT_INVALID_HANDLE: NRT_STATUS = 3;
pub const NRT_RESOURCE: NRT_STATUS = 4;
pub const NRT_TIMEOUT: NRT_STATUS = 5;
pub const NRT_HW_ERROR: NRT_STATUS = 6;
pub const NRT_QUEUE_FULL: NRT_STATUS = 7;
pub const NRT_LOAD_NOT_ENOUGH_NC: NRT_STATUS = 9;
pub const NRT_UNSUPPORTED_NEFF_VERSION: NRT_STATUS = 10;
pub const NRT_FAIL_HOST_MEM_ALLOC: NRT_STATUS = 11;
pub const NRT_UNINITIALIZED: NRT_STATUS = 13;
pub const NRT_CLOSED: NRT_STATUS = 14;
pub const NRT_QUEUE_EMPTY: NRT_STATUS = 15;
pub const NRT_EXEC_UNIT_UNRECOVERABLE: NRT_STATUS = 101;
pub const NRT_EXEC_BAD_INPUT: NRT_STATUS = 1002;
pub const NRT_EXEC_COMPLETED_WITH_NUM_ERR: NRT_STATUS = 1003;
pub const NRT_EXEC_COMPLETED_WITH_ERR: NRT_STATUS = 1004;
pub const NRT_EXEC_NC_BUSY: NRT_STATUS = 1005;
pub const NRT_EXEC_OOB: NRT_STATUS = 1006;
pub const NRT_COLL_PENDING: NRT_STATUS = 1100;
pub const NRT_EXEC_HW_ERR_COLLECTIVES: NRT_STATUS = 1200;
pub const NRT_EXEC_HW_ERR_HBM_UE: NRT_STATUS = 1201;
pub const NRT_EXEC_HW_ERR_NC_UE: NRT_STATUS = 1202;
pub const NRT_EXEC_HW_ERR_DMA_ABORT: NRT_STATUS = 1203;
pub const NRT_EXEC_SW_NQ_OVERFLOW: NRT_STATUS = 1204;
pub const NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE: NRT_STATUS = 1205;
pub const NRT_NETWORK_PROXY_FAILURE: NRT_STATUS = 1206;

/// Every status with its name, for `nrt_get_status_as_str`. The names are
/// NUL-terminated so that the C function can return them as they are.
const STATUS_NAMES: &[(NRT_STATUS, &CStr)] = &[
    (NRT_SUCCESS, c"NRT_SUCCESS"),
    (NRT_FAILURE, c"NRT_FAILURE"),
    (NRT_INVALID, c"NRT_INVALID"),
    (NRT_INVALID_HANDLE, c"NRT_INVALID_HANDLE"),
    (NRT_RESOURCE, c"NRT_RESOURCE"),
    (NRT_TIMEOUT, c"NRT_TIMEOUT"),
    (NRT_HW_ERROR, c"NRT_HW_ERROR"),
    (NRT_QUEUE_FULL, c"NRT_QUEUE_FULL"),
    (NRT_LOAD_NOT_ENOUGH_NC, c"NRT_LOAD_NOT_ENOUGH_NC"),
    (
        NRT_UNSUPPORTED_NEFF_VERSION,
        c"NRT_UNSUPPORTED_NEFF_VERSION",
    ),
    (NRT_FAIL_HOST_MEM_ALLOC, c"NRT_FAIL_HOST_MEM_ALLOC"),
    (NRT_UNINITIALIZED, c"NRT_UNINITIALIZED"),
    (NRT_CLOSED, c"NRT_CLOSED"),
    (NRT_QUEUE_EMPTY, c"NRT_QUEUE_EMPTY"),
    (NRT_EXEC_UNIT_UNRECOVERABLE, c"NRT_EXEC_UNIT_UNRECOVERABLE"),
    (NRT_EXEC_BAD_INPUT, c"NRT_EXEC_BAD_INPUT"),
    (
        NRT_EXEC_COMPLETED_WITH_NUM_ERR,
        c"NRT_EXEC_COMPLETED_WITH_NUM_ERR",
    ),
    (NRT_EXEC_COMPLETED_WITH_ERR, c"NRT_EXEC_COMPLETED_WITH_ERR"),
    (NRT_EXEC_NC_BUSY, c"NRT_EXEC_NC_BUSY"),
    (NRT_EXEC_OOB, c"NRT_EXEC_OOB"),
    (NRT_COLL_PENDING, c"NRT_COLL_PENDING"),
    (NRT_EXEC_HW_ERR_COLLECTIVES, c"NRT_EXEC_HW_ERR_COLLECTIVES"),
    (NRT_EXEC_HW_ERR_HBM_UE, c"NRT_EXEC_HW_ERR_HBM_UE"),
    (NRT_EXEC_HW_ERR_NC_UE, c"NRT_EXEC_HW_ERR_NC_UE"),
    (NRT_EXEC_HW_ERR_DMA_ABORT, c"NRT_EXEC_HW_ERR_DMA_ABORT"),
    (NRT_EXEC_SW_NQ_OVERFLOW, c"NRT_EXEC_SW_NQ_OVERFLOW"),
    (
        NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE,
        c"NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE",
    ),
    (NRT_NETWORK_PROXY_FAILURE, c"NRT_NETWORK_PROXY_FAILURE"),
];

/// The name of a status (`"NRT_TIMEOUT"`), or `"UNKNOWN STATUS"`. The
/// string is static; the caller never frees it.
#[no_mangle]
pub extern "C" fn nrt_get_status_as_str(status: NRT_STATUS) -> *const c_char {
    STATUS_NAMES
        .iter()
        .find(|(s, _)| *s == status)
        .map_or(c"UNKNOWN STATUS", |(_, name)| name)
        .as_ptr()
}

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

/// Opaque copy job (`tdrv/job.h`).
#[repr(C)]
pub struct tdrv_job_t {
    _private: [u8; 0],
}

/// A completion event (`tdrv/job.h`, `tdrv_read_events`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tdrv_job_event_t {
    pub user_data: u64,
    pub status: NRT_STATUS,
}

/// `ndl/neuron_driver_shared_tensor_batch_op.h`, where the public headers
/// define it.
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
        // libnrt tells host memory apart from the device's (NRT_RESOURCE).
        Error::OutOfMemory(_) => NRT_FAIL_HOST_MEM_ALLOC,
        Error::OutOfBounds { .. }
        | Error::Overflow { .. }
        | Error::NoStorage { .. }
        | Error::Unsupported { .. }
        | Error::CrossChannel { .. }
        | Error::InvalidArgument(_)
        | Error::SharedView(_) => NRT_INVALID,
        // Only reachable with Rust accessors open in the same process.
        Error::Busy { .. } => NRT_FAILURE,
        Error::NoDmaAddress { .. } => NRT_FAILURE,
        Error::Sys(s) => match s {
            SysError::TimedOut { .. } => NRT_TIMEOUT,
            SysError::NoMemory { .. } | SysError::NoSpace { .. } | SysError::TooManyJobs { .. } => {
                NRT_RESOURCE
            }
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
        Error::DeviceAlloc { source, .. } => status_of(&Error::Sys(source.clone())),
        Error::JobFailed { .. } | Error::DeviceWriteFailed { .. } => NRT_HW_ERROR,
        Error::Io { .. } => NRT_FAILURE,
        _ => NRT_FAILURE,
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

/// Environment variable naming the device node of
/// `NRT_TENSOR_PLACEMENT_DEVICE` (default `/dev/tdrv0`).
pub const DEVICE_ENV: &str = "TDRV_DEVICE";
/// Environment variable naming a Chrome trace file, written at exit.
pub const TRACE_FILE_ENV: &str = "TDRV_TRACE_FILE";
/// Environment variable naming the job input dump directory.
pub const INPUT_DUMP_ENV: &str = "NEURON_RT_DBG_INPUT_DUMP_DIRECTORY";

static TRACE_SINK: OnceLock<Arc<tdrv::trace::ChromeTraceSink>> = OnceLock::new();

extern "C" fn finish_trace_file() {
    if let Some(sink) = TRACE_SINK.get() {
        let _ = catch_unwind(|| sink.finish());
    }
}

fn env_path(var: &str) -> Option<std::path::PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
}

/// What the C library does at its first call, and the Rust crate never
/// does by itself (the environment and exit hooks are the C library's):
///
/// - the tensor layer logs through the `log` crate, which a C program never
///   sets up: print its warnings and errors to stderr as `tdrv: <level>:
///   <message>`, unless `NEURON_RT_LOG_LEVEL` silences logging;
/// - `TDRV_DEVICE`: the node of the DEVICE placement;
/// - `NEURON_RT_DBG_INPUT_DUMP_DIRECTORY`: the job input dump directory;
/// - `TDRV_TRACE_FILE`: a Chrome trace file, finished by an `atexit` hook.
fn init_from_env() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tdrv::set_logger(Some(Box::new(|level, msg| {
            if level <= tdrv::Level::Warn && logging_enabled() {
                eprintln!("tdrv: {level}: {msg}");
            }
        })));
        if let Some(p) = env_path(DEVICE_ENV) {
            tdrv::set_default_device_path(Some(p));
        }
        if let Some(p) = env_path(INPUT_DUMP_ENV) {
            tdrv::dump::set_input_dump_directory(Some(p));
        }
        if let Some(p) = env_path(TRACE_FILE_ENV) {
            match tdrv::trace::ChromeTraceSink::create(&p) {
                Ok(sink) => {
                    let sink = Arc::new(sink);
                    let _ = TRACE_SINK.set(sink.clone());
                    tdrv::trace::set_sink(Some(sink));
                    // SAFETY: `finish_trace_file` is an `extern "C" fn()`
                    // that never unwinds; atexit has no other requirement.
                    unsafe { libc::atexit(finish_trace_file) };
                }
                Err(e) => log_error(TRACE_FILE_ENV, &format!("{}: {e}", p.display())),
            }
        }
    });
}

/// Runs an entry point, turning a panic into `NRT_FAILURE`.
fn guard(func: &str, f: impl FnOnce() -> NRT_STATUS) -> NRT_STATUS {
    init_from_env();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(s) => s,
        Err(_) => fail(func, NRT_FAILURE, "internal error (panic)"),
    }
}

/// What a live handle stands for.
enum Handle {
    Tensor(HeldTensor),
    /// A set: names to tensor handles (each holding a set reference).
    Set(HashMap<String, usize>),
}

/// A tensor handle: the caller's reference (until `nrt_tensor_free`) and
/// the references of the sets it is in.
struct HeldTensor {
    user: Option<Tensor>,
    /// A quiet handle, held while `set_refs > 0`.
    in_sets: Option<Tensor>,
    set_refs: u32,
}

impl HeldTensor {
    fn tensor(&self) -> Option<&Tensor> {
        self.user.as_ref().or(self.in_sets.as_ref())
    }
}

fn handles() -> &'static HandleTable<Handle> {
    static HANDLES: OnceLock<HandleTable<Handle>> = OnceLock::new();
    HANDLES.get_or_init(HandleTable::new)
}

fn token<T>(p: *const T) -> usize {
    p.addr()
}

/// The handle a `*_free(T **slot)`-style call is asked to free: `None`
/// (nothing to do, as C's `free(NULL)`) when `slot` or `*slot` is NULL.
///
/// # Safety
/// `slot` is NULL or a readable `*mut T` variable.
pub(crate) unsafe fn handle_in<T>(slot: *mut *mut T) -> Option<*mut T> {
    if slot.is_null() {
        return None;
    }
    // SAFETY: non-null and readable per the contract.
    let h = unsafe { *slot };
    (!h.is_null()).then_some(h)
}

fn as_handle<T>(token: usize) -> *mut T {
    std::ptr::without_provenance_mut(token)
}

/// Registers a new tensor handle for the caller.
fn register(func: &str, t: Tensor) -> Result<*mut nrt_tensor_t, NRT_STATUS> {
    handles()
        .insert(Handle::Tensor(HeldTensor {
            user: Some(t),
            in_sets: None,
            set_refs: 0,
        }))
        .map(as_handle)
        .map_err(|e| {
            log_error(func, &e);
            status_of(&e)
        })
}

/// The tensor behind a handle, as a quiet handle of our own (so a
/// concurrent `nrt_tensor_free` cannot free it under us): NULL is
/// `NRT_INVALID`, anything but a live tensor handle `NRT_INVALID_HANDLE`.
/// Never dereferences `t`.
fn borrow(func: &str, t: *const nrt_tensor_t) -> Result<Tensor, NRT_STATUS> {
    if t.is_null() {
        return Err(fail(func, NRT_INVALID, "tensor is NULL"));
    }
    handles()
        .get(token(t), |h| match h {
            Handle::Tensor(held) => held.tensor().map(Tensor::clone_quiet),
            Handle::Set(_) => None,
        })
        .flatten()
        .ok_or_else(|| {
            fail(
                func,
                NRT_INVALID_HANDLE,
                "not a live tensor handle (freed already, or not from this library)",
            )
        })
}

/// The tensor behind a C handle, for Rust code sharing the process with C
/// callers (tests, embedders); `None` unless `t` is a live tensor handle.
/// The pointer is never dereferenced.
pub fn tensor_from_handle(t: *const nrt_tensor_t) -> Option<Tensor> {
    handles()
        .get(token(t), |h| match h {
            Handle::Tensor(held) => held.tensor().cloned(),
            Handle::Set(_) => None,
        })
        .flatten()
}

/// Number of live tensor and set handles (for leak checks in tests).
pub fn live_handles() -> usize {
    handles().len()
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
        let t = match Tensor::allocate(placement, channel, size, name.as_deref()) {
            Ok(t) => t,
            Err(e) => return status(F, Err(e)),
        };
        let h = tri!(register(F, t));
        // SAFETY: as above.
        unsafe { *tensor = h };
        NRT_SUCCESS
    })
}

/// Drops the caller's reference and sets `*tensor` to NULL. A pointer that
/// is not a live tensor handle (a second free included) is logged and left
/// alone.
///
/// # Safety
/// `tensor` is NULL or a writable `nrt_tensor_t *` variable.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_free(tensor: *mut *mut nrt_tensor_t) {
    const F: &str = "nrt_tensor_free";
    guard(F, || {
        // SAFETY: per this function's contract.
        let Some(t) = (unsafe { handle_in(tensor) }) else {
            return NRT_SUCCESS;
        };
        let tok = token(t);
        let freed = {
            let mut h = handles().lock();
            match h.get_mut(tok) {
                Some(Handle::Tensor(held)) => match held.user.take() {
                    Some(user) => {
                        if held.set_refs == 0 {
                            h.remove(tok);
                        }
                        Ok(user)
                    }
                    None => Err("the tensor was freed already (a set still holds it)"),
                },
                Some(Handle::Set(_)) => Err("a tensor set, not a tensor"),
                None => Err("not a live tensor handle (freed already?)"),
            }
        };
        match freed {
            Ok(user) => {
                // Dropped outside the table's lock: this may free storage.
                drop(user);
                // SAFETY: as above.
                unsafe { *tensor = std::ptr::null_mut() };
                NRT_SUCCESS
            }
            Err(msg) => fail(F, NRT_INVALID_HANDLE, msg),
        }
    });
}

/// # Safety
/// `buf` is valid for writes of `size` bytes (may be NULL when 0), and no
/// other thread accesses them during the call; it may overlap any tensor's
/// memory.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_read(
    tensor: *const nrt_tensor_t,
    buf: *mut c_void,
    offset: usize,
    size: usize,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_read";
    guard(F, || {
        let t = tri!(borrow(F, tensor));
        if buf.is_null() && size > 0 {
            return fail(F, NRT_INVALID, "buffer is NULL");
        }
        // SAFETY: valid for `size` bytes per the contract; only a raw
        // pointer is made, never a reference to the caller's memory.
        status(F, unsafe { t.read_raw(offset, buf.cast(), size) })
    })
}

/// # Safety
/// `buf` is valid for reads of `size` bytes (may be NULL when 0), and no
/// other thread writes them during the call; it may overlap any tensor's
/// memory.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_write(
    tensor: *mut nrt_tensor_t,
    buf: *const c_void,
    offset: usize,
    size: usize,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_write";
    guard(F, || {
        let t = tri!(borrow(F, tensor));
        if buf.is_null() && size > 0 {
            return fail(F, NRT_INVALID, "buffer is NULL");
        }
        // SAFETY: valid for `size` bytes per the contract; raw pointer only.
        status(F, unsafe { t.write_raw(offset, buf.cast(), size) })
    })
}

/// Copies between tensors. Device tensors on different HBMs: NRT_INVALID.
#[no_mangle]
pub extern "C" fn nrt_tensor_copy(
    src: *const nrt_tensor_t,
    src_offset: usize,
    dst: *mut nrt_tensor_t,
    dst_offset: usize,
    size: usize,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_copy";
    guard(F, || {
        let s = tri!(borrow(F, src));
        let d = tri!(borrow(F, dst));
        status(F, Tensor::copy(&s, src_offset, &d, dst_offset, size))
    })
}

/// Size of the tensor in bytes; 0 for NULL or an invalid handle.
#[no_mangle]
pub extern "C" fn nrt_tensor_get_size(tensor: *const nrt_tensor_t) -> usize {
    const F: &str = "nrt_tensor_get_size";
    let mut size = 0;
    guard(F, || {
        // A lookup without a clone: the cheapest entry point.
        let got = handles().get(token(tensor), |h| match h {
            Handle::Tensor(held) => held.tensor().map(Tensor::size),
            Handle::Set(_) => None,
        });
        match got.flatten() {
            Some(s) => {
                size = s;
                NRT_SUCCESS
            }
            None => tri!(borrow(F, tensor).map(|_| NRT_SUCCESS)),
        }
    });
    size
}

/// Fills `size` bytes at `offset` with `(unsigned char)value`.
#[no_mangle]
pub extern "C" fn nrt_tensor_memset(
    tensor: *mut nrt_tensor_t,
    offset: u64,
    value: c_int,
    size: usize,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_memset";
    guard(F, || {
        let t = tri!(borrow(F, tensor));
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
        // SAFETY: non-null and writable per the contract.
        unsafe { *tensor = std::ptr::null_mut() };
        // SAFETY: per the contract.
        let name = unsafe { name_arg(name) };
        let t = match Tensor::allocate_empty(name.as_deref()) {
            Ok(t) => t,
            Err(e) => return status(F, Err(e)),
        };
        let h = tri!(register(F, t));
        // SAFETY: as above.
        unsafe { *tensor = h };
        NRT_SUCCESS
    })
}

/// Makes the tensor cover the caller's buffer, which the library never
/// frees; the storage it had is released (slices made earlier keep it).
/// Fails (NRT_INVALID) while the tensor is in a tensor set or another call
/// uses it: attach first.
///
/// # Safety
/// `buffer` is valid for reads and writes of `size` bytes for as long as
/// the tensor or any slice of it lives, and not accessed by other means
/// while a call of this library copies to or from it.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_attach_buffer(
    tensor: *mut nrt_tensor_t,
    buffer: *mut c_void,
    size: usize,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_attach_buffer";
    guard(F, || {
        if tensor.is_null() {
            return fail(F, NRT_INVALID, "tensor is NULL");
        }
        if buffer.is_null() && size > 0 {
            return fail(F, NRT_INVALID, "buffer is NULL");
        }
        let mut h = handles().lock();
        let r = match h.get_mut(token(tensor)) {
            Some(Handle::Tensor(HeldTensor {
                user: Some(t),
                in_sets: None,
                ..
            })) => {
                // SAFETY: buffer validity per the contract.
                unsafe { t.attach_buffer(buffer.cast(), size) }
            }
            Some(Handle::Tensor(HeldTensor { user: Some(t), .. })) => {
                Err(Error::SharedView(t.name().to_owned()))
            }
            _ => {
                drop(h);
                return fail(F, NRT_INVALID_HANDLE, "not a live tensor handle");
            }
        };
        drop(h);
        status(F, r)
    })
}

/// A slice sharing `source`'s storage.
///
/// # Safety
/// `name` is NULL or a C string; `slice` NULL or writable.
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
        let src = tri!(borrow(F, source));
        // SAFETY: per the contract.
        let name = unsafe { name_arg(name) };
        let s = match src.slice(offset, size, name.as_deref()) {
            Ok(s) => s,
            Err(e) => return status(F, Err(e)),
        };
        let h = tri!(register(F, s));
        // SAFETY: as above.
        unsafe { *slice = h };
        NRT_SUCCESS
    })
}

/// Host address of the tensor's first byte; NULL for fake, empty, NULL or
/// invalid tensors.
#[no_mangle]
pub extern "C" fn nrt_tensor_get_va(tensor: *const nrt_tensor_t) -> *mut c_void {
    const F: &str = "nrt_tensor_get_va";
    let mut va = std::ptr::null_mut();
    guard(F, || {
        let t = tri!(borrow(F, tensor));
        va = t.va().map_or(std::ptr::null_mut(), |p| p.as_ptr().cast());
        NRT_SUCCESS
    });
    va
}

/// Where a caller's address lies in a live device tensor of this library.
struct DeviceRange {
    /// A quiet handle of the tensor (view) whose memory holds the range.
    tensor: Tensor,
    /// The range's offset in that view.
    offset: usize,
    /// Address of the first byte of the view's whole device allocation
    /// (the start of its dma-buf).
    alloc_base: u64,
}

/// The live device tensor of this library whose view holds `[va, va +
/// size)`, if any. Only tensors whose buffer is already mapped are looked
/// at (`Tensor::mapped_va`): a caller's address came from
/// `nrt_tensor_get_va`, which mapped it, so mapping every other buffer to
/// compare (as this once did) finds nothing more and costs a mapping each.
fn device_range(va: u64, size: u64) -> Option<DeviceRange> {
    let end = va.checked_add(size)?;
    handles().find_map(|h| {
        let Handle::Tensor(held) = h else {
            return None;
        };
        let t = held.tensor()?;
        t.device()?;
        let start = t.mapped_va()?.as_ptr() as u64;
        let stop = start.checked_add(t.size() as u64)?;
        if va < start || end > stop {
            return None;
        }
        Some(DeviceRange {
            tensor: t.clone_quiet(),
            offset: usize::try_from(va - start).ok()?,
            alloc_base: start.checked_sub(t.offset() as u64)?,
        })
    })
}

/// A dma-buf fd (`*fd`, O_RDWR, close-on-exec) for the device allocation
/// that starts at `va`; see `nrt/nrt.h` for the contract (libfabric's).
///
/// # Safety
/// `fd` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_dmabuf_fd(va: u64, size: u64, fd: *mut c_int) -> NRT_STATUS {
    const F: &str = "nrt_get_dmabuf_fd";
    guard(F, || {
        if fd.is_null() {
            return fail(F, NRT_INVALID, "fd is NULL");
        }
        if size == 0 {
            return fail(F, NRT_INVALID, "size is 0");
        }
        let Some(r) = device_range(va, size) else {
            return fail(
                F,
                NRT_INVALID,
                "the range is not inside the memory of one device tensor",
            );
        };
        if va != r.alloc_base {
            // The dma-buf starts at the allocation's first byte, and its
            // users (libfabric) take the address they asked for to be at
            // offset 0 of it.
            return fail(
                F,
                NRT_INVALID,
                "va is inside a device allocation but not at its start (where its dma-buf begins)",
            );
        }
        match r.tensor.export_dmabuf() {
            Ok(owned) => {
                // SAFETY: non-null and writable per the contract; the
                // caller owns the fd from here.
                unsafe { fd.write(std::os::fd::IntoRawFd::into_raw_fd(owned)) };
                NRT_SUCCESS
            }
            Err(Error::Sys(SysError::Os { errno, .. }))
                if errno == libc::EMFILE || errno == libc::ENFILE =>
            {
                fail(F, NRT_RESOURCE, "out of file descriptors")
            }
            Err(e) => status(F, Err(e)),
        }
    })
}

/// Copies `size` bytes from host memory at `src` to device memory at
/// `dest`, an address inside a device tensor of this library (from
/// `nrt_tensor_get_va`); see `nrt/nrt.h`.
///
/// # Safety
/// `src` is valid for reads of `size` bytes (may be NULL when 0), and no
/// other thread writes them during the call; it may overlap any tensor's
/// memory. `dest` is only compared with the tensors' addresses, never
/// dereferenced as given.
#[no_mangle]
pub unsafe extern "C" fn nrt_memcpy_to_device(
    dest: *mut c_void,
    src: *const c_void,
    size: usize,
) -> NRT_STATUS {
    const F: &str = "nrt_memcpy_to_device";
    guard(F, || {
        if size == 0 {
            return NRT_SUCCESS;
        }
        if src.is_null() || dest.is_null() {
            return fail(F, NRT_INVALID, "dest or src is NULL");
        }
        let Some(r) = device_range(dest.addr() as u64, size as u64) else {
            return fail(
                F,
                NRT_INVALID,
                "[dest, dest + size) is not inside the memory of one device tensor",
            );
        };
        // SAFETY: `src` is valid for `size` bytes per the contract; raw
        // pointer only. The destination is the tensor's own memory, found
        // by address and written through the tensor (fenced like
        // nrt_tensor_write).
        status(F, unsafe { r.tensor.write_raw(r.offset, src.cast(), size) })
    })
}

/// Number of NeuronCores: here the HBM channels of the DEVICE placement's
/// device ($TDRV_DEVICE, default /dev/tdrv0), the `vnc` values
/// `nrt_tensor_allocate` takes. Opens that device if nothing did yet.
///
/// # Safety
/// `count` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_total_nc_count(count: *mut u32) -> NRT_STATUS {
    const F: &str = "nrt_get_total_nc_count";
    guard(F, || {
        if count.is_null() {
            return fail(F, NRT_INVALID, "count is NULL");
        }
        match tdrv::default_device() {
            Ok(d) => {
                // SAFETY: non-null and writable per the contract.
                unsafe { count.write(d.num_channels()) };
                NRT_SUCCESS
            }
            Err(e) => status(F, Err(e)),
        }
    })
}

/// A batch whose handle, pointers and ranges were checked, with its ops
/// copied out of the caller's memory.
struct CheckedBatch {
    tensor: Tensor,
    ops: Vec<(usize, *mut u8, usize)>,
}

/// Checks every batch (handles, pointers, ranges) before any byte moves,
/// and copies the descriptors, so that no reference to caller memory is
/// held while the caller's buffers (which may overlap the descriptors) are
/// written.
///
/// # Safety
/// `batches` is NULL or valid for reads of `num_batches` entries, each
/// with `ops` valid for reads of `num_ops` entries.
unsafe fn check_batches(
    func: &str,
    batches: *const nrt_tensor_batch_t,
    num_batches: u64,
) -> Result<Vec<CheckedBatch>, NRT_STATUS> {
    if num_batches == 0 {
        return Ok(Vec::new());
    }
    if batches.is_null() {
        return Err(fail(func, NRT_INVALID, "batches is NULL"));
    }
    let n = to_usize(func, num_batches)?;
    let oom = |_| fail(func, NRT_FAIL_HOST_MEM_ALLOC, "out of host memory");
    let mut out = Vec::new();
    out.try_reserve_exact(n).map_err(oom)?;
    for i in 0..n {
        // SAFETY: entry `i < num_batches` is readable per the contract; it
        // is copied, no reference is kept.
        let b = unsafe { batches.add(i).read() };
        let t = borrow(func, b.tensor)?;
        let count = b.num_ops as usize;
        if b.ops.is_null() && count > 0 {
            return Err(fail(func, NRT_INVALID, "batch ops is NULL"));
        }
        let mut ops = Vec::new();
        ops.try_reserve_exact(count).map_err(oom)?;
        for k in 0..count {
            // SAFETY: entry `k < num_ops` is readable per the contract.
            let op = unsafe { b.ops.add(k).read() };
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
            ops.push((offset, op.buffer.cast::<u8>(), size));
        }
        if t.kind().is_none() && !ops.is_empty() {
            return Err(fail(
                func,
                NRT_INVALID,
                &format!("tensor {:?} has no storage", t.name()),
            ));
        }
        out.push(CheckedBatch { tensor: t, ops });
    }
    Ok(out)
}

/// Reads several ranges of several tensors; each tensor is fenced once
/// (not at all with `unsafe_`). Every batch is checked before any byte
/// moves. Destinations may overlap (later ops win).
///
/// # Safety
/// See `check_batches`; each op buffer is valid for writes of its size and
/// not accessed by other threads during the call.
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
        for b in checked {
            let ops: Vec<RawReadOp> = b
                .ops
                .iter()
                .map(|&(offset, dst, len)| RawReadOp { offset, dst, len })
                .collect();
            // SAFETY: every destination is valid for its size per the
            // contract; only raw pointers are used (overlaps allowed).
            let s = status(F, unsafe { b.tensor.read_batch_raw(&ops, fencing) });
            if s != NRT_SUCCESS {
                return s;
            }
        }
        NRT_SUCCESS
    })
}

/// Writes several ranges of several tensors; each tensor is fenced once
/// (not at all with `unsafe_`). Every batch is checked before any byte
/// moves.
///
/// # Safety
/// See `check_batches`; each op buffer is valid for reads of its size and
/// not written by other threads during the call.
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
        for b in checked {
            let ops: Vec<RawWriteOp> = b
                .ops
                .iter()
                .map(|&(offset, src, len)| RawWriteOp {
                    offset,
                    src: src.cast_const(),
                    len,
                })
                .collect();
            // SAFETY: every source is valid for its size per the contract.
            let s = status(F, unsafe { b.tensor.write_batch_raw(&ops, fencing) });
            if s != NRT_SUCCESS {
                return s;
            }
        }
        NRT_SUCCESS
    })
}

/// Physical address, size and HBM of a device tensor; NRT_INVALID for
/// other tensors, NRT_FAILURE when the driver withholds DMA addresses from
/// this process (no CAP_SYS_RAWIO).
///
/// # Safety
/// `info` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_get_device_allocation_info(
    tensor: *const nrt_tensor_t,
    info: *mut nrt_tensor_device_allocation_info_t,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_get_device_allocation_info";
    guard(F, || {
        let t = tri!(borrow(F, tensor));
        if info.is_null() {
            return fail(F, NRT_INVALID, "info is NULL");
        }
        match t.device_allocation_info() {
            Ok(i) => {
                // SAFETY: non-null and writable per the contract.
                unsafe {
                    info.write(nrt_tensor_device_allocation_info_t {
                        physical_address: i.physical_address,
                        size: i.size,
                        hbm_index: c_int::try_from(i.hbm_index).unwrap_or(-1),
                    })
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
#[no_mangle]
pub extern "C" fn nrt_tensor_check_output_completion(
    output: *const nrt_tensor_t,
    timeout_us: i64,
    expected_completion_count: u64,
) -> NRT_STATUS {
    const F: &str = "nrt_tensor_check_output_completion";
    guard(F, || {
        let t = tri!(borrow(F, output));
        match t.check_output_completion_us(timeout_us, expected_completion_count) {
            Ok(()) => NRT_SUCCESS,
            // A time-out is an answer, not an error worth a log line.
            Err(e) if e.is_timeout() => NRT_TIMEOUT,
            Err(e) => status(F, Err(e)),
        }
    })
}

/// Sets the output tensor's completion count to 0.
#[no_mangle]
pub extern "C" fn nrt_tensor_reset_output_completion(output: *mut nrt_tensor_t) -> NRT_STATUS {
    const F: &str = "nrt_tensor_reset_output_completion";
    guard(F, || {
        let t = tri!(borrow(F, output));
        status(F, t.reset_output_completion())
    })
}

/// Drops one set reference of tensor handle `tok`; the tensors to drop
/// once the table is unlocked go to `dropped`.
fn release_set_ref(h: &mut HandlesMut<'_, Handle>, tok: usize, dropped: &mut Vec<Tensor>) {
    let Some(Handle::Tensor(held)) = h.get_mut(tok) else {
        return;
    };
    held.set_refs = held.set_refs.saturating_sub(1);
    if held.set_refs > 0 {
        return;
    }
    dropped.extend(held.in_sets.take());
    if held.user.is_none() {
        h.remove(tok);
    }
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
        match handles().insert(Handle::Set(HashMap::new())) {
            Ok(tok) => {
                // SAFETY: non-null and writable per the contract.
                unsafe { *result = as_handle(tok) };
                NRT_SUCCESS
            }
            Err(e) => status(F, Err(e)),
        }
    })
}

/// Destroys the set (dropping its references, not the caller's) and sets
/// `*tensor_set` to NULL. A pointer that is not a live set is logged and
/// left alone.
///
/// # Safety
/// `tensor_set` is NULL or a writable `nrt_tensor_set_t *` variable.
#[no_mangle]
pub unsafe extern "C" fn nrt_destroy_tensor_set(tensor_set: *mut *mut nrt_tensor_set_t) {
    const F: &str = "nrt_destroy_tensor_set";
    guard(F, || {
        // SAFETY: per this function's contract.
        let Some(set) = (unsafe { handle_in(tensor_set) }) else {
            return NRT_SUCCESS;
        };
        let mut dropped = Vec::new();
        {
            let mut h = handles().lock();
            match h.get(token(set)) {
                Some(Handle::Set(_)) => {}
                _ => {
                    drop(h);
                    return fail(F, NRT_INVALID_HANDLE, "not a live tensor set");
                }
            }
            if let Some(Handle::Set(members)) = h.remove(token(set)) {
                for tok in members.into_values() {
                    release_set_ref(&mut h, tok, &mut dropped);
                }
            }
        }
        drop(dropped);
        // SAFETY: as above.
        unsafe { *tensor_set = std::ptr::null_mut() };
        NRT_SUCCESS
    });
}

/// Adds `tensor` under `name` (replacing any tensor of that name). The set
/// takes a reference of its own.
///
/// # Safety
/// `name` is NULL or a C string.
#[no_mangle]
pub unsafe extern "C" fn nrt_add_tensor_to_tensor_set(
    set: *mut nrt_tensor_set_t,
    name: *const c_char,
    tensor: *mut nrt_tensor_t,
) -> NRT_STATUS {
    const F: &str = "nrt_add_tensor_to_tensor_set";
    guard(F, || {
        if set.is_null() {
            return fail(F, NRT_INVALID, "tensor set is NULL");
        }
        // SAFETY: per the contract.
        let Some(name) = (unsafe { name_arg(name) }) else {
            return fail(F, NRT_INVALID, "name is NULL");
        };
        if tensor.is_null() {
            return fail(F, NRT_INVALID, "tensor is NULL");
        }
        let (set, tok) = (token(set), token(tensor));
        let mut dropped = Vec::new();
        let r = {
            let mut h = handles().lock();
            let room = match h.get_mut(set) {
                Some(Handle::Set(m)) => m.try_reserve(1).map_err(|_| NRT_FAIL_HOST_MEM_ALLOC),
                _ => Err(NRT_INVALID_HANDLE),
            };
            match (room, h.get_mut(tok)) {
                (Err(s), _) => Err(s),
                (Ok(()), Some(Handle::Tensor(held))) if held.tensor().is_some() => {
                    if held.in_sets.is_none() {
                        held.in_sets = held.tensor().map(Tensor::clone_quiet);
                    }
                    held.set_refs = held.set_refs.saturating_add(1);
                    let old = match h.get_mut(set) {
                        Some(Handle::Set(m)) => m.insert(name, tok),
                        _ => None,
                    };
                    if let Some(old) = old {
                        release_set_ref(&mut h, old, &mut dropped);
                    }
                    Ok(())
                }
                (Ok(()), _) => Err(NRT_INVALID_HANDLE),
            }
        };
        drop(dropped);
        match r {
            Ok(()) => NRT_SUCCESS,
            Err(NRT_FAIL_HOST_MEM_ALLOC) => fail(F, NRT_FAIL_HOST_MEM_ALLOC, "out of host memory"),
            Err(s) => fail(F, s, "not a live tensor set and tensor"),
        }
    })
}

/// Looks a tensor up by name: the pointer that was added, or NRT_FAILURE
/// when no tensor has that name.
///
/// # Safety
/// `name` is NULL or a C string; `tensor` NULL or writable.
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
        if set.is_null() {
            return fail(F, NRT_INVALID, "tensor set is NULL");
        }
        // SAFETY: per the contract.
        let Some(name) = (unsafe { name_arg(name) }) else {
            return fail(F, NRT_INVALID, "name is NULL");
        };
        let found = handles().get(token(set), |h| match h {
            Handle::Set(m) => Ok(m.get(&name).copied()),
            Handle::Tensor(_) => Err(()),
        });
        match found {
            Some(Ok(Some(tok))) => {
                // SAFETY: as above.
                unsafe { *tensor = as_handle(tok) };
                NRT_SUCCESS
            }
            Some(Ok(None)) => fail(
                F,
                NRT_FAILURE,
                &format!("no tensor named {name:?} in the set"),
            ),
            _ => fail(F, NRT_INVALID_HANDLE, "not a live tensor set"),
        }
    })
}

// After `tri!`, which it uses.
pub mod job;

#[cfg(test)]
mod tests {
    use super::handle_in;

    #[test]
    fn handle_in_skips_null_slots_and_null_handles() {
        // SAFETY: NULL is allowed.
        assert_eq!(unsafe { handle_in(std::ptr::null_mut::<*mut u8>()) }, None);
        let mut none: *mut u8 = std::ptr::null_mut();
        // SAFETY: a readable variable.
        assert_eq!(unsafe { handle_in(&mut none) }, None);
        let mut x = 5u8;
        let mut some: *mut u8 = &mut x;
        // SAFETY: as above.
        assert_eq!(unsafe { handle_in(&mut some) }, Some(some));
    }
}
