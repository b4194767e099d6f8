// SPDX-License-Identifier: MIT OR Apache-2.0
//! tdrv's copy jobs for C programs (`include/tdrv/job.h`): the C face of
//! [`tdrv::Job`] and [`tdrv::JobHandle`], so that a C caller can make the
//! output completion counts of `nrt_tensor_check_output_completion` move
//! and the input dump happen.
//!
//! A `tdrv_job_t *` is a token of a handle table of its own, with the
//! rules of the tensor handles (looked up before every use, never
//! dereferenced, never reused). Each job sits behind a mutex that is held
//! only for its quick state changes: a wait runs on a shared reference to
//! the submitted handle, outside every lock, so that `tdrv_job_free` or a
//! poll on another thread never waits behind it.

use std::collections::HashMap;
use std::ffi::c_int;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use tdrv::handles::HandleTable;
use tdrv::sys::Device;
use tdrv::{Job, JobHandle};

use crate::{
    as_handle, borrow, fail, guard, handle_in, log_error, status, status_of, token, NRT_CLOSED,
    NRT_FAILURE, NRT_HW_ERROR, NRT_INVALID, NRT_INVALID_HANDLE, NRT_STATUS, NRT_SUCCESS,
    NRT_TIMEOUT,
};
use crate::{nrt_tensor_t, tdrv_job_event_t, tdrv_job_t};

/// Where a job is in its life.
enum State {
    /// Copies are being added.
    Building(Job),
    /// Submitted: shared with the waits in progress.
    Submitted(Arc<JobHandle>),
}

type Slot = Arc<Mutex<State>>;

fn jobs() -> &'static HandleTable<Slot> {
    static JOBS: OnceLock<HandleTable<Slot>> = OnceLock::new();
    JOBS.get_or_init(HandleTable::new)
}

/// The job behind a handle: NULL is `NRT_INVALID`, anything but a live job
/// handle `NRT_INVALID_HANDLE`. Never dereferences `job`.
fn lookup(func: &str, job: *const tdrv_job_t) -> Result<Slot, NRT_STATUS> {
    if job.is_null() {
        return Err(fail(func, NRT_INVALID, "job is NULL"));
    }
    jobs().get(token(job), Arc::clone).ok_or_else(|| {
        fail(
            func,
            NRT_INVALID_HANDLE,
            "not a live job handle (freed already, or not from this library)",
        )
    })
}

/// Locks a job's state. A panic under the lock (which `guard` turned into
/// `NRT_FAILURE`) leaves the state consistent: every change is one
/// assignment.
fn lock(slot: &Slot) -> MutexGuard<'_, State> {
    slot.lock().unwrap_or_else(|e| e.into_inner())
}

/// Creates an empty job.
///
/// # Safety
/// `job` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tdrv_job_create(job: *mut *mut tdrv_job_t) -> NRT_STATUS {
    const F: &str = "tdrv_job_create";
    guard(F, || {
        if job.is_null() {
            return fail(F, NRT_INVALID, "job is NULL");
        }
        // SAFETY: non-null and writable per the contract.
        unsafe { *job = std::ptr::null_mut() };
        let tok = match jobs().insert(Arc::new(Mutex::new(State::Building(Job::new())))) {
            Ok(t) => t,
            Err(e) => {
                log_error(F, &e);
                return status_of(&e);
            }
        };
        // SAFETY: as above.
        unsafe { *job = as_handle(tok) };
        NRT_SUCCESS
    })
}

/// Adds a copy to a job that was not submitted yet.
#[no_mangle]
pub extern "C" fn tdrv_job_add_copy(
    job: *mut tdrv_job_t,
    src: *const nrt_tensor_t,
    src_offset: usize,
    dst: *mut nrt_tensor_t,
    dst_offset: usize,
    size: usize,
) -> NRT_STATUS {
    const F: &str = "tdrv_job_add_copy";
    guard(F, || {
        let slot = tri!(lookup(F, job));
        let src = tri!(borrow(F, src));
        let dst = tri!(borrow(F, dst));
        let mut state = lock(&slot);
        let State::Building(j) = &mut *state else {
            return fail(F, NRT_INVALID, "the job was submitted already");
        };
        status(
            F,
            j.copy(&src, src_offset, &dst, dst_offset, size).map(drop),
        )
    })
}

/// Asks for a completion fd at submit.
#[no_mangle]
pub extern "C" fn tdrv_job_request_fd(job: *mut tdrv_job_t) -> NRT_STATUS {
    const F: &str = "tdrv_job_request_fd";
    guard(F, || {
        let slot = tri!(lookup(F, job));
        let mut state = lock(&slot);
        match &mut *state {
            State::Building(j) => {
                j.with_out_fence();
                NRT_SUCCESS
            }
            State::Submitted(_) => fail(F, NRT_INVALID, "the job was submitted already"),
        }
    })
}

