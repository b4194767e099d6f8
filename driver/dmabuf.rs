// SPDX-License-Identifier: GPL-2.0

//! dma-buf export (`TDRV_IOC_EXPORT`) and import (`TDRV_IOC_IMPORT`).
//!
//! 7.2 has no Rust dma-buf abstraction; `dmabuf.c` holds the C side (the
//! `dma_buf_ops` table, export info, scatterlist walks) behind the narrow
//! interface of `dmabuf.h`, and this file wraps it.
//!
//! # Export
//!
//! An exported dma-buf holds one reference to its [`Buffer`], so it is the
//! same memory, fence and completion count as the handle it came from, and
//! outlives FREE, the exporter's close and exit. Its `owner` is this
//! module: `rmmod` fails while an exported fd exists. tdrv recognises its
//! own dma-bufs by their ops table: IMPORT of one resolves to the original
//! buffer (no copy), in any file of the same device; another tdrv device
//! imports it like a foreign dma-buf (below); device memory only
//! peer-to-peer, by a DMA engine with a PCI path to it (edu), with the
//! exporting buffer moving the bytes of the import's CPU paths.
//!
//! - mmap of the dma-buf fd maps the buffer like tdrv's own mmap (shared,
//!   not executable, pages inserted at fault time, SIGBUS after unbind).
//!   Unbind zaps these mappings too: every device lists its live exports,
//!   each with a reference to its file's inode (see [`Exports`]).
//!   The dma-buf's size is the buffer's, rounded up to pages.
//! - `DMA_BUF_IOCTL_SYNC` with `DMA_BUF_SYNC_START` waits, like COPY_OUT
//!   (read) or COPY_IN (write), for the device writes (read) or all device
//!   accesses (write) pending on the buffer; a signal interrupts it. It does
//!   not hold jobs off until `SYNC_END` (which does nothing): the kernel
//!   cannot rely on userspace pairing the two, and a forgotten END must not
//!   block other users of the buffer. The error latch does not fail SYNC;
//!   after unbind it is ENODEV.
//! - Other devices attach, pin and map it (see "Sharing" below).
//!
//! # Sharing
//!
//! The exporter serves any importer: `attach` checks that the pages are
//! within the importer's DMA mask (EIO); device memory (BAR memory, no
//! struct pages) it maps peer-to-peer for importers that take it and
//! that the kernel's PCI P2P DMA reaches, and refuses otherwise
//! (EOPNOTSUPP, with a rate-limited line in the log saying why); `pin` has
//! nothing to do (the memory never moves); `map_dma_buf` builds an
//! sg_table of every page of every piece and maps it for the importer's
//! device; `vmap` maps the pages into the kernel for CPU importers.
//!
//! Every DMA mapping and vmap counts as a user of the export's pages
//! (`struct tdrv_export` in `dmabuf.c`), counted before the buffer is
//! asked for its pages and refused once unbind detached them.
//!
//! # Revocation
//!
//! Unbind detaches every buffer, then for each live export calls
//! `dma_buf_invalidate_mappings` under its reservation lock and waits (at
//! most [`REVOKE_WAIT_MS`]) until revocable importers (those with an
//! `invalidate_mappings` callback, `dma_buf_attach_revocable`) have
//! unmapped. A buffer whose pages are still mapped or vmapped (static
//! importers, a sim device's imports) is not freed by unbind: its memory goes
//! with the buffer's last reference, which the dma-buf holds until every
//! importer has let go. So no page returns to the allocator while a device
//! may still reach it.
//!
//! # Revocation of imports
//!
//! tdrv's own imports are revocable where the engine ends its accesses in
//! bounded time ([`crate::engine::Engine::revocable_imports`]: software,
//! edu): a dynamic, pinned attachment whose `invalidate_mappings`
//! (`dmabuf.c`) marks the import revoked, waits for the accesses in
//! progress, zaps the importing device's user mappings and unmaps. Every
//! access to an import's memory, by a job between [`Job::begin_access`]
//! and its completion, by an ioctl or a fault ([`Buffer::enter`]), counts
//! in the import's access word ([`ImportRef`]) and fails with ENODEV once
//! it is revoked. The word outlives the import's mappings: the buffer
//! holds a reference to the import object for it.
//!
//! [`Job::begin_access`]: crate::job::Job::begin_access
//! [`Buffer::enter`]: crate::buffer::Buffer::enter
//!
//! # Import of foreign dma-bufs
//!
//! A foreign dma-buf (for example from `/dev/dma_heap/system`) is mapped
//! into the kernel (`dma_buf_vmap`) for CPU access: the software engine,
//! COPY_IN/OUT, MEMSET and mmap use that mapping. For a device whose engine
//! does DMA, the dma-buf is also attached and mapped for the device once,
//! at IMPORT, and the buffer's pieces are its pages with their bus
//! addresses. A device whose DMA mask does not reach the pages fails the
//! IMPORT with the mapping's error. The import is not charged to a channel
//! (the exporter accounts the memory) but lives on the channel the caller
//! names, for SUBMIT's same-channel rule. Unbind unmaps, detaches and
//! releases every import before the device goes away; the handle stays, as
//! an empty shell, like every buffer's.
//!
//! When the exporter cannot make the kernel mapping (out of memory), IMPORT
//! fails with its error (ENOMEM), and the dma-buf core logs a warning of
//! its own (`dma_buf_vmap` WARNs once on an exporter's vmap failure);
//! tdrv has no other way to reach a foreign dma-buf's bytes with the CPU
//! (the pages of an importer's scatterlist are off limits).
//!
//! Jobs take part in the dma-buf's reservation object (implicit
//! synchronisation): see `resv.rs`. Every export of a buffer shares the
//! buffer's object, so `poll(2)` of any of its fds waits for its jobs.

use kernel::{
    bindings,
    error::from_err_ptr,
    mm::virt::VmaNew,
    page::PAGE_SIZE,
    prelude::*,
    rbtree::{
        RBTree,
        RBTreeNode, //
    },
    sync::{
        atomic::{
            Atomic,
            Relaxed, //
        },
        Arc,
        ArcBorrow,
        Mutex, //
    }, //
};

