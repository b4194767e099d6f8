//! An in-process tdrv device for unit tests: the ioctl layer of
//! [`Device`](crate::Device) answered from heap memory, so that the `Dma`
//! storage, I/O, mapping-guard and job paths run under Miri, which cannot
//! issue ioctls or map a device.
//!
//! It follows `uapi/tdrv.h` where the library depends on it: handles,
//! ALLOC (zeroed), FREE, BUF_INFO, COPY_IN/COPY_OUT (waiting for pending
//! device access like the driver, latch included), MEMSET, COPY (same
//! channel, no overlap), SUBMIT (run at once, completion counts, the error
//! latch of a failed job), JOB_WAIT, FENCE_WAIT, COMPLETION_WAIT/RESET,
//! EXPORT/IMPORT (an export is a `/dev/null` fd the fake remembers) and
//! mmap, which lends the buffer's heap block itself. Test knobs stand in
//! for a device that is still working ([`FakeDevice::hold`]) or fails a
//! job ([`FakeDevice::fail_next_job`]).
//!
//! Compiled for `cfg(test)` only: the production path has no branch for it.

use std::alloc::Layout;
use std::collections::HashMap;
use std::os::fd::IntoRawFd;
use std::ptr::{self, NonNull};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tdrv_uapi as uapi;

use crate::sys::SysError;

