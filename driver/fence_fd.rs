// SPDX-License-Identifier: GPL-2.0

//! Fence fds of jobs: out-fences (`sync_file` fds backed by a `dma_fence`
//! signalled when the job ends) and in-fences (`sync_file` fds a job waits
//! for before it reaches the engine). 7.2 has no Rust abstraction of
//! either, so the C side lives in `fence_fd.c` behind the few functions
//! below, wrapped here in owning types.
//!
//! Design:
//!
//! - **One fence per job, one context per fence.** A file's jobs may end
//!   out of order (a cancelled queued job ends before the running one; a
//!   job whose in-fence failed ends before the jobs ahead of it), and the
//!   dma-fence core assumes the fences of one context signal in seqno
//!   order (`sync_file` merging keeps only the later fence of a context).
//!   So every out-fence gets its own context.
//! - **The outcome is the fence error.** A job's fence is signalled when
//!   the job is dropped, after its outcome reached `TDRV_IOC_JOB_WAIT` and
//!   after it let go of its buffers (a job the edu watchdog failed keeps
//!   them until the device lets go; its fence waits for that too), with
//!   the job's errno as the fence error (`ECANCELED`, `EIO`, `ETIMEDOUT`,
//!   `ENODEV`, or an in-fence's error). A job that never reached the
//!   engine (SUBMIT failed) signals `ECANCELED`; its fd was never
//!   installed.
//! - **In-fences gate dispatch, not the engine.** A job with in-fences is
//!   held by its file (`JobTracker`'s `held` list) and given to the engine
//!   only when all of them have signalled: a callback on each fence counts
//!   down, the last one queues the file's dispatch work. The engine's
//!   queue never holds a job that waits, so other files' jobs are never
//!   stalled. A file's jobs still reach the engine in id order (as they
//!   always did): a job submitted behind a held one is held too. Nothing
//!   waits in the submitting thread.
//! - **A failed in-fence fails the job** with the in-fence's error
//!   (`dma_fence_get_status`), without running it; its out-fence carries
//!   the same error, so errors flow along chains of jobs.
//! - **Cancellation.** Closing the file (also by exit or SIGKILL) ends its
//!   held jobs with `ECANCELED`, unbind with `ENODEV`; dropping a job
//!   removes its callbacks first (`tdrv_deps_free` waits for a callback
//!   that is running, since callbacks run under the fence's lock), so no
//!   callback can reach a freed job or, after `rmmod`, freed module text.
//!
//! Module lifetime (fences outlive files and the module: a `sync_file` fd
//! can be kept open, or passed on, after `rmmod`): the fence ops live in
//! this module's text, so
//!
//! - every out-fence is signalled before the module can go: an open file
//!   pins the module; closing it cancels its jobs; module exit unbinds
//!   every device, which ends every job (engines' `shutdown`), and ending
//!   a job signals its fence;
//! - the ops have no `release` and no `wait`, so 7.2's
//!   `dma_fence_signal` detaches them (sets `fence->ops` to NULL): a
//!   signalled fence is freed by the core (`dma_fence_free`, `kfree_rcu`)
//!   and its name queries answer `detached-driver` / `signaled-timeline`
//!   without calling us;
//! - the name ops of an unsignalled fence are only called under
//!   `rcu_read_lock` (`dma_fence_driver_name`), and the strings they return
//!   are only used inside that section; module exit calls
//!   `synchronize_rcu` (`tdrv_fence_module_exit`) after the devices are
//!   gone, so no such call can still be running in freed text;
//! - an in-fence callback may queue its file's dispatch work just before
//!   its job ends, after the file was released; that work runs on a queue
//!   the module owns (`dispatch_queue`), which module exit drains and
//!   destroys before the text goes.
//!
//! Kernels without `CONFIG_SYNC_FILE` (Debian's cloud kernel) build and
//! load the module: [`supported`] is false, `TDRV_FEAT_FENCE_FD` is not
//! reported, and SUBMIT with fence fds fails with `EOPNOTSUPP`. Job fences
//! and dependency sets exist there too: implicit synchronisation
//! (`resv.rs`) gives a job a fence, and implicit dependencies, without
//! any fd.

