// SPDX-License-Identifier: GPL-2.0

//! Implicit synchronisation: tdrv jobs in the reservation objects
//! (`dma_resv`) of their buffers' dma-bufs, as drm_sched's implicit
//! dependencies work. The C side is `resv.c` (7.2 has no Rust `dma_resv`).
//!
//! # Which buffers take part
//!
//! Only buffers with a dma-buf: a tdrv buffer once it has been exported,
//! and every import of a foreign dma-buf. Nobody outside tdrv can see a
//! buffer without one, and tdrv orders its own jobs through the buffers'
//! fences (`fence.rs`) and the engines' order, so a reservation object
//! (and a lock, a fence and an allocation per job) would buy nothing for
//! the rest.
//!
//! - A tdrv buffer gets its reservation object at its first EXPORT; every
//!   dma-buf exported from it shares that one (`dma_buf_export_info.resv`),
//!   so `poll(2)` and the sync_file ioctls of any of its fds see the same
//!   fences. The buffer owns it and frees it when it goes, after every
//!   dma-buf (each holds a buffer reference). Jobs submitted before the
//!   first EXPORT are not in it (nobody could have looked).
//! - An imported foreign dma-buf's object is the exporter's
//!   (`dma_buf.resv`); the buffer keeps a reference to the dma-buf for it,
//!   beyond the import's release at unbind. A re-export of such a buffer
//!   uses the same object.
//!
//! # At SUBMIT
//!
//! A job that uses such buffers gets a fence (the out-fence, also without
//! `TDRV_SUBMIT_OUT_FENCE` and on kernels without `CONFIG_SYNC_FILE`),
//! signalled when the job ends, with its errno. Before the job is queued,
//! with every object of the job locked at once (ww mutexes), tdrv
//!
//! 1. reserves a fence slot in each (`dma_resv_reserve_fences`), so that
//!    nothing allocates once the fence is published;
//! 2. collects the unsignalled fences the job must wait for: a destination
//!    waits for readers and writers (`DMA_RESV_USAGE_READ`), a source for
//!    writers (`DMA_RESV_USAGE_WRITE`); the fences of tdrv jobs already in
//!    the same engine's queue are left out, since the engine runs jobs
//!    that share a buffer in order (drm_sched likewise waits only for a
//!    job of its own ring to be scheduled, not to finish);
//! 3. adds the job's fence to each object: WRITE usage where the job
//!    writes a buffer behind it, READ where it only reads.
//!
//! The collected fences join the job's in-fences as implicit dependencies:
//! the job is held by its file (like a job with in-fence fds, see
//! `fence_fd.rs`) until they have signalled. Unlike an in-fence fd, an
//! implicit dependency's error does not fail the job: it orders the job
//! behind the other work, nothing more (that work's owner sees its own
//! error; a tdrv job that failed writing a buffer latches the buffer's
//! error as ever).
//!
//! A file's jobs that use reservation objects go through this step one at
//! a time, together with taking their id (the file's `submit_lock`): so a
//! job never waits for the fence of a job its file holds behind it, and
//! the waits between jobs always point to jobs that published their fence
//! earlier, which cannot form a cycle.
//!
//! If SUBMIT fails after step 3 (the file's job limit, say), the job's
//! fence is signalled with ECANCELED at once: the objects never wait for a
//! job that does not exist.
//!
//! # Signalling rules
//!
//! None of this runs on a signalling path. The completion path signals the
//! fence (`fence_fd.c`) and takes no reservation lock and allocates
//! nothing; the reservation objects drop signalled fences lazily (the next
//! `dma_resv_add_fence` replaces them). A buffer's object may be freed by
//! the last buffer reference, which can go on the completion path:
//! `dma_resv_fini` only puts fences and frees memory.
//!
//! # CPU access
//!
//! `DMA_BUF_IOCTL_SYNC` (`begin_cpu_access`) of a tdrv dma-buf waits for
//! the object's fences first (other drivers' work and imported
//! sync_files), then for tdrv's own pending accesses as before. COPY_IN,
//! COPY_OUT, MEMSET and COPY wait for tdrv's jobs only (see `fence.rs`).