/// The heap block behind a fake buffer; mappings keep it alive past FREE,
/// as a real mapping keeps the buffer's pages.
pub(crate) struct FakeMem {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: an owned heap block; every access is a raw-pointer copy whose
// callers (the fake's ioctls, the library's spans and fences) order them.
unsafe impl Send for FakeMem {}
// SAFETY: as above.
unsafe impl Sync for FakeMem {}

impl FakeMem {
    fn new(len: usize) -> Option<Arc<Self>> {
        let layout = Layout::from_size_align(len, 4096).ok()?;
        // SAFETY: `len` is non-zero (ALLOC refuses zero sizes).
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(Arc::new(FakeMem { ptr, layout }))
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for FakeMem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// One buffer: what every handle of it (ALLOC, IMPORTs) shares.
struct Buf {
    id: u64,
    size: usize,
    channel: u32,
    mem: Arc<FakeMem>,
    pending_reads: u64,
    pending_writes: u64,
    completions: u64,
    error: i32,
}

/// A job SUBMIT left running ([`FakeDevice::hold_jobs`]).
struct HeldJob {
    id: u64,
    /// 0 or a negative errno, reported when it ends.
    status: i32,
    /// Its destinations, each once: a pending write each until it ends.
    dsts: Vec<u64>,
    /// Its out-fence (the fake's own end of it), signalled when it ends.
    fence: Option<std::os::fd::OwnedFd>,
}

#[derive(Default)]
struct State {
    /// Handle -> buffer id.
    handles: HashMap<u64, u64>,
    /// Buffer id -> buffer, while a handle or an export holds it.
    bufs: HashMap<u64, Buf>,
    /// Exported fd number -> buffer id.
    exports: HashMap<i32, u64>,
    /// Job id -> its status (0 or a negative errno), once it ended.
    jobs: HashMap<u64, i32>,
    /// Whether SUBMIT leaves its jobs running ([`FakeDevice::hold_jobs`]).
    hold_jobs: bool,
    /// Jobs still running, oldest first.
    held: Vec<HeldJob>,
    /// JOB_NOTIFY requests of running jobs: (job id, user_data).
    notifies: Vec<(u64, u64)>,
    /// Completion events queued and not yet read, oldest first.
    events: std::collections::VecDeque<uapi::tdrv_event>,
    /// Test knob: the next read of events fails with this errno.
    fail_next_read: Option<i32>,
    /// Test knob: queued events do not signal the eventfd.
    quiet: bool,
    next_handle: u64,
    next_id: u64,
    next_job: u64,
    fail_next_job: Option<i32>,
    /// Callers blocked in an ioctl waiting for a buffer's device accesses.
    waiting: usize,
}

impl State {
    fn buf_id(&self, handle: u64) -> Result<u64, i32> {
        self.handles.get(&handle).copied().ok_or(libc::ENOENT)
    }

    fn buf(&mut self, handle: u64) -> Result<&mut Buf, i32> {
        let id = self.buf_id(handle)?;
        Ok(self.bufs.get_mut(&id).expect("handle of a live buffer"))
    }

    fn drop_unused(&mut self, id: u64) {
        let used =
            self.handles.values().any(|&b| b == id) || self.exports.values().any(|&b| b == id);
        if !used {
            self.bufs.remove(&id);
        }
    }
}

/// See the module documentation.
pub(crate) struct FakeDevice {
    state: Mutex<State>,
    cond: Condvar,
    pub(crate) version: uapi::tdrv_version,
    /// With `TDRV_FEAT_EVENTS`: an eventfd standing in for the device
    /// file's readiness, readable (POLLIN) while an event is queued. The
    /// `Device` polls a duplicate of it.
    event_fd: Option<std::os::fd::OwnedFd>,
}

fn range(offset: u64, size: u64, len: usize) -> Result<usize, i32> {
    let end = offset.checked_add(size).ok_or(libc::ERANGE)?;
    if end > len as u64 {
        return Err(libc::ERANGE);
    }
    Ok(offset as usize)
}

/// A user pointer of an ioctl argument back as a pointer. The library
/// made it from a live pointer with an `as` cast, which exposed it.
fn user<T>(addr: u64) -> *mut T {
    ptr::with_exposed_provenance_mut(addr as usize)
}

impl FakeDevice {
    /// A fake soft device with 2 channels; `features` are the
    /// `TDRV_FEAT_*` bits it reports (see [`FakeDevice::FEATURES`]).
    pub(crate) fn new(features: u64) -> Self {
        FakeDevice {
            state: Mutex::new(State {
                next_handle: 1,
                next_id: 1,
                next_job: 1,
                ..State::default()
            }),
            cond: Condvar::new(),
            event_fd: (features & uapi::TDRV_FEAT_EVENTS as u64 != 0).then(eventfd),
            version: uapi::tdrv_version {
                abi_major: uapi::TDRV_ABI_MAJOR,
                abi_minor: uapi::TDRV_ABI_MINOR,
                features,
                device_kind: uapi::TDRV_DEVICE_SOFT,
                num_channels: 2,
                max_buffer_size: 1 << 30,
                reserved: [0; 4],
            },
        }
    }

    /// What a soft device of ABI 1.3 reports on a kernel without
    /// `sync_file`.
    pub(crate) const FEATURES: u64 = (uapi::TDRV_FEAT_MMAP
        | uapi::TDRV_FEAT_SUBMIT
        | uapi::TDRV_FEAT_COMPLETION
        | uapi::TDRV_FEAT_ERROR_LATCH
        | uapi::TDRV_FEAT_DMABUF
        | uapi::TDRV_FEAT_BUF_ID) as u64;

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The fd the `Device` polls for events: a duplicate of the eventfd
    /// (with `TDRV_FEAT_EVENTS`), else `None`.
    pub(crate) fn device_fd(&self) -> Option<std::os::fd::OwnedFd> {
        self.event_fd
            .as_ref()
            .map(|f| f.try_clone().expect("dup of the fake's eventfd"))
    }

    /// Test knob: while `on`, SUBMIT leaves its jobs running (their
    /// destinations have a pending write, JOB_WAIT reports them pending)
    /// until [`FakeDevice::finish_jobs`]. Their copies are made at SUBMIT.
    pub(crate) fn hold_jobs(&self, on: bool) {
        self.lock().hold_jobs = on;
    }

    /// Test knob: ends every running job, oldest first: completion
    /// counts, JOB_WAIT, the events asked for and the out-fences.
    pub(crate) fn finish_jobs(&self) {
        let mut st = self.lock();
        for job in std::mem::take(&mut st.held) {
            for &h in &job.dsts {
                if let Ok(b) = st.buf(h) {
                    b.pending_writes -= 1;
                    if job.status == 0 {
                        b.completions += 1;
                    }
                }
            }
            st.jobs.insert(job.id, job.status);
            let (mine, others): (Vec<_>, Vec<_>) =
                st.notifies.iter().partition(|(id, _)| *id == job.id);
            st.notifies = others;
            for (id, user_data) in mine {
                self.queue_event(&mut st, id, user_data, job.status);
            }
            if let Some(f) = &job.fence {
                signal(f);
            }
        }
        self.cond.notify_all();
    }

    /// Test knob: while `on`, queued events do not make the device file
    /// poll readable (until [`FakeDevice::poke`]).
    pub(crate) fn quiet_events(&self, on: bool) {
        self.lock().quiet = on;
    }

    /// Test knob: the next read of events fails with `errno` (a device
    /// file that fails, as after removal).
    pub(crate) fn fail_next_read(&self, errno: i32) {
        self.lock().fail_next_read = Some(errno);
    }

    /// Test knob: the device file polls readable with no event queued
    /// (until the next read of events).
    pub(crate) fn poke(&self) {
        if let Some(f) = &self.event_fd {
            signal(f);
        }
    }

    fn queue_event(&self, st: &mut State, job_id: u64, user_data: u64, status: i32) {
        st.events.push_back(uapi::tdrv_event {
            type_: uapi::TDRV_EVENT_JOB_DONE,
            status,
            job_id,
            user_data,
        });
        if let (Some(f), false) = (&self.event_fd, st.quiet) {
            signal(f);
        }
    }

    /// The events queued now, at most `max` of them, oldest first (a
    /// `read(2)` of the device file with `RWF_NOWAIT`).
    pub(crate) fn read_events(&self, max: usize) -> Result<Vec<uapi::tdrv_event>, i32> {
        if self.event_fd.is_none() {
            return Err(libc::EOPNOTSUPP);
        }
        let mut st = self.lock();
        if let Some(errno) = st.fail_next_read.take() {
            return Err(errno);
        }
        let n = max.min(st.events.len());
        let out: Vec<_> = st.events.drain(..n).collect();
        if st.events.is_empty() {
            if let Some(f) = &self.event_fd {
                drain(f);
            }
        }
        Ok(out)
    }

    /// Test knob: a device access of the buffer `handle` starts (a write
    /// with `write`) and stays pending until [`FakeDevice::release`].
    pub(crate) fn hold(&self, handle: u64, write: bool) {
        let mut st = self.lock();
        let b = st.buf(handle).expect("hold: no such handle");
        if write {
            b.pending_writes += 1;
        } else {
            b.pending_reads += 1;
        }
    }

    /// Test knob: ends an access started by [`FakeDevice::hold`]; a write
    /// that ends counts a completion, as a job's would.
    pub(crate) fn release(&self, handle: u64, write: bool) {
        let mut st = self.lock();
        let b = st.buf(handle).expect("release: no such handle");
        if write {
            b.pending_writes -= 1;
            b.completions += 1;
            b.error = 0;
        } else {
            b.pending_reads -= 1;
        }
        self.cond.notify_all();
    }

    /// Test knob: the next SUBMIT's job fails with `errno`, latching it on
    /// its destinations.
    pub(crate) fn fail_next_job(&self, errno: i32) {
        self.lock().fail_next_job = Some(errno);
    }

    /// Test knob: how many callers are blocked in an ioctl that waits for
    /// a buffer's device accesses (FENCE_WAIT, COPY_IN, MEMSET, ...).
    pub(crate) fn waiting(&self) -> usize {
        self.lock().waiting
    }

    /// Live handles (to check that storages free theirs).
    pub(crate) fn live_handles(&self) -> usize {
        self.lock().handles.len()
    }

    /// Waits until `ready` holds for buffer `id`, or the timeout (µs: < 0
    /// forever, 0 polls) passes: `Err(ETIMEDOUT)`.
    fn wait<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        handle: u64,
        timeout_us: i64,
        ready: impl Fn(&Buf) -> bool,
    ) -> Result<MutexGuard<'a, State>, i32> {
        let deadline = (timeout_us >= 0)
            .then(|| Instant::now() + Duration::from_micros(timeout_us.unsigned_abs()));
        loop {
            if ready(st.buf(handle)?) {
                return Ok(st);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Err(libc::ETIMEDOUT);
            }
            st.waiting += 1;
            st = match left {
                None => self.cond.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(left) => {
                    self.cond
                        .wait_timeout(st, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
            st.waiting -= 1;
        }
    }

    /// The ioctl `request` on `arg`, as the driver would answer it.
    ///
    /// # Safety
    /// `arg` points to a live, exclusive value of the struct `request`
    /// names, and the user pointers in it are valid as the ioctl's own
    /// contract requires (the `Device` methods document each).
    pub(crate) unsafe fn ioctl(
        &self,
        op: &'static str,
        request: u64,
        arg: *mut u8,
    ) -> Result<(), SysError> {
        // SAFETY: forwarded from our caller.
        unsafe { self.dispatch(request, arg) }.map_err(|errno| SysError::from_errno(op, errno))
    }

    /// # Safety
    /// As for [`FakeDevice::ioctl`].
    unsafe fn dispatch(&self, request: u64, arg: *mut u8) -> Result<(), i32> {
        // SAFETY: (every cast below) `arg` is the struct its request names
        // (our contract), live and exclusively ours for the call.
        unsafe {
            match request {
                uapi::TDRV_IOC_VERSION => {
                    *arg.cast::<uapi::tdrv_version>() = self.version;
                    Ok(())
                }
                uapi::TDRV_IOC_CHANNEL_INFO => {
                    let c = &mut *arg.cast::<uapi::tdrv_channel_info>();
                    if c.channel >= self.version.num_channels {
                        return Err(libc::EINVAL);
                    }
                    Ok(())
                }
                uapi::TDRV_IOC_ALLOC => self.alloc(&mut *arg.cast()),
                uapi::TDRV_IOC_FREE => self.free(&*arg.cast()),
                uapi::TDRV_IOC_BUF_INFO => self.buf_info(&mut *arg.cast()),
                uapi::TDRV_IOC_COPY_IN => self.xfer(&*arg.cast(), true),
                uapi::TDRV_IOC_COPY_OUT => self.xfer(&*arg.cast(), false),
                uapi::TDRV_IOC_MEMSET => self.memset(&*arg.cast()),
                uapi::TDRV_IOC_COPY => {
                    let c = &*arg.cast::<uapi::tdrv_copy>();
                    self.copy(std::slice::from_ref(&c.desc)).map(drop)
                }
                uapi::TDRV_IOC_SUBMIT => self.submit(&mut *arg.cast()),
                uapi::TDRV_IOC_JOB_WAIT => self.job_wait(&mut *arg.cast()),
                uapi::TDRV_IOC_JOB_NOTIFY => self.job_notify(&*arg.cast()),
                uapi::TDRV_IOC_FENCE_WAIT => self.fence_wait(&*arg.cast()),
                uapi::TDRV_IOC_COMPLETION_WAIT => self.completion_wait(&mut *arg.cast()),
                uapi::TDRV_IOC_COMPLETION_RESET => {
                    let r = &*arg.cast::<uapi::tdrv_completion_reset>();
                    let mut st = self.lock();
                    let b = st.buf(r.handle)?;
                    b.completions = 0;
                    b.error = 0;
                    Ok(())
                }
                uapi::TDRV_IOC_EXPORT => self.export(&mut *arg.cast()),
                uapi::TDRV_IOC_IMPORT => self.import(&mut *arg.cast()),
                _ => Err(libc::ENOTTY),
            }
        }
    }

    fn alloc(&self, a: &mut uapi::tdrv_alloc) -> Result<(), i32> {
        if a.size == 0 || a.size > self.version.max_buffer_size {
            return Err(libc::EINVAL);
        }
        if a.channel >= self.version.num_channels {
            return Err(libc::EINVAL);
        }
        let size = a.size as usize;
        let mem = FakeMem::new(size.next_multiple_of(4096)).ok_or(libc::ENOMEM)?;
        let mut st = self.lock();
        let (handle, id) = (st.next_handle, st.next_id);
        st.next_handle += 1;
        st.next_id += 1;
        st.bufs.insert(
            id,
            Buf {
                id,
                size,
                channel: a.channel,
                mem,
                pending_reads: 0,
                pending_writes: 0,
                completions: 0,
                error: 0,
            },
        );
        st.handles.insert(handle, id);
        a.handle = handle;
        a.dma_addr = 0;
        a.mmap_offset = mmap_offset(handle);
        Ok(())
    }

    fn free(&self, f: &uapi::tdrv_free) -> Result<(), i32> {
        let mut st = self.lock();
        let id = st.handles.remove(&f.handle).ok_or(libc::ENOENT)?;
        st.drop_unused(id);
        Ok(())
    }

    fn buf_info(&self, i: &mut uapi::tdrv_buf_info) -> Result<(), i32> {
        let mut st = self.lock();
        let b = st.buf(i.handle)?;
        i.size = b.size as u64;
        i.dma_addr = 0;
        i.mmap_offset = mmap_offset(i.handle);
        i.pending_reads = b.pending_reads;
        i.pending_writes = b.pending_writes;
        i.completion_count = b.completions;
        i.channel = b.channel;
        i.error = b.error;
        i.buf_id = b.id;
        Ok(())
    }

    /// COPY_IN (`write`) or COPY_OUT, waiting as the driver does.
    fn xfer(&self, x: &uapi::tdrv_xfer, write: bool) -> Result<(), i32> {
        let st = self.lock();
        let st = self.wait(st, x.handle, -1, |b| {
            b.pending_writes == 0 && (!write || b.pending_reads == 0)
        })?;
        let mut st = st;
        let b = st.buf(x.handle)?;
        let off = range(x.offset, x.size, b.size)?;
        let len = x.size as usize;
        if !write && b.error != 0 {
            return Err(libc::EIO);
        }
        // SAFETY: the range is inside the block (checked); the user
        // pointer is valid for `len` bytes per COPY_IN/COPY_OUT's contract.
        unsafe {
            let at = b.mem.as_ptr().add(off);
            if write {
                ptr::copy(user::<u8>(x.user_ptr), at, len);
            } else {
                ptr::copy(at, user::<u8>(x.user_ptr), len);
            }
        }
        if write {
            b.error = 0;
        }
        Ok(())
    }

    fn memset(&self, m: &uapi::tdrv_memset) -> Result<(), i32> {
        if m.value > 255 {
            return Err(libc::EINVAL);
        }
        let st = self.lock();
        let mut st = self.wait(st, m.handle, -1, |b| {
            b.pending_writes == 0 && b.pending_reads == 0
        })?;
        let b = st.buf(m.handle)?;
        let off = range(m.offset, m.size, b.size)?;
        // SAFETY: inside the block (checked).
        unsafe { ptr::write_bytes(b.mem.as_ptr().add(off), m.value as u8, m.size as usize) };
        b.error = 0;
        Ok(())
    }

    /// Runs copies (COPY, or a job's descriptors); `Ok(false)` if the job
    /// was made to fail (its destinations latched).
    fn copy(&self, descs: &[uapi::tdrv_copy_desc]) -> Result<bool, i32> {
        let mut st = self.lock();
        for d in descs {
            let (s, t) = (st.buf_id(d.src_handle)?, st.buf_id(d.dst_handle)?);
            let (src, dst) = (&st.bufs[&s], &st.bufs[&t]);
            if d.size == 0 {
                return Err(libc::EINVAL);
            }
            range(d.src_offset, d.size, src.size)?;
            range(d.dst_offset, d.size, dst.size)?;
            if src.channel != dst.channel {
                return Err(libc::EXDEV);
            }
            if s == t
                && d.src_offset < d.dst_offset + d.size
                && d.dst_offset < d.src_offset + d.size
            {
                return Err(libc::EINVAL);
            }
        }
        let fail = st.fail_next_job.take();
        for d in descs {
            st = self.wait(st, d.src_handle, -1, |b| b.pending_writes == 0)?;
            if st.buf(d.src_handle)?.error != 0 {
                return Err(libc::EIO);
            }
            st = self.wait(st, d.dst_handle, -1, |b| {
                b.pending_writes == 0 && b.pending_reads == 0
            })?;
            let src = st.buf(d.src_handle)?.mem.as_ptr();
            let dst = st.buf(d.dst_handle)?;
            if let Some(errno) = fail {
                dst.error = -errno;
                continue;
            }
            // SAFETY: both ranges are inside their blocks and do not
            // overlap (checked above).
            unsafe {
                ptr::copy(
                    src.add(d.src_offset as usize),
                    dst.mem.as_ptr().add(d.dst_offset as usize),
                    d.size as usize,
                )
            };
            dst.error = 0;
        }
        Ok(fail.is_none())
    }

    fn submit(&self, s: &mut uapi::tdrv_submit) -> Result<(), i32> {
        let fence_fds = self.version.features & uapi::TDRV_FEAT_FENCE_FD as u64 != 0;
        let notify = s.flags & uapi::TDRV_SUBMIT_NOTIFY != 0;
        if notify && self.version.features & uapi::TDRV_FEAT_SUBMIT_NOTIFY as u64 == 0 {
            return Err(libc::EINVAL);
        }
        if !notify && s.user_data != 0 {
            return Err(libc::EINVAL);
        }
        let flags = s.flags & !uapi::TDRV_SUBMIT_NOTIFY;
        let out_fence = flags == uapi::TDRV_SUBMIT_OUT_FENCE && fence_fds;
        if s.in_fence_count != 0 || (flags != 0 && !out_fence) {
            return Err(libc::EOPNOTSUPP);
        }
        if s.desc_count == 0 || s.desc_size as usize != size_of::<uapi::tdrv_copy_desc>() {
            return Err(libc::EINVAL);
        }
        // SAFETY: SUBMIT's contract: `descs` points to `desc_count`
        // descriptors, borrowed for the call.
        let descs: Vec<uapi::tdrv_copy_desc> = unsafe {
            std::slice::from_raw_parts(user::<uapi::tdrv_copy_desc>(s.descs), s.desc_count as usize)
        }
        .to_vec();
        let ok = self.copy(&descs)?;
        let mut st = self.lock();
        let id = st.next_job;
        st.next_job += 1;
        let status = if ok { 0 } else { -libc::EIO };
        let mut dsts: Vec<u64> = descs.iter().map(|d| d.dst_handle).collect();
        dsts.sort_unstable();
        dsts.dedup();
        // The out-fence: an eventfd, readable once signalled. The caller
        // gets one end, the job keeps a duplicate to signal.
        let fence = out_fence.then(eventfd);
        s.out_fence = match &fence {
            Some(f) => f
                .try_clone()
                .map_err(|e| e.raw_os_error().unwrap_or(libc::EMFILE))?
                .into_raw_fd(),
            None => -1,
        };
        if st.hold_jobs {
            for &h in &dsts {
                st.buf(h)?.pending_writes += 1;
            }
            st.held.push(HeldJob {
                id,
                status,
                dsts,
                fence,
            });
            if notify {
                st.notifies.push((id, s.user_data));
            }
        } else {
            st.jobs.insert(id, status);
            if notify {
                self.queue_event(&mut st, id, s.user_data, status);
            }
            if ok {
                for h in dsts {
                    st.buf(h)?.completions += 1;
                }
            }
            if let Some(f) = &fence {
                signal(f);
            }
        }
        self.cond.notify_all();
        s.job_id = id;
        Ok(())
    }

    fn job_wait(&self, w: &mut uapi::tdrv_job_wait) -> Result<(), i32> {
        let deadline = (w.timeout_us >= 0)
            .then(|| Instant::now() + Duration::from_micros(w.timeout_us.unsigned_abs()));
        let mut st = self.lock();
        loop {
            if let Some(&status) = st.jobs.get(&w.job_id) {
                w.state = uapi::TDRV_JOB_DONE;
                w.status = status;
                return Ok(());
            }
            if !st.held.iter().any(|j| j.id == w.job_id) {
                return Err(libc::EINVAL);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            st = match left {
                Some(l) if l.is_zero() => return Err(libc::ETIMEDOUT),
                Some(l) => {
                    self.cond
                        .wait_timeout(st, l)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.cond.wait(st).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }

    fn job_notify(&self, n: &uapi::tdrv_job_notify) -> Result<(), i32> {
        if self.event_fd.is_none() {
            return Err(libc::ENOTTY);
        }
        let mut st = self.lock();
        if let Some(&status) = st.jobs.get(&n.job_id) {
            self.queue_event(&mut st, n.job_id, n.user_data, status);
            return Ok(());
        }
        if !st.held.iter().any(|j| j.id == n.job_id) {
            return Err(libc::EINVAL);
        }
        st.notifies.push((n.job_id, n.user_data));
        Ok(())
    }

    fn fence_wait(&self, f: &uapi::tdrv_fence_wait) -> Result<(), i32> {
        let (reads, writes) = match f.kind {
            uapi::TDRV_FENCE_READS => (true, false),
            uapi::TDRV_FENCE_WRITES => (false, true),
            uapi::TDRV_FENCE_ALL => (true, true),
            _ => return Err(libc::EINVAL),
        };
        let st = self.lock();
        let mut st = self.wait(st, f.handle, f.timeout_us, |b| {
            (!reads || b.pending_reads == 0) && (!writes || b.pending_writes == 0)
        })?;
        if st.buf(f.handle)?.error != 0 {
            return Err(libc::EIO);
        }
        Ok(())
    }

    fn completion_wait(&self, w: &mut uapi::tdrv_completion_wait) -> Result<(), i32> {
        let expected = w.expected;
        let st = self.lock();
        let mut st = self.wait(st, w.handle, w.timeout_us, |b| {
            b.completions >= expected || (b.error != 0 && b.pending_writes == 0)
        })?;
        let b = st.buf(w.handle)?;
        w.count = b.completions;
        if b.completions < expected {
            return Err(libc::EIO);
        }
        Ok(())
    }

    fn export(&self, e: &mut uapi::tdrv_export) -> Result<(), i32> {
        let mut st = self.lock();
        let id = st.buf_id(e.handle)?;
        let fd = std::fs::File::open("/dev/null")
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?
            .into_raw_fd();
        st.exports.insert(fd, id);
        e.fd = fd;
        Ok(())
    }

    fn import(&self, i: &mut uapi::tdrv_import) -> Result<(), i32> {
        let mut st = self.lock();
        let id = *st.exports.get(&i.fd).ok_or(libc::EINVAL)?;
        let handle = st.next_handle;
        st.next_handle += 1;
        st.handles.insert(handle, id);
        let b = &st.bufs[&id];
        i.channel = b.channel;
        i.size = b.size as u64;
        i.handle = handle;
        i.mmap_offset = mmap_offset(handle);
        Ok(())
    }

    /// mmap of the buffer behind `offset`: its heap block, kept alive by
    /// the mapping.
    pub(crate) fn map(&self, offset: u64, len: usize) -> Result<Arc<FakeMem>, i32> {
        let mut st = self.lock();
        let b = st.buf(offset >> 20)?;
        if len > b.size.next_multiple_of(4096) {
            return Err(libc::EINVAL);
        }
        Ok(b.mem.clone())
    }
}

/// A new non-blocking eventfd.
fn eventfd() -> std::os::fd::OwnedFd {
    // SAFETY: eventfd(2) has no memory arguments.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: eventfd just returned this descriptor; nothing else owns it.
    unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }
}

/// Makes an eventfd readable.
fn signal(fd: &std::os::fd::OwnedFd) {
    use std::os::fd::AsRawFd;
    let one = 1u64;
    // SAFETY: writes the 8 bytes of a local to our own eventfd. A
    // counter at its maximum (EAGAIN) is readable already.
    unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) };
}

/// Makes an eventfd unreadable again (nothing to read is EAGAIN: fine).
fn drain(fd: &std::os::fd::OwnedFd) {
    use std::os::fd::AsRawFd;
    let mut n = 0u64;
    // SAFETY: reads 8 bytes into a local from our own eventfd.
    unsafe { libc::read(fd.as_raw_fd(), (&raw mut n).cast(), 8) };
}

fn mmap_offset(handle: u64) -> u64 {
    handle << 20
}

impl std::fmt::Debug for FakeMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeMem")
            .field("len", &self.layout.size())
            .finish()
    }
}

impl std::fmt::Debug for FakeDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FakeDevice")
    }
}

/// The `Dma` storage, I/O, mapping-guard and job paths over the fake
/// device: these run under Miri, which checks their unsafe code (the
/// mapping copies, guards, the ioctl structs) for data races and aliasing.
#[cfg(test)]
mod tests {
    use crate::ops::TensorOps;
    use std::sync::Arc;
    use std::time::Duration;