use core::{
    ffi::c_void,
    ptr::NonNull, //
};

use kernel::{
    error::to_result,
    prelude::*, //
};

use crate::uapi::ecanceled;

mod ffi {
    use core::ffi::{
        c_int,
        c_void, //
    };

    extern "C" {
        pub(super) fn tdrv_fence_fd_supported() -> bool;
        pub(super) fn tdrv_fence_new(engine: *const c_void) -> *mut c_void;
        pub(super) fn tdrv_fence_set_queued(fence: *mut c_void);
        pub(super) fn tdrv_fence_signal(fence: *mut c_void, error: c_int);
        pub(super) fn tdrv_fence_put(fence: *mut c_void);
        pub(super) fn tdrv_fence_fd_reserve(fence: *mut c_void, filep: *mut *mut c_void) -> c_int;
        pub(super) fn tdrv_fence_fd_install(fd: c_int, file: *mut c_void);
        pub(super) fn tdrv_fence_fd_discard(fd: c_int, file: *mut c_void);
        pub(super) fn tdrv_fence_module_init() -> c_int;
        pub(super) fn tdrv_dispatch_queue() -> *mut kernel::bindings::workqueue_struct;
        pub(super) fn tdrv_engine_queue() -> *mut kernel::bindings::workqueue_struct;
        pub(super) fn tdrv_fence_module_exit();
        pub(super) fn tdrv_deps_new(fds: *const i32, count: u32, depsp: *mut *mut c_void) -> c_int;
        pub(super) fn tdrv_deps_arm(deps: *mut c_void, ctx: *mut c_void) -> bool;
        pub(super) fn tdrv_deps_error(deps: *mut c_void) -> c_int;
        pub(super) fn tdrv_deps_free(deps: *mut c_void);
        pub(super) fn tdrv_fence_begin_signalling() -> bool;
        pub(super) fn tdrv_fence_end_signalling(cookie: bool);
    }
}

/// A dma-fence signalling critical section: code that out-fences wait for
/// (the engine's completion and dispatch paths). On kernels with lockdep
/// it checks that nothing inside allocates memory with reclaim (which may
/// wait for those very fences) or takes a lock held elsewhere around such
/// an allocation. Ends when dropped, in the same context (not `Send`).
pub(crate) struct Signalling {
    cookie: bool,
    _not_send: core::marker::PhantomData<*mut ()>,
}

impl Signalling {
    pub(crate) fn begin() -> Self {
        Self {
            // SAFETY: Takes a lockdep map (or nothing); callable anywhere.
            cookie: unsafe { ffi::tdrv_fence_begin_signalling() },
            _not_send: core::marker::PhantomData,
        }
    }
}

impl Drop for Signalling {
    fn drop(&mut self) {
        // SAFETY: Ends the section `begin` opened, in the same context.
        unsafe { ffi::tdrv_fence_end_signalling(self.cookie) }
    }
}

/// Whether this kernel has `sync_file` (`CONFIG_SYNC_FILE`).
pub(crate) fn supported() -> bool {
    // SAFETY: Reads a compile-time constant.
    unsafe { ffi::tdrv_fence_fd_supported() }
}

/// Module init: creates the dispatch queue. Call before any device
/// exists; [`FenceModule`]'s drop undoes it.
pub(crate) struct FenceModule(());

impl FenceModule {
    pub(crate) fn init() -> Result<Self> {
        // SAFETY: Module init, before anything uses the queue.
        to_result(unsafe { ffi::tdrv_fence_module_init() })?;
        Ok(Self(()))
    }
}

impl Drop for FenceModule {
    /// Module exit, after every device is gone: drains the dispatch queue
    /// and waits for RCU readers (see the module documentation).
    fn drop(&mut self) {
        // SAFETY: Process context without locks held (module exit or a
        // failed init); no file or device exists any more, so nothing
        // queues dispatch work now.
        unsafe { ffi::tdrv_fence_module_exit() }
    }
}