use crate::{
    buffer::Buffer,
    charge::Charge,
    device::TdrvDevice,
    fence::Timeout,
    mmap,
    uapi::{
        FENCE_ALL,
        FENCE_WRITES, //
    }, //
};

/// C objects passed through opaquely (bindgen's layouts of them contain
/// zero-sized members that the FFI lint rejects).
type Opaque = core::ffi::c_void;

mod ffi {
    use super::Opaque;

    extern "C" {
        pub(super) fn tdrv_dmabuf_export(
            buf: *const core::ffi::c_void,
            size: usize,
            resv: *mut Opaque,
        ) -> *mut Opaque;
        pub(super) fn tdrv_import_get(imp: *mut core::ffi::c_void) -> *mut core::ffi::c_void;
        pub(super) fn tdrv_import_put(imp: *mut core::ffi::c_void);
        pub(super) fn tdrv_import_resv(imp: *const core::ffi::c_void) -> *mut Opaque;
        pub(super) fn tdrv_import_access_begin(imp: *mut core::ffi::c_void) -> bool;
        pub(super) fn tdrv_import_access_end(imp: *mut core::ffi::c_void);
        pub(super) fn tdrv_import_revoked(imp: *const core::ffi::c_void) -> bool;
        pub(super) fn tdrv_dmabuf_hold_inode(dmabuf: *mut Opaque) -> *mut Opaque;
        pub(super) fn tdrv_dmabuf_zap(inode: *mut Opaque);
        pub(super) fn tdrv_dmabuf_put_inode(inode: *mut Opaque);
        pub(super) fn tdrv_dmabuf_reserve_fd() -> core::ffi::c_int;
        pub(super) fn tdrv_dmabuf_install(dmabuf: *mut Opaque, fd: core::ffi::c_int);
        pub(super) fn tdrv_dmabuf_unreserve_fd(fd: core::ffi::c_int);
        pub(super) fn tdrv_dmabuf_put(dmabuf: *mut Opaque);
        pub(super) fn tdrv_dmabuf_revoke(dmabuf: *mut Opaque, timeout: core::ffi::c_ulong) -> core::ffi::c_int;
        pub(super) fn tdrv_dmabuf_log_no_p2p();
        pub(super) fn tdrv_dmabuf_users(dmabuf: *mut Opaque) -> core::ffi::c_int;
        pub(super) fn tdrv_dmabuf_lookup(
            fd: core::ffi::c_int,
            dmabuf: *mut *mut Opaque,
            own: *mut *const core::ffi::c_void,
        ) -> core::ffi::c_int;
        pub(super) fn tdrv_import_new(
            dmabuf: *mut Opaque,
            dev: *mut Opaque,
            dma: bool,
            ctx: *const core::ffi::c_void,
            p2p: bool,
        ) -> *mut core::ffi::c_void;
        pub(super) fn tdrv_import_size(imp: *const core::ffi::c_void) -> usize;
        pub(super) fn tdrv_import_vaddr(imp: *const core::ffi::c_void) -> *mut core::ffi::c_void;
        pub(super) fn tdrv_import_dma_pages(imp: *const core::ffi::c_void, dma: *mut u64, pages: usize);
        pub(super) fn tdrv_import_release(imp: *mut core::ffi::c_void);
        pub(super) fn tdrv_import_release_later(imp: *mut core::ffi::c_void, released: *const core::ffi::c_void);
        pub(super) fn tdrv_import_flush_releases();
        pub(super) fn tdrv_dmabuf_module_init() -> core::ffi::c_int;
        pub(super) fn tdrv_dmabuf_module_exit();
    }
}

/// The live exports of one device's buffers, by dma-buf, so that unbind
/// can zap their mappings.
///
/// Kept per device, not per buffer: few buffers are ever exported, and a
/// lock and list in every buffer would cost every buffer a larger slab
/// object.
#[pin_data]
pub(crate) struct Exports {
    #[pin]
    live: Mutex<RBTree<usize, ExportMapping>>,
}

impl Exports {
    pub(crate) fn new() -> impl PinInit<Self> {
        pin_init!(Self {
            live <- kernel::new_mutex!(RBTree::new(), "Exports::live"),
        })
    }

    /// Records a new export.
    fn add(&self, mapping: ExportMapping) -> Result {
        let node = RBTreeNode::new(mapping.dmabuf as usize, mapping, GFP_KERNEL)?;
        // A dma-buf leaves the registry in its release, before its memory
        // can be reused for another one: no key is ever replaced.
        let old = self.live.lock().insert(node);
        drop(old);
        Ok(())
    }

    /// Forgets the export `dmabuf`, which is being released; the record is
    /// dropped (its inode reference put) outside the lock.
    fn remove(&self, dmabuf: *mut Opaque) -> Option<ExportMapping> {
        self.live.lock().remove(&(dmabuf as usize))
    }

    /// Unbind: removes the pages of every mapping of every live export
    /// (after the buffers were detached, so none comes back).
    pub(crate) fn zap_all(&self) {
        for m in self.live.lock().values() {
            m.zap();
        }
    }

    /// Unbind, after the buffers were detached: tells every importer of
    /// every live export to drop its mappings, and gives revocable ones
    /// [`REVOKE_WAIT_MS`] to do so.
    ///
    /// The lock is held throughout, so no export is released meanwhile:
    /// its release callback waits for it, and only runs once the last
    /// dma-buf reference is gone, after every importer's mappings (which
    /// hold references) are.
    pub(crate) fn revoke_all(&self) {
        let timeout = kernel::time::msecs_to_jiffies(REVOKE_WAIT_MS);
        for m in self.live.lock().values() {
            // SAFETY: The dma-buf is alive: its release removes it from
            // this list under the lock we hold; it is a tdrv export.
            unsafe { ffi::tdrv_dmabuf_revoke(m.dmabuf, timeout as core::ffi::c_ulong) };
        }
    }