    use crate::compat::TensorCompat;
    use crate::io::{Fencing, ReadOp, WriteOp};
    use crate::job::Job;
    use crate::storage::StorageKind;
    use crate::sys::{Device, SysError};
    use crate::{Error, Tensor};

    use super::FakeDevice;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn dma_io_through_the_mapping() {
        let (dev, fake) = Device::fake();
        let t = Tensor::allocate_on(&dev, 0, 256, Some("t")).unwrap();
        assert_eq!(t.kind(), Some(StorageKind::Dma));
        assert_eq!(t.to_vec().unwrap(), [0; 256], "ALLOC is zeroed");
        t.write(8, &pattern(100, 1)).unwrap();
        let mut back = [0u8; 100];
        t.read(8, &mut back).unwrap();
        assert_eq!(back[..], pattern(100, 1)[..]);
        // Slices address the same buffer at their offset.
        let s = t.slice(100, 50, None).unwrap();
        s.write(0, &[9; 50]).unwrap();
        assert_eq!(t.to_vec().unwrap()[100..150], [9; 50]);
        // Batches, memset (the MEMSET ioctl), and a host copy through
        // overlapping ranges of one buffer (memmove).
        let mut a = [0u8; 4];
        let mut b = [0u8; 4];
        t.write_batch(
            &[
                WriteOp {
                    offset: 0,
                    buf: &[1; 4],
                },
                WriteOp {
                    offset: 200,
                    buf: &[2; 4],
                },
            ],
            Fencing::Wait,
        )
        .unwrap();
        t.read_batch(
            &mut [
                ReadOp {
                    offset: 0,
                    buf: &mut a,
                },
                ReadOp {
                    offset: 200,
                    buf: &mut b,
                },
            ],
            Fencing::Skip,
        )
        .unwrap();
        assert_eq!((a, b), ([1; 4], [2; 4]));
        t.memset(250, 0xaa, 6).unwrap();
        assert_eq!(
            t.to_vec().unwrap()[248..],
            [0, 0, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa]
        );
        Tensor::copy(&t, 0, &t, 2, 8).unwrap();
        assert_eq!(t.to_vec().unwrap()[..10], [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]);
        // Out of range is an error, not a fault.
        assert!(matches!(
            t.read(254, &mut a),
            Err(Error::OutOfBounds { .. })
        ));
        drop((t, s));
        assert_eq!(fake.live_handles(), 0, "the last view frees the buffer");
    }