/// Queues the job, asking in the same call for its completion event
/// carrying `event`'s `user_data` if given, and returns the submitted
/// handle. On failure nothing was queued and the job keeps its copies (and
/// forgets the event), so it can be freed or submitted again.
fn submit_as(
    func: &str,
    job: *const tdrv_job_t,
    event: Option<u64>,
) -> Result<Arc<JobHandle>, NRT_STATUS> {
    let slot = lookup(func, job)?;
    let mut state = lock(&slot);
    let State::Building(j) = &mut *state else {
        return Err(fail(func, NRT_INVALID, "the job was submitted already"));
    };
    if j.is_empty() {
        return Err(fail(func, NRT_INVALID, "the job has no copies"));
    }
    if let Some(user_data) = event {
        j.with_event(user_data);
    }
    match j.submit() {
        Ok(h) => {
            let h = Arc::new(h);
            *state = State::Submitted(Arc::clone(&h));
            Ok(h)
        }
        Err(e) => {
            j.without_event();
            Err(match e {
                tdrv::Error::Sys(tdrv::sys::SysError::NotSupported { .. }) if event.is_some() => {
                    fail(
                        func,
                        NRT_FAILURE,
                        "the driver cannot ask for a job's event in its submit (ABI < 1.6)",
                    )
                }
                e => status(func, Err(e)),
            })
        }
    }
}

/// Queues the job.
#[no_mangle]
pub extern "C" fn tdrv_job_submit(job: *mut tdrv_job_t) -> NRT_STATUS {
    const F: &str = "tdrv_job_submit";
    guard(F, || match submit_as(F, job, None) {
        Ok(_) => NRT_SUCCESS,
        Err(st) => st,
    })
}

/// Queues the job and asks, in the same ioctl, for its completion event
/// carrying `user_data` (ABI 1.6); returns the device file's descriptor
/// as `tdrv_job_notify` does.
///
/// # Safety
/// `fd` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tdrv_job_submit_notify(
    job: *mut tdrv_job_t,
    user_data: u64,
    fd: *mut c_int,
) -> NRT_STATUS {
    const F: &str = "tdrv_job_submit_notify";
    guard(F, || {
        if fd.is_null() {
            return fail(F, NRT_INVALID, "fd is NULL");
        }
        let h = tri!(submit_as(F, job, Some(user_data)));
        let raw = register_event_file(h.device());
        // SAFETY: non-null and writable per the contract.
        unsafe { *fd = raw };
        NRT_SUCCESS
    })
}

/// The submitted handle of a job, shared, without holding its lock.
fn submitted(func: &str, job: *const tdrv_job_t) -> Result<Arc<JobHandle>, NRT_STATUS> {
    let slot = lookup(func, job)?;
    let state = lock(&slot);
    match &*state {
        State::Submitted(h) => Ok(Arc::clone(h)),
        State::Building(_) => Err(fail(func, NRT_INVALID, "the job was not submitted")),
    }
}

/// Waits for a submitted job for at most `timeout_us` microseconds
/// (negative: without limit).
#[no_mangle]
pub extern "C" fn tdrv_job_wait(job: *mut tdrv_job_t, timeout_us: i64) -> NRT_STATUS {
    const F: &str = "tdrv_job_wait";
    guard(F, || {
        let h = tri!(submitted(F, job));
        match h.wait_for(tdrv::compat::timeout_from_us(timeout_us)) {
            Ok(()) => NRT_SUCCESS,
            // A time-out is an answer, not an error worth a log line.
            Err(e) if e.is_timeout() => NRT_TIMEOUT,
            Err(e) => status(F, Err(e)),
        }
    })
}

/// The completion fd of a job submitted after `tdrv_job_request_fd`.
///
/// # Safety
/// `fd` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tdrv_job_get_fd(job: *mut tdrv_job_t, fd: *mut c_int) -> NRT_STATUS {
    const F: &str = "tdrv_job_get_fd";
    guard(F, || {
        if fd.is_null() {
            return fail(F, NRT_INVALID, "fd is NULL");
        }
        let h = tri!(submitted(F, job));
        let Some(f) = h.fence_fd() else {
            return fail(
                F,
                NRT_INVALID,
                "the job has no completion fd (call tdrv_job_request_fd before submitting)",
            );
        };
        // SAFETY: non-null and writable per the contract. The fd stays
        // open while the job's handle lives: the table holds the handle
        // until tdrv_job_free.
        unsafe { *fd = f.as_raw_fd() };
        NRT_SUCCESS
    })
}