    /// Unbind: the buffers (as [`Exports::key_of`] names them) whose
    /// memory another device or the kernel still maps through one of
    /// their exports; unbind leaves that memory to the buffer's last
    /// reference (the dma-buf's release) instead of freeing it.
    ///
    /// Collected before the registry sweep rather than asked during it:
    /// `live` is held while taking reservation locks (`revoke_all`), and
    /// the sweep lock is taken on a job's completion path (a buffer's last
    /// reference), inside a dma-fence signalling section, so the sweep
    /// must not take `live`.
    pub(crate) fn in_use_keys(&self) -> Result<KVec<usize>> {
        let live = self.live.lock();
        let mut keys = KVec::new();
        for m in live.values() {
            // SAFETY: As in `revoke_all`.
            if unsafe { ffi::tdrv_dmabuf_users(m.dmabuf) } > 0 {
                keys.push(m.buf, GFP_KERNEL)?;
            }
        }
        Ok(keys)
    }

    /// How [`Exports::in_use_keys`] names `buf`.
    pub(crate) fn key_of(buf: &Buffer) -> usize {
        core::ptr::from_ref(buf) as usize
    }
}

/// How long unbind waits for revocable importers (whose `invalidate_mappings`
/// promises an unmap in bounded time) to unmap an export.
const REVOKE_WAIT_MS: u32 = 10_000;

/// A live export, as its device records it: the dma-buf (only as a key,
/// never dereferenced) and a reference to the inode of its file, whose
/// address space every mmap of the dma-buf hangs off.
///
/// The inode reference is needed because the dma-buf core releases the
/// dma-buf (our release callback) when its dentry dies, after the dentry
/// has let go of the inode: without our reference the address space could
/// be gone while unbind still finds the export in the list.
pub(crate) struct ExportMapping {
    dmabuf: *mut Opaque,
    /// The exported buffer's address (only compared).
    buf: usize,
    inode: *mut Opaque,
    /// The exporting handle's charge, kept while the dma-buf lives (see
    /// `charge.rs`).
    _charge: Arc<Charge>,
}

// SAFETY: The inode reference may be used and dropped from any thread;
// the dma-buf pointer is only compared.
unsafe impl Send for ExportMapping {}
// SAFETY: `zap` may run concurrently from several threads.
unsafe impl Sync for ExportMapping {}

impl ExportMapping {
    /// Takes a reference to the inode of `dmabuf`'s file.
    ///
    /// # Safety
    ///
    /// The caller holds a reference to `dmabuf`.
    unsafe fn new(dmabuf: *mut Opaque, buf: *const Buffer, charge: Arc<Charge>) -> Self {
        // SAFETY: `dmabuf` and its file are alive (the caller's reference).
        let inode = unsafe { ffi::tdrv_dmabuf_hold_inode(dmabuf) };
        Self {
            dmabuf,
            buf: buf as usize,
            inode,
            _charge: charge,
        }
    }

    /// Removes every user page table entry of the dma-buf's mappings.
    pub(crate) fn zap(&self) {
        // SAFETY: We hold a reference to the inode, so its address space
        // is alive.
        unsafe { ffi::tdrv_dmabuf_zap(self.inode) };
    }
}

impl Drop for ExportMapping {
    fn drop(&mut self) {
        // SAFETY: The reference taken in `new`, given back once.
        unsafe { ffi::tdrv_dmabuf_put_inode(self.inode) };
    }
}

/// A dma-buf fd reserved for an export, not yet visible to userspace.
/// Dropping it gives back the fd and the dma-buf (whose release then drops
/// its buffer reference).
pub(crate) struct PendingExport {
    dmabuf: *mut Opaque,
    fd: i32,
}

impl PendingExport {
    /// The fd number the export will have.
    pub(crate) fn fd(&self) -> i32 {
        self.fd
    }

    /// Publishes the fd in the caller's fd table. Cannot fail.
    pub(crate) fn install(self) {
        let me = core::mem::ManuallyDrop::new(self);
        // SAFETY: `fd` was reserved in this task and never installed;
        // `dmabuf` is our reference, which the fd table takes over.
        unsafe { ffi::tdrv_dmabuf_install(me.dmabuf, me.fd) };
    }
}

impl PendingExport {
    /// Gives back the fd and keeps the dma-buf reference (for KUnit tests,
    /// which have no fd table to install it in).
    #[cfg(CONFIG_KUNIT)]
    fn into_dmabuf(self) -> *mut Opaque {
        let me = core::mem::ManuallyDrop::new(self);
        // SAFETY: Reserved and never installed.
        unsafe { ffi::tdrv_dmabuf_unreserve_fd(me.fd) };
        me.dmabuf
    }
}

impl Drop for PendingExport {
    fn drop(&mut self) {
        // SAFETY: The fd was reserved and not installed; the dma-buf
        // reference is ours.
        unsafe {
            ffi::tdrv_dmabuf_unreserve_fd(self.fd);
            ffi::tdrv_dmabuf_put(self.dmabuf);
        }
    }
}

/// Exports `buf` as a dma-buf and reserves an fd for it (O_CLOEXEC; the
/// file is O_RDWR). The device records the export so that unbind can zap
/// its mappings; the record keeps `charge` until the dma-buf is released.
pub(crate) fn export(buf: Arc<Buffer>, charge: Arc<Charge>) -> Result<PendingExport> {
    // SAFETY: No preconditions.
    let fd = unsafe { ffi::tdrv_dmabuf_reserve_fd() };
    if fd < 0 {
        return Err(Error::from_errno(fd));
    }
    // dma-bufs are whole pages (mmap and importers count in pages).
    let size = buf.size().next_multiple_of(PAGE_SIZE);
    let resv = match buf.export_resv() {
        Ok(r) => r,
        Err(e) => {
            // SAFETY: Reserved above, never installed.
            unsafe { ffi::tdrv_dmabuf_unreserve_fd(fd) };
            return Err(e);
        }
    };
    let raw = Arc::into_raw(buf);
    // SAFETY: `raw` is a buffer reference, which the dma-buf takes over on
    // success (and gives back through `tdrv_dmabuf_release_buffer`).
    // `resv` lives as long as the buffer (see `Buffer::export_resv`),
    // which the dma-buf holds; the dma-buf core uses it no more after
    // that release.
    let dmabuf = match from_err_ptr(unsafe { ffi::tdrv_dmabuf_export(raw.cast(), size, resv) }) {
        Ok(d) => d,
        Err(e) => {
            // SAFETY: On failure the reference is still ours.
            drop(unsafe { Arc::from_raw(raw) });
            // SAFETY: Reserved above, never installed.
            unsafe { ffi::tdrv_dmabuf_unreserve_fd(fd) };
            return Err(e);
        }
    };
    let pending = PendingExport { dmabuf, fd };
    // SAFETY: `pending` holds a reference to the dma-buf.
    let mapping = unsafe { ExportMapping::new(dmabuf, raw, charge) };
    // SAFETY: The dma-buf holds the reference `raw` came from until its
    // release, which cannot run while `pending` holds the dma-buf. (On
    // failure `mapping` is dropped, then `pending`.)
    unsafe { &*raw }.device().exports.add(mapping)?;
    Ok(pending)
}