use core::ffi::c_void;

use kernel::{
    error::to_result,
    prelude::*, //
};

use crate::{
    fence_fd::{
        InFences,
        OutFence, //
    },
    job::Transfer, //
};

mod ffi {
    use core::ffi::{
        c_int,
        c_void, //
    };

    extern "C" {
        pub(super) fn tdrv_resv_new() -> *mut c_void;
        pub(super) fn tdrv_resv_free(resv: *mut c_void);
        pub(super) fn tdrv_resv_attach(
            uses: *mut super::ResvUse,
            n: u32,
            fence: *mut c_void,
            engine: *const c_void,
            depsp: *mut *mut c_void,
        ) -> c_int;
    }
}

/// `struct tdrv_resv_use`: one reservation object a job uses.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ResvUse {
    resv: *mut c_void,
    write: u32,
    pad: u32,
}

/// The reservation objects of a job's buffers (one entry per use; the C
/// side merges them).
pub(crate) struct ResvUses(KVec<ResvUse>);

impl ResvUses {
    /// The objects `transfers` use; `None` if no buffer has one (the job
    /// takes no part in implicit synchronisation).
    pub(crate) fn of(transfers: &[Transfer]) -> Result<Option<Self>> {
        let mut v = KVec::new();
        for t in transfers {
            for (buf, write) in [(&t.src, false), (&t.dst, true)] {
                let resv = buf.resv();
                if !resv.is_null() {
                    v.push(
                        ResvUse {
                            resv,
                            write: u32::from(write),
                            pad: 0,
                        },
                        GFP_KERNEL_ACCOUNT,
                    )?;
                }
            }
        }
        Ok((!v.is_empty()).then_some(Self(v)))
    }

    /// Steps 1-3 of the module documentation: returns the job's
    /// dependencies, `deps` (the in-fence fds, not armed yet) plus the
    /// implicit ones. Fails on a signal while locking (EINTR) or with
    /// ENOMEM, with nothing added anywhere and `deps` dropped.
    pub(crate) fn attach(
        mut self,
        fence: &OutFence,
        engine: *const c_void,
        deps: Option<InFences>,
    ) -> Result<Option<InFences>> {
        let mut raw = deps.map_or(core::ptr::null_mut(), InFences::into_raw);
        let n = u32::try_from(self.0.len()).map_err(|_| EINVAL)?;
        // SAFETY: `self.0` holds `n` entries, each a live reservation
        // object (the job's transfers hold the buffers, which keep their
        // objects alive); the fence is live (we hold it); `raw` is null or
        // an unarmed set we own, which the call replaces on success only.
        let r = unsafe {
            ffi::tdrv_resv_attach(self.0.as_mut_ptr(), n, fence.as_raw(), engine, &mut raw)
        };
        // SAFETY: `raw` is null or the set we own (the old one on failure,
        // the new one on success).
        let deps = unsafe { InFences::from_raw(raw) };
        to_result(r)?;
        Ok(deps)
    }
}

/// A tdrv buffer's own reservation object (see the module documentation).
pub(crate) fn new_own() -> Result<*mut c_void> {
    // SAFETY: Allocates and initialises; no precondition.
    let resv = unsafe { ffi::tdrv_resv_new() };
    if resv.is_null() {
        return Err(ENOMEM);
    }
    Ok(resv)
}

/// Frees an object from [`new_own`] that nothing uses any more.
///
/// # Safety
///
/// `resv` came from [`new_own`], is freed once, and no dma-buf or job
/// uses it.
pub(crate) unsafe fn free_own(resv: *mut c_void) {
    // SAFETY: The caller's guarantee.
    unsafe { ffi::tdrv_resv_free(resv) }
}