    #[test]
    fn dma_io_without_a_mapping_uses_copy_in_and_out() {
        let (dev, fake) = Device::fake_with(FakeDevice::FEATURES & !(crate::sys::feat_mmap()));
        let t = Tensor::allocate_on(&dev, 1, 64, None).unwrap();
        assert!(t.va().is_none(), "no mmap: not host-addressable");
        t.write(4, &pattern(32, 3)).unwrap();
        let mut back = [0u8; 32];
        t.read(4, &mut back).unwrap();
        assert_eq!(back[..], pattern(32, 3)[..]);
        let h = Tensor::from_slice(&[5u8; 16]).unwrap().into_tensor();
        Tensor::copy(&h, 0, &t, 40, 16).unwrap();
        Tensor::copy(&t, 36, &h, 0, 8).unwrap();
        assert_eq!(h.to_vec().unwrap()[..8], [0, 0, 0, 0, 5, 5, 5, 5]);
        assert!(matches!(t.map_read(..), Err(Error::Unsupported { .. })));
        drop(t);
        assert_eq!(fake.live_handles(), 0);
    }

    #[test]
    fn device_copies_and_jobs() {
        let (dev, _fake) = Device::fake();
        let a = Tensor::allocate_on(&dev, 0, 64, None).unwrap();
        let b = Tensor::allocate_on(&dev, 0, 64, None).unwrap();
        let c = Tensor::allocate_on(&dev, 1, 64, None).unwrap();
        a.write(0, &pattern(64, 5)).unwrap();
        Tensor::copy(&a, 0, &b, 0, 64).unwrap();
        assert_eq!(b.to_vec().unwrap(), pattern(64, 5));
        assert!(matches!(
            Tensor::copy(&a, 0, &c, 0, 8),
            Err(Error::CrossChannel { src: 0, dst: 1 })
        ));
        b.memset(0, 0, 64).unwrap();
        let job = Job::new().copy_all(&a, &b).unwrap().submit().unwrap();
        job.wait_timeout(Duration::from_secs(30)).unwrap();
        assert_eq!(b.to_vec().unwrap(), pattern(64, 5));
        b.completion()
            .wait(1, Some(Duration::from_secs(30)))
            .unwrap();
    }