/// What an fd passed to IMPORT refers to.
pub(crate) enum Lookup {
    /// One of tdrv's exports: its buffer, and the dma-buf (for an import
    /// by another tdrv device, which maps it like a foreign one).
    Own(Arc<Buffer>, DmaBufRef),
    /// Another exporter's dma-buf.
    Foreign(DmaBufRef),
}

/// A reference to a foreign dma-buf.
pub(crate) struct DmaBufRef(*mut Opaque);

impl Drop for DmaBufRef {
    fn drop(&mut self) {
        // SAFETY: The reference is ours.
        unsafe { ffi::tdrv_dmabuf_put(self.0) };
    }
}

/// Resolves `fd`: EBADF if it is not an open fd, EINVAL if it is not a
/// dma-buf.
pub(crate) fn lookup(fd: i32) -> Result<Lookup> {
    let mut dmabuf = core::ptr::null_mut();
    let mut own = core::ptr::null();
    // SAFETY: Both out-pointers are valid for writes.
    let r = unsafe { ffi::tdrv_dmabuf_lookup(fd, &mut dmabuf, &mut own) };
    if r < 0 {
        return Err(Error::from_errno(r));
    }
    let dmabuf = DmaBufRef(dmabuf);
    if own.is_null() {
        return Ok(Lookup::Foreign(dmabuf));
    }
    // SAFETY: `own` is the buffer reference a tdrv dma-buf holds (from
    // `export`); `dmabuf` keeps the dma-buf, and so that reference, alive
    // while we take our own.
    let buf = Arc::from(unsafe { ArcBorrow::from_raw(own.cast::<Buffer>()) });
    Ok(Lookup::Own(buf, dmabuf))
}

/// Logs (rate-limited) why an IMPORT of another tdrv device's device
/// memory failed.
pub(crate) fn log_no_p2p() {
    // SAFETY: No preconditions.
    unsafe { ffi::tdrv_dmabuf_log_no_p2p() }
}

/// The foreign dma-bufs one device holds (`device_max_imports`).
///
/// An import is counted from IMPORT until its release has *run*, not until
/// its buffer goes: a release queued by [`Import::release_later`] keeps the
/// attachment, its mapping and the dma-buf reference until the queue gets
/// to it, and those are what the limit bounds.
pub(crate) struct ImportCount {
    held: Atomic<u32>,
    max: u32,
}

impl ImportCount {
    /// A count of none, at most `max`.
    pub(crate) fn new(max: u32) -> Result<Arc<Self>> {
        Arc::new(
            Self {
                held: Atomic::new(0),
                max,
            },
            GFP_KERNEL,
        )
        .map_err(Into::into)
    }

    /// Counts one more import; ENOSPC at the limit. A release queued
    /// earlier may be about to give its slot back, so the queue is flushed
    /// once before the limit is reported: freeing an import and importing
    /// again right away must not fail. Sleeps.
    pub(crate) fn reserve(self: &Arc<Self>) -> Result<ImportSlot> {
        match self.try_reserve() {
            Err(e) if e == ENOSPC => {
                Import::flush_releases();
                self.try_reserve()
            }
            r => r,
        }
    }

    fn try_reserve(self: &Arc<Self>) -> Result<ImportSlot> {
        let mut n = self.held.load(Relaxed);
        loop {
            if n >= self.max {
                return Err(ENOSPC);
            }
            match self.held.cmpxchg(n, n + 1, Relaxed) {
                Ok(_) => return Ok(ImportSlot(self.clone())),
                Err(now) => n = now,
            }
        }
    }

    /// Imports counted now.
    pub(crate) fn held(&self) -> u32 {
        self.held.load(Relaxed)
    }
}

/// One counted import (see [`ImportCount::reserve`]); dropping it gives
/// the count back.
pub(crate) struct ImportSlot(Arc<ImportCount>);

impl Drop for ImportSlot {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Relaxed);
    }
}

/// An imported foreign dma-buf: its kernel mapping and, for a DMA device,
/// its attachment and mapping, and its slot in the device's
/// [`ImportCount`]. Dropping it releases all of them, the slot last.
pub(crate) struct Import {
    raw: *mut core::ffi::c_void,
    slot: ImportSlot,
}

// SAFETY: The C object is not tied to a thread; its accessors only read
// fields fixed at creation, and release happens once, in `drop`.
unsafe impl Send for Import {}
// SAFETY: As above.
unsafe impl Sync for Import {}