/// The queue of the files' dispatch work (`JobTracker`), which in-fence
/// callbacks queue and module exit drains: a work item queued by a
/// callback may outlive the file, and must not outlive the module.
pub(crate) fn dispatch_queue() -> &'static kernel::workqueue::Queue {
    // SAFETY: The queue exists from module init (`FenceModule::init`,
    // before any device) until module exit (after every device and file
    // is gone), which covers every user.
    unsafe { kernel::workqueue::Queue::from_raw(ffi::tdrv_dispatch_queue()) }
}

/// The queue of the engines' work (see `engine::queue`): module-owned and
/// WQ_MEM_RECLAIM, like the dispatch queue.
pub(crate) fn engine_queue() -> &'static kernel::workqueue::Queue {
    // SAFETY: The queue exists from module init (`FenceModule::init`,
    // before any device) until module exit (after every device, and so
    // every engine, is gone), which covers every user.
    unsafe { kernel::workqueue::Queue::from_raw(ffi::tdrv_engine_queue()) }
}

/// The out-fence of a job: one reference to an unsignalled tdrv
/// `dma_fence`. [`OutFence::signal`] signals it; dropping it unsignalled
/// signals `ECANCELED`, so that nobody waits for ever.
pub(crate) struct OutFence(NonNull<c_void>);

// SAFETY: A reference to a `dma_fence`, whose operations (signal, put,
// sync_file creation) may be called from any thread; signalling once is
// ensured by ownership (`signal` takes `self`).
unsafe impl Send for OutFence {}
// SAFETY: `&OutFence` only creates `sync_file`s, which takes the fence's
// own reference counting, safe from any thread.
unsafe impl Sync for OutFence {}

impl OutFence {
    /// A new unsignalled fence of a job that runs on `engine` (the
    /// device, only compared: see `resv.rs`). Exists on every kernel; only
    /// its fd ([`OutFence::reserve_fd`]) needs `sync_file`.
    pub(crate) fn new(engine: *const c_void) -> Result<Self> {
        // SAFETY: Allocates and initialises a fence; no precondition.
        NonNull::new(unsafe { ffi::tdrv_fence_new(engine) })
            .map(Self)
            .ok_or(ENOMEM)
    }

    /// The `struct dma_fence`, for the C side; valid while `self` is.
    pub(crate) fn as_raw(&self) -> *mut c_void {
        self.0.as_ptr()
    }

    /// The job reached its engine's queue (see `resv.rs`): later jobs of
    /// the same engine need not wait for this fence.
    pub(crate) fn set_queued(&self) {
        // SAFETY: The fence is live (we hold a reference); the flag is a
        // release store, safe from any context.
        unsafe { ffi::tdrv_fence_set_queued(self.0.as_ptr()) }
    }

    /// Signals the fence with `errno` (0, or the job's negative errno) and
    /// drops this reference.
    pub(crate) fn signal(self, errno: i32) {
        let fence = self.0;
        core::mem::forget(self);
        // SAFETY: `fence` is a live fence we hold a reference to; it was
        // not signalled (only this function and `drop` signal, each
        // consuming the only `OutFence` of the fence). The reference is
        // dropped after use.
        unsafe {
            ffi::tdrv_fence_signal(fence.as_ptr(), errno);
            ffi::tdrv_fence_put(fence.as_ptr());
        }
    }

    /// A `sync_file` of the fence behind a reserved (not yet installed)
    /// O_CLOEXEC descriptor. EMFILE, ENOMEM.
    pub(crate) fn reserve_fd(&self) -> Result<FenceFd> {
        let mut file = core::ptr::null_mut();
        // SAFETY: The fence is live (we hold a reference); the sync_file
        // takes its own. `file` is a valid out pointer.
        let fd = unsafe { ffi::tdrv_fence_fd_reserve(self.0.as_ptr(), &mut file) };
        to_result(fd)?;
        Ok(FenceFd {
            fd,
            file: NonNull::new(file).ok_or(ENOMEM)?,
        })
    }
}

impl Drop for OutFence {
    fn drop(&mut self) {
        // SAFETY: As in `signal`: the fence is live and unsignalled, and
        // this is its only `OutFence`.
        unsafe {
            ffi::tdrv_fence_signal(self.0.as_ptr(), ecanceled().to_errno());
            ffi::tdrv_fence_put(self.0.as_ptr());
        }
    }
}