    #[test]
    fn a_failed_job_is_an_error_for_readers_until_rewritten() {
        let (dev, fake) = Device::fake();
        let a = Tensor::allocate_on(&dev, 0, 32, None).unwrap();
        let b = Tensor::allocate_on(&dev, 0, 32, Some("out")).unwrap();
        fake.fail_next_job(libc::ETIMEDOUT);
        let job = Job::new().copy_all(&a, &b).unwrap().submit().unwrap();
        assert!(job.wait().is_err());
        let mut x = [0u8; 4];
        match b.read(0, &mut x) {
            Err(Error::DeviceWriteFailed { errno, name, .. }) => {
                assert_eq!((errno, name.as_str()), (libc::ETIMEDOUT, "out"))
            }
            r => panic!("{r:?}"),
        }
        assert!(matches!(
            b.map_read(..),
            Err(Error::DeviceWriteFailed { .. })
        ));
        // A write replaces the bytes (through COPY_IN, which clears the
        // latch even though the buffer is mapped).
        b.write(0, &[7; 32]).unwrap();
        b.read(0, &mut x).unwrap();
        assert_eq!(x, [7; 4]);
    }

    #[test]
    fn guards_pin_the_buffer_and_wait_for_device_writes() {
        let (dev, fake) = Device::fake();
        let t = Tensor::allocate_on(&dev, 0, 64, None).unwrap();
        let other = Tensor::allocate_on(&dev, 0, 64, None).unwrap();
        t.write(0, &[3; 64]).unwrap();
        let h = t.dma_handle().unwrap();
        {
            let g = t.map_read(0..8).unwrap();
            assert_eq!(&*g, [3; 8]);
            // Device writes of the buffer are refused while it lives.
            assert!(matches!(
                Tensor::copy(&other, 0, &t, 32, 8),
                Err(Error::Sys(SysError::Pinned { .. }))
            ));
            assert!(matches!(
                t.memset(32, 0, 8),
                Err(Error::Sys(SysError::Pinned { .. }))
            ));
            // Host writes outside the guard's range still go (through
            // the mapping).
            t.write(32, &[4; 8]).unwrap();
        }
        // A device write in flight: the guard waits for it.
        fake.hold(h, true);
        let waiter = {
            let t = t.clone();
            std::thread::spawn(move || t.map_read(..).map(|g| g[0]))
        };
        std::thread::sleep(Duration::from_millis(20));
        assert!(!waiter.is_finished(), "map_read waits for the device write");
        fake.release(h, true);
        assert_eq!(waiter.join().unwrap().unwrap(), 3);
    }