impl Import {
    /// Maps `dmabuf` for the CPU (unless `p2p`: peer-to-peer memory, no
    /// kernel mapping) and, with `dma`, for DMA by `dev`. With
    /// `owner` (the importing device) the import is revocable: the
    /// exporter's `invalidate_mappings` ends every access of the owner
    /// to it (see [`ImportRef`]), zaps the owner's user mappings and
    /// unmaps it.
    ///
    /// # Safety
    ///
    /// `dev` is a bound device that stays bound until the import is
    /// dropped or, after [`Import::release_later`], until
    /// [`Import::flush_releases`] returned. `slot` is the import's place
    /// in its device's count, given back with the import's release.
    pub(crate) unsafe fn new(
        dmabuf: DmaBufRef,
        dev: *mut Opaque,
        dma: bool,
        owner: Option<Arc<TdrvDevice>>,
        slot: ImportSlot,
        p2p: bool,
    ) -> Result<Self> {
        let dmabuf = core::mem::ManuallyDrop::new(dmabuf).0;
        let ctx = owner.map_or(core::ptr::null(), |d| Arc::into_raw(d).cast::<core::ffi::c_void>());
        // SAFETY: `dmabuf` is our reference, consumed by the call also on
        // failure; `dev` is bound (the caller's guarantee); `ctx` is null
        // or a device reference that the import gives back through
        // `tdrv_import_put_ctx`.
        let raw = from_err_ptr(unsafe { ffi::tdrv_import_new(dmabuf, dev, dma, ctx, p2p) });
        match raw {
            Ok(raw) => Ok(Self { raw, slot }),
            Err(e) => {
                if !ctx.is_null() {
                    // SAFETY: Not taken over on failure: ours again.
                    drop(unsafe { Arc::from_raw(ctx.cast::<TdrvDevice>()) });
                }
                Err(e)
            }
        }
    }

    /// A reference to the import's object, which outlives its mappings
    /// (the buffer's access gate and reservation object).
    pub(crate) fn get_ref(&self) -> ImportRef {
        // SAFETY: `self.raw` is a live import.
        ImportRef(unsafe { ffi::tdrv_import_get(self.raw) })
    }

    /// Size in bytes (a multiple of pages).
    pub(crate) fn size(&self) -> usize {
        // SAFETY: `self.raw` is a live import.
        unsafe { ffi::tdrv_import_size(self.raw) }
    }

    /// Kernel address of byte 0; the mapping is virtually contiguous. Null
    /// for a peer-to-peer import, which has none.
    pub(crate) fn vaddr(&self) -> *mut u8 {
        // SAFETY: `self.raw` is a live import.
        unsafe { ffi::tdrv_import_vaddr(self.raw) }.cast()
    }

    /// Bus address of every page (zeros without a device).
    pub(crate) fn dma_pages(&self, out: &mut [u64]) {
        // SAFETY: `self.raw` is a live import; `out` has room for `len` pages.
        unsafe { ffi::tdrv_import_dma_pages(self.raw, out.as_mut_ptr(), out.len()) }
    }

    /// Releases the import from the module's release queue instead of
    /// here: allocates nothing and takes no lock. The device it was
    /// mapped for must stay bound until [`Import::flush_releases`].
    pub(crate) fn release_later(self) {
        let me = core::mem::ManuallyDrop::new(self);
        // SAFETY: `me` is neither used nor dropped after this: its slot is
        // moved out once, here.
        let slot = core::mem::ManuallyDrop::new(unsafe { core::ptr::read(&me.slot) });
        // The slot's count reference goes to the queue; the slot's drop,
        // which would give the count back now, never runs.
        // SAFETY: Read once out of `slot`, which is never dropped.
        let count = Arc::into_raw(unsafe { core::ptr::read(&slot.0) });
        // SAFETY: The import is ours (not released: `drop` will not run)
        // and is released once, by the queued work, which then hands
        // `count` to `tdrv_import_released` once.
        unsafe { ffi::tdrv_import_release_later(me.raw, count.cast()) }
    }

    /// Returns once every release queued with [`Import::release_later`]
    /// before the call has run. Sleeps.
    pub(crate) fn flush_releases() {
        // SAFETY: Process context; the queue exists between module init
        // and exit (`DmabufModule`), around every device.
        unsafe { ffi::tdrv_import_flush_releases() }
    }
}

/// A reference to an import's object: the access gate of a buffer built
/// on it and the imported dma-buf (for its reservation object). Dropping
/// it takes no lock and allocates nothing, so a job's completion path may
/// drop the buffer holding it.
pub(crate) struct ImportRef(*mut core::ffi::c_void);

// SAFETY: The object's fields used here are atomics or fixed at creation.
unsafe impl Send for ImportRef {}
// SAFETY: As above.
unsafe impl Sync for ImportRef {}

impl ImportRef {
    /// The raw reference, to keep in a pointer-sized slot.
    pub(crate) fn into_raw(self) -> *mut core::ffi::c_void {
        core::mem::ManuallyDrop::new(self).0
    }

    /// Takes back a reference from [`ImportRef::into_raw`].
    ///
    /// # Safety
    ///
    /// `p` came from `into_raw` and is taken back once (or the result is
    /// never dropped).
    pub(crate) unsafe fn from_raw(p: *mut core::ffi::c_void) -> Self {
        Self(p)
    }

    /// The imported dma-buf's reservation object; lives as long as `self`.
    pub(crate) fn resv(&self) -> *mut Opaque {
        // SAFETY: Our reference keeps the object and its dma-buf.
        unsafe { ffi::tdrv_import_resv(self.0) }
    }

    /// Starts an access to the imported memory, which stays mapped until
    /// [`ImportRef::end_access`]: ENODEV once the exporter revoked it (or
    /// the import was released, at the importing device's unbind).
    pub(crate) fn begin_access(&self) -> Result {
        // SAFETY: Our reference keeps the object.
        if unsafe { ffi::tdrv_import_access_begin(self.0) } {
            Ok(())
        } else {
            Err(ENODEV)
        }
    }

    /// True once revoked (or released).
    pub(crate) fn revoked(&self) -> bool {
        // SAFETY: Our reference keeps the object.
        unsafe { ffi::tdrv_import_revoked(self.0) }
    }

    /// Ends an access begun with [`ImportRef::begin_access`]. Takes no
    /// lock but a wait queue's and allocates nothing.
    pub(crate) fn end_access(&self) {
        // SAFETY: Our reference keeps the object; an access is ours.
        unsafe { ffi::tdrv_import_access_end(self.0) }
    }
}

impl Drop for ImportRef {
    fn drop(&mut self) {
        // SAFETY: Our reference, given back once.
        unsafe { ffi::tdrv_import_put(self.0) }
    }
}