/// The device files `tdrv_job_notify` handed out, by descriptor: what
/// `tdrv_read_events` accepts (any other fd is `NRT_INVALID`, never read).
fn event_files() -> MutexGuard<'static, HashMap<c_int, Weak<Device>>> {
    static FILES: OnceLock<Mutex<HashMap<c_int, Weak<Device>>>> = OnceLock::new();
    FILES
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Records `dev`'s file as one whose events `tdrv_read_events` reads, and
/// returns its descriptor.
fn register_event_file(dev: &Arc<Device>) -> c_int {
    let raw = dev.as_fd().as_raw_fd();
    let mut files = event_files();
    files.retain(|_, d| d.strong_count() > 0);
    files.insert(raw, Arc::downgrade(dev));
    raw
}

/// Asks for the job's completion event on its device file and returns
/// that file's descriptor.
///
/// # Safety
/// `fd` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tdrv_job_notify(
    job: *mut tdrv_job_t,
    user_data: u64,
    fd: *mut c_int,
) -> NRT_STATUS {
    const F: &str = "tdrv_job_notify";
    guard(F, || {
        if fd.is_null() {
            return fail(F, NRT_INVALID, "fd is NULL");
        }
        let h = tri!(submitted(F, job));
        let dev = h.device();
        if !dev.supports_events() {
            return fail(
                F,
                NRT_FAILURE,
                "the driver has no completion events (ABI < 1.4)",
            );
        }
        if let Err(e) = dev.job_notify(h.id(), user_data) {
            return status(F, Err(e));
        }
        let raw = register_event_file(dev);
        // SAFETY: non-null and writable per the contract.
        unsafe { *fd = raw };
        NRT_SUCCESS
    })
}

/// Reads the ready completion events of a device file from
/// `tdrv_job_notify`, without waiting.
///
/// # Safety
/// `events` is NULL or has room for `max` events; `count` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn tdrv_read_events(
    fd: c_int,
    events: *mut tdrv_job_event_t,
    max: usize,
    count: *mut usize,
) -> NRT_STATUS {
    const F: &str = "tdrv_read_events";
    guard(F, || {
        if count.is_null() || (events.is_null() && max > 0) {
            return fail(F, NRT_INVALID, "events or count is NULL");
        }
        let dev = event_files().get(&fd).and_then(Weak::upgrade);
        let Some(dev) = dev else {
            return fail(F, NRT_INVALID, "not a device file from tdrv_job_notify");
        };
        let mut read = Vec::new();
        let mut n = 0;
        // At most `max`: the rest stays queued in the kernel for the next
        // call (events are read in batches of up to 64).
        while n < max {
            read.clear();
            let want = (max - n).min(64);
            if let Err(e) = dev.read_events_max(&mut read, want) {
                return status(F, Err(e));
            }
            if read.is_empty() {
                break;
            }
            for ev in &read {
                let st = match ev.status {
                    tdrv::sys::JobStatus::Failed(libc::ENODEV) => NRT_CLOSED,
                    tdrv::sys::JobStatus::Failed(_) => NRT_HW_ERROR,
                    _ => NRT_SUCCESS,
                };
                // SAFETY: `n < max`, and `events` has room for `max`.
                unsafe {
                    events.add(n).write(tdrv_job_event_t {
                        user_data: ev.user_data,
                        status: st,
                    })
                };
                n += 1;
            }
        }
        // SAFETY: non-null and writable per the contract.
        unsafe { *count = n };
        NRT_SUCCESS
    })
}

/// Frees a job handle and sets `*job` to NULL; a submitted job runs on.
///
/// # Safety
/// `job` is NULL or a writable `tdrv_job_t *` variable.
#[no_mangle]
pub unsafe extern "C" fn tdrv_job_free(job: *mut *mut tdrv_job_t) {
    const F: &str = "tdrv_job_free";
    guard(F, || {
        // SAFETY: per this function's contract.
        let Some(j) = (unsafe { handle_in(job) }) else {
            return NRT_SUCCESS;
        };
        match jobs().remove(token(j)) {
            Some(slot) => {
                // Dropped outside the table's lock; a wait in progress on
                // another thread holds its own reference to the handle.
                drop(slot);
                // SAFETY: as above.
                unsafe { *job = std::ptr::null_mut() };
                NRT_SUCCESS
            }
            None => fail(
                F,
                NRT_INVALID_HANDLE,
                "not a live job handle (freed already?)",
            ),
        }
    });
}

/// Number of live job handles (for leak checks in tests).
pub fn live_jobs() -> usize {
    jobs().len()
}