    #[test]
    fn a_dma_guard_and_a_writer_thread_never_race() {
        let (dev, _fake) = Device::fake();
        let t = Tensor::allocate_on(&dev, 0, 64, None).unwrap();
        let rounds = if cfg!(miri) { 10 } else { 500 };
        let writer = {
            let t = t.clone();
            std::thread::spawn(move || {
                for i in 0..rounds {
                    match t.write(0, &[i as u8; 64]) {
                        Ok(()) | Err(Error::Busy { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            })
        };
        for _ in 0..rounds {
            if let Ok(g) = t.map_read(..) {
                let first = g[0];
                assert!(g.iter().all(|b| *b == first));
            }
        }
        writer.join().unwrap();
        let _ = Arc::strong_count(&dev);
    }

    #[test]
    fn an_import_of_our_own_export_is_the_same_storage() {
        let (dev, fake) = Device::fake();
        let t = Tensor::allocate_on(&dev, 0, 64, Some("t")).unwrap();
        t.write(0, &[1; 64]).unwrap();
        let fd = t.export_dmabuf().unwrap();
        let alias = Tensor::from_dmabuf(&dev, &fd).unwrap();
        // One buffer, one storage: the import's own handle was freed.
        assert_eq!(alias.dma_handle(), t.dma_handle());
        assert_eq!(fake.live_handles(), 1);
        // A shared buffer is not lent as a reference by the safe guards.
        assert!(matches!(t.map_read(..), Err(Error::SharedBuffer { .. })));
        assert!(matches!(
            alias.map_write(..),
            Err(Error::SharedBuffer { .. })
        ));
        // SAFETY: no other process holds the dma-buf.
        let g = unsafe { t.map_read_shared(0..16) }.unwrap();
        assert!(matches!(alias.write(0, &[2; 8]), Err(Error::Busy { .. })));
        assert_eq!(&*g, [1; 16], "the guard's bytes did not change");
        // A second import resolves to it too.
        let again = Tensor::from_dmabuf(&dev, &fd).unwrap();
        assert_eq!(again.dma_handle(), t.dma_handle());
        assert!(matches!(again.write(8, &[2; 8]), Err(Error::Busy { .. })));
        drop(g);
        alias.write(0, &[3; 8]).unwrap();
        assert_eq!(t.to_vec().unwrap()[..9], [3, 3, 3, 3, 3, 3, 3, 3, 1]);
        // An export is refused while a guard pins the buffer.
        let u = Tensor::allocate_on(&dev, 0, 64, None).unwrap();
        {
            let _g = u.map_read(..).unwrap();
            assert!(matches!(
                u.export_dmabuf(),
                Err(Error::Sys(SysError::Pinned { .. }))
            ));
        }
        drop((t, alias, again, u, fd));
        assert_eq!(fake.live_handles(), 0);
    }

    #[test]
    fn share_to_keeps_the_view_and_on_its_own_device_is_the_same_storage() {
        let (dev, fake) = Device::fake();
        let t = Tensor::allocate_on(&dev, 0, 256, Some("t")).unwrap();
        t.write(0, &(0..=255).collect::<Vec<u8>>()).unwrap();
        let part = t.slice(16, 32, None).unwrap();
        let shared = part.share_to(&dev, 1).unwrap();
        // Same device: a view of the same storage, at the same place (the
        // channel is the storage's own, not the one asked for).
        assert!(shared.shares_storage_with(&t));
        assert_eq!(
            (shared.offset(), shared.size(), shared.channel()),
            (16, 32, Some(0))
        );
        assert_eq!(shared.to_vec().unwrap(), (16..48).collect::<Vec<u8>>());
        assert_eq!(fake.live_handles(), 1);
        // From now on the buffer is shared: the safe guards refuse it.
        assert!(matches!(t.map_read(..), Err(Error::SharedBuffer { .. })));
        let host = Tensor::allocate_host(64, None).unwrap();
        assert!(matches!(
            host.share_to(&dev, 0),
            Err(Error::Unsupported {
                op: "export_dmabuf",
                ..
            })
        ));
        drop((t, part, shared));
        assert_eq!(fake.live_handles(), 0);
    }

    #[test]
    fn host_waits_on_a_device_that_never_finishes_time_out() {
        let (dev, fake) = Device::fake();
        let t = Tensor::allocate_on(&dev, 0, 64, Some("stuck")).unwrap();
        t.write(0, &[4; 64]).unwrap();
        let h = t.dma_handle().unwrap();
        let short = Duration::from_millis(if cfg!(miri) { 5 } else { 50 });
        let timed_out = |r: Result<(), Error>| match r {
            Err(Error::Timeout { name, .. }) => name == "stuck",
            _ => false,
        };
        // A device write that never ends: reads and guards time out ...
        fake.hold(h, true);
        let mut b = [0u8; 8];
        assert!(timed_out(t.read_timeout(0, &mut b, short)));
        assert!(timed_out(t.map_read_timeout(.., short).map(drop)));
        assert!(timed_out(t.write_timeout(0, &[1; 8], short)));
        // ... and so do writes behind a device read.
        fake.release(h, true);
        fake.hold(h, false);
        t.read_timeout(0, &mut b, short).unwrap();
        assert_eq!(b, [4; 8]);
        assert!(timed_out(t.write_timeout(0, &[1; 8], short)));
        assert!(timed_out(t.map_write_timeout(.., short).map(drop)));
        // Nothing was written, and no span or pin stayed behind.
        fake.release(h, false);
        t.write_timeout(0, &[1; 8], short).unwrap();
        assert_eq!(t.to_vec().unwrap()[..9], [1, 1, 1, 1, 1, 1, 1, 1, 4]);
        drop(t.map_write_timeout(.., short).unwrap());
        // Unmapped buffers time out as well (before COPY_OUT).
        let (dev, fake) = Device::fake_with(FakeDevice::FEATURES & !(crate::sys::feat_mmap()));
        let u = Tensor::allocate_on(&dev, 0, 64, Some("stuck")).unwrap();
        let h = u.dma_handle().unwrap();
        fake.hold(h, true);
        assert!(timed_out(u.read_timeout(0, &mut b, short)));
        fake.release(h, true);
        u.read_timeout(0, &mut b, short).unwrap();
    }

    /// A bounded guard is bounded also while a plain copy of the same
    /// bytes waits for the device: that copy (write, memset, device copy
    /// into the tensor, all without limit) waits with its span not held,
    /// so `map_read_timeout`/`map_write_timeout` time out instead of
    /// waiting behind it for as long as the device takes. (Before, each
    /// copy held its span while waiting, and the guard's wait for it had
    /// no deadline: the guard never returned until the device finished.)
    #[test]
    fn bounded_guards_time_out_behind_a_copy_waiting_for_the_device() {
        type Blocker = fn(&Tensor, &Tensor) -> Result<(), Error>;
        let blockers: [(&str, Blocker); 3] = [
            ("write", |t, _| t.write(0, &[5; 64])),
            ("memset", |t, _| t.memset(0, 5, 64)),
            ("copy", |t, src| Tensor::copy(src, 0, t, 0, 64)),
        ];
        let short = Duration::from_millis(if cfg!(miri) { 5 } else { 50 });
        for (what, blocker) in blockers {
            for write_guard in [false, true] {
                let (dev, fake) = Device::fake();
                let t = Tensor::allocate_on(&dev, 0, 64, Some("held")).unwrap();
                let src = Tensor::allocate_on(&dev, 0, 64, None).unwrap();
                src.write(0, &[5; 64]).unwrap();
                let h = t.dma_handle().unwrap();
                // A job writing the tensor that does not end, and a plain
                // copy into it that waits for that job.
                fake.hold(h, true);
                let copier = {
                    let (t, src) = (t.clone(), src.clone());
                    std::thread::spawn(move || blocker(&t, &src))
                };
                let start = std::time::Instant::now();
                while fake.waiting() == 0 {
                    assert!(
                        start.elapsed() < Duration::from_secs(60),
                        "{what}: never waited"
                    );
                    std::thread::yield_now();
                }
                let guard = {
                    let t = t.clone();
                    std::thread::spawn(move || {
                        if write_guard {
                            t.map_write_timeout(.., short).map(drop)
                        } else {
                            t.map_read_timeout(.., short).map(drop)
                        }
                    })
                };
                // The bound only turns a hang into a failure.
                while !guard.is_finished() && start.elapsed() < Duration::from_secs(60) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let finished = guard.is_finished();
                fake.release(h, true);
                assert!(
                    finished,
                    "{what}: the bounded guard (write {write_guard}) hung"
                );
                match guard.join().unwrap() {
                    Err(Error::Timeout { name, .. }) => assert_eq!(name, "held"),
                    r => panic!("{what}, write guard {write_guard}: {r:?}"),
                }
                copier.join().unwrap().unwrap();
                assert_eq!(
                    t.to_vec().unwrap(),
                    [5; 64],
                    "{what}: the copy went through"
                );
            }
        }
    }

    #[test]
    fn host_storage_waits_time_out_on_async_marks() {
        let t = Tensor::allocate_host(32, Some("marked")).unwrap();
        let short = Duration::from_millis(if cfg!(miri) { 5 } else { 50 });
        t.mark_async_start(crate::Access::Write).unwrap();
        let mut b = [0u8; 4];
        assert!(matches!(
            t.read_timeout(0, &mut b, short),
            Err(Error::Timeout { .. })
        ));
        assert!(matches!(
            t.map_read_timeout(.., short),
            Err(Error::Timeout { .. })
        ));
        t.mark_async_finish(crate::Access::Write).unwrap();
        t.read_timeout(0, &mut b, short).unwrap();
        drop(t.map_read_timeout(.., short).unwrap());
    }

    #[test]
    fn unbounded_host_waits_log_a_heartbeat() {
        use std::sync::Mutex;
        let logs = Arc::new(Mutex::new(Vec::<String>::new()));
        {
            let logs = logs.clone();
            crate::set_logger(Some(Box::new(move |_, msg| {
                logs.lock().unwrap().push(msg.to_owned())
            })));
        }
        crate::set_heartbeat_interval(Duration::from_millis(5));
        let (dev, fake) = Device::fake();
        let t = Tensor::allocate_on(&dev, 0, 64, None).unwrap();
        let h = t.dma_handle().unwrap();
        fake.hold(h, true);
        let reader = {
            let t = t.clone();
            std::thread::spawn(move || t.to_vec())
        };
        let seen = |what: &str| logs.lock().unwrap().iter().any(|m| m.contains(what));
        // Waits for the log line itself; the bound only turns a hang into
        // a failure.
        let start = std::time::Instant::now();
        let seen = |what: &str| {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no heartbeat: {what}"
            );
            seen(what)
        };
        while !seen("still waiting for device writes of tdrv buffer") {
            std::thread::sleep(Duration::from_millis(5));
        }
        fake.release(h, true);
        assert_eq!(reader.join().unwrap().unwrap(), [0; 64]);
        let m = Tensor::allocate_host(8, None).unwrap();
        m.mark_async_start(crate::Access::Write).unwrap();
        let reader = {
            let m = m.clone();
            std::thread::spawn(move || m.to_vec())
        };
        while !seen("read: still waiting for overlapping host copies") {
            std::thread::sleep(Duration::from_millis(5));
        }
        m.mark_async_finish(crate::Access::Write).unwrap();
        assert_eq!(reader.join().unwrap().unwrap(), [0; 8]);
        crate::set_heartbeat_interval(Duration::from_secs(30));
        crate::set_logger(None);
    }
}