/// `tdrv_import_zap`: a revocable import of `ctx`'s device was revoked;
/// its files' user mappings go (faults then find the import revoked).
///
/// # Safety
///
/// `ctx` is the device reference given to `tdrv_import_new`, not yet put.
#[no_mangle]
unsafe extern "C" fn tdrv_import_zap(ctx: *const core::ffi::c_void) {
    // SAFETY: The caller's guarantee.
    let device = unsafe { &*ctx.cast::<TdrvDevice>() };
    device.zap_file_mappings();
}

/// `tdrv_import_put_ctx`: the import gives back its device reference.
///
/// # Safety
///
/// As for [`tdrv_import_zap`]; called once.
#[no_mangle]
unsafe extern "C" fn tdrv_import_put_ctx(ctx: *const core::ffi::c_void) {
    // SAFETY: The reference `Import::new` gave the import.
    drop(unsafe { Arc::from_raw(ctx.cast::<TdrvDevice>()) });
}

/// Module init: creates the import release queue. Call before any device
/// exists; dropping it (after every device is gone) drains and frees it.
pub(crate) struct DmabufModule(());

impl DmabufModule {
    pub(crate) fn init() -> Result<Self> {
        // SAFETY: Module init, before anything uses the queue.
        kernel::error::to_result(unsafe { ffi::tdrv_dmabuf_module_init() })?;
        Ok(Self(()))
    }
}

impl Drop for DmabufModule {
    fn drop(&mut self) {
        // SAFETY: Module exit or failed init: no device exists, so nothing
        // queues releases now; the queued ones run before it returns.
        unsafe { ffi::tdrv_dmabuf_module_exit() }
    }
}

impl Drop for Import {
    fn drop(&mut self) {
        // SAFETY: The import is ours and released once. (`slot` is dropped
        // after this, so the count covers the release.)
        unsafe { ffi::tdrv_import_release(self.raw) }
    }
}

/// The queued release of an import ran: its slot in the device's count
/// is free.
///
/// # Safety
///
/// `count` is what [`Import::release_later`] handed to the queue, given
/// back once.
#[no_mangle]
unsafe extern "C" fn tdrv_import_released(count: *const core::ffi::c_void) {
    // SAFETY: `Arc::into_raw` of the slot's reference, returned once (the
    // caller's guarantee).
    drop(ImportSlot(unsafe { Arc::from_raw(count.cast::<ImportCount>()) }));
}

/// `dma_buf_ops.release`: gives back the export's buffer reference.
///
/// # Safety
///
/// Called once per export, by the dma-buf core, with the reference
/// `export` gave the dma-buf.
#[no_mangle]
unsafe extern "C" fn tdrv_dmabuf_release_buffer(buf: *const Buffer, dmabuf: *mut Opaque) {
    // SAFETY: The reference `export` moved into the dma-buf.
    let buf = unsafe { Arc::from_raw(buf) };
    // (`dmabuf` is only compared: its file may be gone by now.)
    drop(buf.device().exports.remove(dmabuf));
    drop(buf);
}

/// `dma_buf_ops.mmap`.
///
/// # Safety
///
/// Called by the dma-buf core with a live export's buffer and a VMA under
/// set-up whose page offset and length it checked against the size.
#[no_mangle]
unsafe extern "C" fn tdrv_dmabuf_mmap_buffer(
    buf: *const Buffer,
    vma: *mut bindings::vm_area_struct,
) -> core::ffi::c_int {
    // SAFETY: The dma-buf holds a buffer reference during the call; we take
    // our own for the mapping.
    let buf = Arc::from(unsafe { ArcBorrow::from_raw(buf) });
    // SAFETY: `vma` is under set-up for the duration of the call.
    let vma = unsafe { VmaNew::from_raw(vma) };
    let device = buf.device().clone();
    let r = device.enter().and_then(|_active| {
        // The page offset (checked by the core) stays: fault offsets are
        // page indices in the buffer (see `mmap.rs`).
        mmap::map_buffer(buf, vma)
    });
    match r {
        Ok(()) => 0,
        Err(e) => e.to_errno(),
    }
}

/// `dma_buf_ops.begin_cpu_access`: waits for the device accesses a CPU
/// read (`write == false`) or write must not overlap.
///
/// # Safety
///
/// Called by the dma-buf core with a live export's buffer.
#[no_mangle]
unsafe extern "C" fn tdrv_dmabuf_begin_cpu(buf: *const Buffer, write: bool) -> core::ffi::c_int {
    // SAFETY: The dma-buf holds a buffer reference during the call.
    let buf = unsafe { &*buf };
    // After unbind there is no memory to access (its mappings fault).
    if !buf.device().is_bound() {
        return ENODEV.to_errno();
    }
    let kind = if write { FENCE_ALL } else { FENCE_WRITES };
    // The error latch does not end the wait: a failed write leaves the
    // bytes undefined, but reads still pending must end before a CPU
    // write (and SYNC does not report the latch).
    match buf.fence.wait_idle(kind, Timeout::Forever) {
        Ok(()) => 0,
        Err(e) => e.to_errno(),
    }
}

/// `dma_buf_ops` attach, map and vmap: the page frame of each of the first
/// `n` pages of the buffer.
///
/// # Safety
///
/// Called by `dmabuf.c` with a live export's buffer and room for `n`
/// frames at `pfns`, `n` at most the buffer's pages.
#[no_mangle]
unsafe extern "C" fn tdrv_dmabuf_buffer_pfns(
    buf: *const Buffer,
    pfns: *mut core::ffi::c_ulong,
    n: usize,
) -> core::ffi::c_int {
    // SAFETY: The dma-buf holds a buffer reference during the call.
    let buf = unsafe { &*buf };
    // Device memory has no struct pages for the DMA API or vmap. A
    // foreign import's pages are its exporter's, which may revoke them
    // (see "Revocation of imports"): a tdrv re-export of it does not hand
    // them to further importers, who would keep them beyond that (they
    // import the original dma-buf instead; mmap of the re-export works).
    if buf.on_device() || buf.is_foreign() {
        return crate::uapi::eopnotsupp().to_errno();
    }
    // SAFETY: The caller's guarantee; `c_ulong` is `usize` on Linux.
    let out = unsafe { core::slice::from_raw_parts_mut(pfns.cast::<usize>(), n) };
    let mut done = 0;
    while done < n {
        // Refused once unbind detached the memory: the caller counted its
        // mapping first, so unbind either sees it or it fails here.
        match buf.page_pfns(done, &mut out[done..]) {
            Some(k) => done += k,
            None => return ENODEV.to_errno(),
        }
    }
    0
}