/// A reserved descriptor and the `sync_file` for it. Installing makes it
/// visible to userspace; dropping it frees both. Not `Send`: the
/// descriptor is reserved in the current task's table.
pub(crate) struct FenceFd {
    fd: i32,
    file: NonNull<c_void>,
}

impl FenceFd {
    /// The descriptor number userspace will see.
    pub(crate) fn fd(&self) -> i32 {
        self.fd
    }

    /// Publishes the descriptor. Cannot fail.
    pub(crate) fn install(self) {
        let (fd, file) = (self.fd, self.file);
        core::mem::forget(self);
        // SAFETY: `fd` was reserved in this task's table (not `Send`), for
        // this `file`, whose reference `fd_install` takes over.
        unsafe { ffi::tdrv_fence_fd_install(fd, file.as_ptr()) }
    }
}

impl Drop for FenceFd {
    fn drop(&mut self) {
        // SAFETY: As in `install`: our reservation and our file reference,
        // given back once.
        unsafe { ffi::tdrv_fence_fd_discard(self.fd, self.file.as_ptr()) }
    }
}

/// The in-fences of a job: references to the fences of the `sync_file`
/// fds given to SUBMIT, and the callbacks armed on them. Dropping it
/// removes the callbacks (waiting for one that is running) and drops the
/// references.
pub(crate) struct InFences(NonNull<c_void>);

// SAFETY: The C set is only mutated by `arm` (once, see its contract) and
// by the fence callbacks, which synchronise through an atomic counter;
// `error` only reads fence states under their locks; `drop` is exclusive.
unsafe impl Send for InFences {}
// SAFETY: As above.
unsafe impl Sync for InFences {}

impl InFences {
    /// Takes the fences of `fds`: EBADF for a descriptor that is not open,
    /// EINVAL for one that is not a `sync_file`, EOPNOTSUPP without
    /// `sync_file`, ENOMEM.
    pub(crate) fn from_fds(fds: &[i32]) -> Result<Self> {
        let count = u32::try_from(fds.len()).map_err(|_| EINVAL)?;
        let mut deps = core::ptr::null_mut();
        // SAFETY: `fds` is valid for `count` reads; `deps` is a valid out
        // pointer.
        to_result(unsafe { ffi::tdrv_deps_new(fds.as_ptr(), count, &mut deps) })?;
        Ok(Self(NonNull::new(deps).ok_or(ENOMEM)?))
    }

    /// Arms a callback on every fence: returns true if all have signalled
    /// already; otherwise `tdrv_deps_ready(ctx)` runs once when the last
    /// one signals (from any context), unless `self` is dropped first.
    ///
    /// # Safety
    ///
    /// Called at most once per set. `ctx` must stay valid for
    /// `tdrv_deps_ready` until `self` is dropped.
    pub(crate) unsafe fn arm(&self, ctx: *const c_void) -> bool {
        // SAFETY: A live set, armed once (caller's contract).
        unsafe { ffi::tdrv_deps_arm(self.0.as_ptr(), ctx.cast_mut()) }
    }

    /// Gives up the set for the C side ([`InFences::from_raw`] takes it
    /// back).
    pub(crate) fn into_raw(self) -> *mut c_void {
        let me = core::mem::ManuallyDrop::new(self);
        me.0.as_ptr()
    }

    /// Takes back a set from [`InFences::into_raw`] (or one the C side
    /// built from it); `None` for null.
    ///
    /// # Safety
    ///
    /// `raw` is null or a set nobody else owns.
    pub(crate) unsafe fn from_raw(raw: *mut c_void) -> Option<Self> {
        NonNull::new(raw).map(Self)
    }

    /// The first in-fence error, once all have signalled (implicit
    /// dependencies, see `resv.rs`, do not count).
    pub(crate) fn error(&self) -> Result {
        // SAFETY: A live set; reading fence states is safe at any time.
        to_result(unsafe { ffi::tdrv_deps_error(self.0.as_ptr()) })
    }
}

impl Drop for InFences {
    fn drop(&mut self) {
        // SAFETY: A live set, freed once; `tdrv_deps_free` removes (or
        // waits for) every callback before freeing it.
        unsafe { ffi::tdrv_deps_free(self.0.as_ptr()) }
    }
}