/// `dma_buf_ops` attach and map: where the buffer's memory is (see
/// `tdrv_dmabuf_buffer_p2p` in `dmabuf.h`).
///
/// # Safety
///
/// Called by `dmabuf.c` with a live export's buffer and writable
/// `provider` and `phys`.
#[no_mangle]
unsafe extern "C" fn tdrv_dmabuf_buffer_p2p(
    buf: *const Buffer,
    provider: *mut *mut core::ffi::c_void,
    phys: *mut u64,
) -> core::ffi::c_int {
    // SAFETY: The dma-buf holds a buffer reference during the call.
    let buf = unsafe { &*buf };
    if !buf.on_device() {
        return 0;
    }
    match buf.p2p_range() {
        Some(range) => {
            // SAFETY: The caller's guarantee.
            unsafe {
                *provider = range.provider;
                *phys = range.phys;
            }
            1
        }
        None => ENODEV.to_errno(),
    }
}

#[kunit_tests(tdrv_dmabuf_export)]
mod tests {
    use super::{ffi, Opaque};
    use crate::{
        backends::soft::SoftDevice,
        buffer::Buffer,
        charge::{Account, Charge},
        device::Limits,
        range::ByteRange,
        Params,
    };
    use kernel::{
        page::PAGE_SIZE,
        prelude::*,
        sync::{Arc, UniqueArc},
    };

    extern "C" {
        fn tdrv_test_importer_new(
            dmabuf: *mut Opaque,
            name: *const u8,
            dynamic: bool,
        ) -> *mut Opaque;
        fn tdrv_test_importer_map(t: *mut Opaque) -> core::ffi::c_int;
        fn tdrv_test_importer_mapped_bytes(t: *mut Opaque) -> core::ffi::c_long;
        fn tdrv_test_importer_count_other(t: *mut Opaque, value: u8) -> core::ffi::c_long;
        fn tdrv_test_importer_invalidated(t: *mut Opaque) -> core::ffi::c_int;
        fn tdrv_test_importer_free(t: *mut Opaque);
        fn tdrv_test_resv_lock(dmabuf: *mut Opaque);
        fn tdrv_test_resv_unlock(dmabuf: *mut Opaque);
    }

    fn params() -> Params {
        Params {
            soft_devices: 1,
            channels: 1,
            channel_limit: 64 << 20,
            edu_dma_bits: 32,
            edu_timeout_ms: 10_000,
            sim_timeout_ms: 10_000,
            limits: Limits {
                handles: 16,
                bytes: 64 << 20,
                jobs: 16,
                inflight_bytes: 64 << 20,
                imports: 16,
                device_imports: 16,
                events: 16,
                device_events: 16,
            },
        }
    }

    /// A software device, its exported buffer and a dma-buf reference.
    type Exported = (Pin<KBox<SoftDevice>>, Arc<Buffer>, *mut Opaque);

    /// A buffer of `pages` pages of a new software device, every byte
    /// `value`, exported: (device, buffer, dma-buf reference).
    fn exported(
        pages: usize,
        value: u8,
    ) -> Result<Exported> {
        let p = params();
        let soft = KBox::pin_init(SoftDevice::new(&p), GFP_KERNEL)?;
        let device = soft.device().clone();
        let len = pages * PAGE_SIZE;
        let buf = {
            let active = device.enter()?;
            Buffer::new(&device, device.bound_device(&active), len, 0)?
        };
        buf.fill(ByteRange { start: 0, len }, value)?;
        let account = Account::new(1)?;
        account.charge(0, len as u64);
        let charge = Charge::adopt(UniqueArc::new_uninit(GFP_KERNEL)?, account, 0, len as u64);
        let dmabuf = super::export(buf.clone(), charge)?.into_dmabuf();
        Ok((soft, buf, dmabuf))
    }

    /// What `ib_umem_dmabuf_get_pinned` does (dynamic attach taking P2P
    /// memory, revocable, pin, map), plus a static importer at the same
    /// time; then the exporter is unbound with both attachments live.
    #[test]
    fn rdma_like_importer_then_unbind() -> Result {
        let pages = 5;
        let (soft, buf, dmabuf) = exported(pages, 0xa7)?;
        // SAFETY: `dmabuf` is a live tdrv export (our reference).
        let rdma = unsafe { tdrv_test_importer_new(dmabuf, c"tdrv-kunit-rdma".as_char_ptr(), true) };
        // dynamic attach
        assert!(kernel::error::from_err_ptr(rdma).is_ok());
        // SAFETY: As above.
        let stat = unsafe { tdrv_test_importer_new(dmabuf, c"tdrv-kunit-static".as_char_ptr(), false) };
        // static attach
        assert!(kernel::error::from_err_ptr(stat).is_ok());
        // SAFETY: `rdma` and `stat` are live importers until freed below.
        unsafe {
            // pin and map
            assert_eq!(tdrv_test_importer_map(rdma), 0);
            // static map
            assert_eq!(tdrv_test_importer_map(stat), 0);
            // the sg_table covers every byte
            assert_eq!(
                tdrv_test_importer_mapped_bytes(rdma),
                (pages * PAGE_SIZE) as core::ffi::c_long);
            // bytes through the mapping
            assert_eq!(tdrv_test_importer_count_other(rdma, 0xa7), 0);
            // two mappings counted
            assert_eq!(ffi::tdrv_dmabuf_users(dmabuf), 2);
        }
        // Unbind (the software device's removal) with both live.
        drop(soft);
        // SAFETY: As above.
        unsafe {
            // the revocable importer was told
            assert_eq!(tdrv_test_importer_invalidated(rdma), 1);
            // and unmapped
            assert_eq!(tdrv_test_importer_mapped_bytes(rdma), core::ffi::c_long::from(ENOENT.to_errno()));
            // the static mapping remains
            assert_eq!(ffi::tdrv_dmabuf_users(dmabuf), 1);
        }
        // Not freed while mapped: the buffer still holds its memory and
        // the static importer still reads it.
        assert!(buf.holds_memory());
        // SAFETY: As above.
        unsafe {
            assert_eq!(tdrv_test_importer_count_other(stat, 0xa7), 0);
            tdrv_test_importer_free(stat);
            // no mapping left
            assert_eq!(ffi::tdrv_dmabuf_users(dmabuf), 0);
            tdrv_test_importer_free(rdma);
            ffi::tdrv_dmabuf_put(dmabuf);
        }
        drop(buf);
        Ok(())
    }

    /// Another tdrv device imports the export (revocable, pinned); the
    /// exporter is unbound: the import is revoked (accesses fail with
    /// ENODEV) and unmapped, so the exporter frees its memory at unbind.
    #[test]
    fn tdrv_import_is_revoked_at_exporter_unbind() -> Result {
        let pages = 3;
        let (soft, buf, dmabuf) = exported(pages, 0x5c)?;
        let importer = KBox::pin_init(SoftDevice::new(&params()), GFP_KERNEL)?;
        let idev = importer.device().clone();
        let imported = {
            let active = idev.enter()?;
            let dev = crate::device::raw_device(idev.bound_device(&active)).cast();
            let slot = idev.imports.reserve()?;
            // SAFETY: `dmabuf` is a live export (a new reference, given to
            // the import); `dev` is bound while `importer` lives, which
            // outlives the import (dropped below, before it).
            let import = unsafe {
                super::Import::new(super::DmaBufRef(ffi_get(dmabuf)), dev, false, Some(idev.clone()), slot, false)?
            };
            Buffer::import(&idev, &active, import, 0, None)?
        };
        // the import is reachable before the unbind
        assert!(imported.fill(ByteRange { start: 0, len: PAGE_SIZE }, 1).is_ok());
        // a re-export of the import hands its pages to nobody
        let mut pfn: core::ffi::c_ulong = 0;
        // SAFETY: `imported` is live; room for one frame.
        let r = unsafe { super::tdrv_dmabuf_buffer_pfns(Arc::as_ptr(&imported), &mut pfn, 1) };
        assert_eq!(r, crate::uapi::eopnotsupp().to_errno());
        // its mapping counts as the export's user
        // SAFETY: `dmabuf` is live (our reference).
        assert_eq!(unsafe { ffi::tdrv_dmabuf_users(dmabuf) }, 1);
        drop(soft);
        // the import was revoked: accesses fail
        assert_eq!(imported.begin_access().err(), Some(ENODEV));
        assert_eq!(imported.fill(ByteRange { start: 0, len: PAGE_SIZE }, 1).err(), Some(ENODEV));
        // and unmapped, so the exporter freed its memory at unbind
        // SAFETY: As above.
        assert_eq!(unsafe { ffi::tdrv_dmabuf_users(dmabuf) }, 0);
        assert!(!buf.holds_memory());
        drop(imported);
        drop(importer);
        // SAFETY: Our reference.
        unsafe { ffi::tdrv_dmabuf_put(dmabuf) };
        drop(buf);
        Ok(())
    }

    /// A new reference to `dmabuf`.
    fn ffi_get(dmabuf: *mut Opaque) -> *mut Opaque {
        extern "C" {
            fn tdrv_test_dmabuf_get(dmabuf: *mut Opaque) -> *mut Opaque;
        }
        // SAFETY: The caller holds a reference.
        unsafe { tdrv_test_dmabuf_get(dmabuf) }
    }

    /// After unbind, new attachments and mappings are refused.
    #[test]
    fn attach_after_unbind_is_enodev() -> Result {
        let (soft, buf, dmabuf) = exported(1, 0)?;
        drop(soft);
        // Nothing mapped it: unbind freed the memory.
        assert!(!buf.holds_memory());
        // SAFETY: `dmabuf` is a live tdrv export (our reference).
        let t = unsafe { tdrv_test_importer_new(dmabuf, c"tdrv-kunit-late".as_char_ptr(), true) };
        assert_eq!(kernel::error::from_err_ptr(t).err(), Some(ENODEV));
        // SAFETY: Our reference.
        unsafe { ffi::tdrv_dmabuf_put(dmabuf) };
        drop(buf);
        Ok(())
    }

    /// An import keeps its slot in the device's count until its queued
    /// release has run, and the count's limit is ENOSPC.
    #[test]
    fn import_counted_until_released() -> Result {
        let (soft, buf, dmabuf) = exported(1, 0x5a)?;
        let count = super::ImportCount::new(2)?;
        let a = count.reserve()?;
        // Ours beyond the import's release.
        let kept = ffi_get(dmabuf);
        // SAFETY: A CPU-only import (no DMA, no owner: no device is
        // needed), which takes over our reference to the live `dmabuf`.
        let import = unsafe {
            super::Import::new(super::DmaBufRef(dmabuf), core::ptr::null_mut(), false, None, a, false)?
        };
        let dmabuf = kept;
        let b = count.reserve()?;
        assert_eq!(count.held(), 2);
        assert_eq!(count.try_reserve().err(), Some(ENOSPC));
        drop(b);
        assert_eq!(count.held(), 1);
        // The release needs the reservation lock: held here, the queued
        // release cannot finish, and the import still counts.
        // SAFETY: `dmabuf` is live (our reference).
        unsafe { tdrv_test_resv_lock(dmabuf) };
        import.release_later();
        assert_eq!(count.held(), 1);
        // SAFETY: Locked above.
        unsafe { tdrv_test_resv_unlock(dmabuf) };
        super::Import::flush_releases();
        assert_eq!(count.held(), 0);
        // SAFETY: Our reference.
        unsafe { ffi::tdrv_dmabuf_put(dmabuf) };
        drop(soft);
        drop(buf);
        Ok(())
    }
}
