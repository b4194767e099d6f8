// SPDX-License-Identifier: GPL-2.0

//! Safe wrappers of the C helpers in `glue.c`: the few static inlines and
//! macros that 7.2's Rust bindings do not reach.

use kernel::{
    bindings,
    prelude::*,
    transmute::{
        AsBytes,
        FromBytes, //
    }, //
};

mod ffi {
    extern "C" {
        pub(super) fn tdrv_params_get(p: *mut super::ModParams);
        pub(super) fn tdrv_kaddr_to_pfn(addr: *const core::ffi::c_void) -> core::ffi::c_ulong;
        pub(super) fn tdrv_pages_alloc(size: usize, phys: *mut u64) -> *mut core::ffi::c_void;
        pub(super) fn tdrv_pages_free(addr: *mut core::ffi::c_void, size: usize);
        // (Opaque here: bindgen's `vm_area_struct` has zero-sized members
        // that the FFI lint rejects.)
        pub(super) fn tdrv_vma_init(vma: *mut core::ffi::c_void, wc: bool) -> core::ffi::c_int;
        pub(super) fn tdrv_dma_mapping_error(dev: *mut core::ffi::c_void, addr: u64) -> bool;
        pub(super) fn tdrv_page_run(pages: *const *mut core::ffi::c_void, n: core::ffi::c_uint)
            -> core::ffi::c_uint;
        pub(super) fn tdrv_dma_max_mapping_size(dev: *mut core::ffi::c_void) -> usize;
        pub(super) fn tdrv_io_reserve_wc(start: u64, size: u64) -> core::ffi::c_int;
        pub(super) fn tdrv_io_free_wc(start: u64, size: u64);
        pub(super) fn tdrv_p2p_provider(dev: *mut core::ffi::c_void, bar: core::ffi::c_int) -> *mut core::ffi::c_void;
        pub(super) fn tdrv_zero_io_wc(addr: *mut core::ffi::c_void, len: usize);
        pub(super) fn tdrv_fatal_signal_pending() -> bool;
        pub(super) fn tdrv_cond_resched();
        pub(super) fn tdrv_capable_rawio() -> bool;
        pub(super) fn tdrv_poll_queue_init(wq: *mut kernel::bindings::wait_queue_head);
        // `struct file` and `struct kiocb` as `void *`: their bindings
        // hold a zero-sized member rustc calls not FFI-safe.
        pub(super) fn tdrv_poll_wait(
            file: *mut core::ffi::c_void,
            wq: *mut kernel::bindings::wait_queue_head,
            pt: *mut kernel::bindings::poll_table_struct,
        );
        pub(super) fn tdrv_poll_wake(wq: *mut kernel::bindings::wait_queue_head);
        pub(super) fn tdrv_poll_readable() -> kernel::bindings::__poll_t;
        pub(super) fn tdrv_kiocb_wait_mode(iocb: *const core::ffi::c_void) -> core::ffi::c_int;
        pub(super) fn tdrv_file_allow_nowait(file: *mut core::ffi::c_void);
        pub(super) fn tdrv_node_groups_get() -> *mut *const kernel::bindings::attribute_group;
        pub(super) fn tdrv_get_user_words(
            dst: *mut u64,
            src: *const u64,
            words: core::ffi::c_uint,
        ) -> core::ffi::c_int;
        pub(super) fn tdrv_put_user_words(
            dst: *mut u64,
            src: *const u64,
            words: core::ffi::c_uint,
        ) -> core::ffi::c_int;
    }
}

/// The module parameters as the module was loaded with them, declared in
/// `glue.c` (where a parameter given twice takes its last value). Same
/// layout as `struct tdrv_params` in `glue.h`; unchecked (see
/// `crate::params`).
#[repr(C)]
#[derive(Default)]
pub(crate) struct ModParams {
    pub(crate) soft_devices: u32,
    pub(crate) channels: u32,
    pub(crate) channel_mib: u32,
    pub(crate) edu_dma_bits: u32,
    pub(crate) edu_timeout_ms: u32,
    pub(crate) sim_timeout_ms: u32,
    pub(crate) file_max_buffers: u32,
    pub(crate) file_max_imports: u32,
    pub(crate) device_max_imports: u32,
    pub(crate) file_max_mib: u32,
    pub(crate) file_max_events: u32,
    pub(crate) device_max_events: u32,
    pub(crate) file_max_jobs: u32,
    pub(crate) file_max_inflight_mib: u32,
}

/// Reads the module parameters.
pub(crate) fn module_params() -> ModParams {
    let mut p = ModParams::default();
    // SAFETY: `p` is a valid, writable `struct tdrv_params` (same layout,
    // `repr(C)`). The C side only reads the parameter variables, which are
    // written by the module loader before init and are read-only in sysfs.
    unsafe { ffi::tdrv_params_get(&mut p) };
    p
}

/// A block of zeroed, physically contiguous system pages, for memory that no
/// device accesses by DMA (it needs no DMA mapping, and the page allocator
/// serves multi-page blocks without a CMA area). Freed on drop.
///
/// # Invariants
///
/// `addr` is the linear-map address of a block of `size` bytes from
/// `tdrv_pages_alloc`, owned by this value.
pub(crate) struct Pages {
    addr: core::ptr::NonNull<u8>,
    phys: u64,
    size: usize,
}

// SAFETY: The block is plain memory owned by the value; it may be freed
// from any thread.
unsafe impl Send for Pages {}
// SAFETY: `Pages` only hands out the address; accesses through it are the
// owner's to synchronise.
unsafe impl Sync for Pages {}

impl Pages {
    /// Allocates `size` zeroed bytes, a non-zero multiple of pages;
    /// ENOMEM if the page allocator has no such block.
    pub(crate) fn alloc(size: usize) -> Result<Self> {
        if size == 0 || size % kernel::page::PAGE_SIZE != 0 {
            return Err(EINVAL);
        }
        let mut phys = 0u64;
        // SAFETY: `phys` is a valid place for the result; no other
        // precondition.
        let addr = unsafe { ffi::tdrv_pages_alloc(size, &mut phys) };
        let addr = core::ptr::NonNull::new(addr.cast::<u8>()).ok_or(ENOMEM)?;
        // INVARIANT: A fresh block of `size` bytes, now ours.
        Ok(Self { addr, phys, size })
    }

    /// The block's kernel (linear-map) address.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.addr.as_ptr()
    }

    /// The block's physical address.
    pub(crate) fn phys(&self) -> u64 {
        self.phys
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: By the type invariant the block is ours, of this size.
        unsafe { ffi::tdrv_pages_free(self.addr.as_ptr().cast(), self.size) };
    }
}

/// The page frame number of `addr`.
///
/// # Safety
///
/// `addr` points into a live DMA-coherent allocation (linear-map or
/// vmalloc address), which the caller keeps alive for the call.
pub(crate) unsafe fn kaddr_to_pfn(addr: *const u8) -> usize {
    // SAFETY: The caller guarantees `addr` is a live kernel address of
    // memory that has a page frame.
    unsafe { ffi::tdrv_kaddr_to_pfn(addr.cast()) as usize }
}

/// Flags a VMA under set-up for fault-time PFN insertion, write-combined
/// if `wc` (device memory); EACCES if it was asked to be executable.
///
/// # Safety
///
/// `vma` is a VMA being set up by `->mmap` (mmap write lock held).
pub(crate) unsafe fn vma_init(vma: *mut bindings::vm_area_struct, wc: bool) -> Result {
    // SAFETY: The caller guarantees `vma` is under set-up, which is when
    // its flags and protection may be modified.
    kernel::error::to_result(unsafe { ffi::tdrv_vma_init(vma.cast(), wc) })
}

/// Whether `addr`, returned by a `dma_map_*` call for `dev`, is an error.
///
/// # Safety
///
/// `dev` is a valid, bound device.
pub(crate) unsafe fn dma_mapping_error(dev: *mut bindings::device, addr: u64) -> bool {
    // SAFETY: The caller guarantees `dev` is valid; the check only reads.
    unsafe { ffi::tdrv_dma_mapping_error(dev.cast(), addr) }
}

/// How many of `pages`, from the first, are physically consecutive (one
/// DMA mapping covers them); at least 1 unless `pages` is empty.
///
/// # Safety
///
/// Every entry of `pages` is a page the caller holds a reference or pin on.
pub(crate) unsafe fn page_run(pages: &[*mut bindings::page]) -> usize {
    let n = pages.len().min(u32::MAX as usize) as core::ffi::c_uint;
    // SAFETY: `pages` holds `n` valid page pointers (the caller's
    // guarantee), which the call only compares and reads the folio of.
    unsafe { ffi::tdrv_page_run(pages.as_ptr().cast(), n) as usize }
}

/// The longest single DMA mapping `dev` takes.
///
/// # Safety
///
/// `dev` is a valid, bound device.
pub(crate) unsafe fn dma_max_mapping_size(dev: *mut bindings::device) -> usize {
    // SAFETY: The caller guarantees `dev` is valid; the call only reads.
    unsafe { ffi::tdrv_dma_max_mapping_size(dev.cast()) }
}

/// Reserves the physical range of a BAR as write-combined (PAT); undo with
/// [`io_free_wc`].
pub(crate) fn io_reserve_wc(start: u64, size: u64) -> Result {
    // SAFETY: Only records a memory type for the range; fails on a
    // conflicting reservation.
    kernel::error::to_result(unsafe { ffi::tdrv_io_reserve_wc(start, size) })
}

/// The peer-to-peer DMA provider of BAR `bar` of the bound PCI device
/// `pdev` (a `struct p2pdma_provider`, device-managed: it goes when the
/// driver unbinds), as an address; 0 if there is none (logged).
pub(crate) fn p2p_provider(pdev: &kernel::pci::Device<kernel::device::Core<'_>>, bar: u32) -> usize {
    let dev = crate::device::raw_device(pdev.as_ref());
    // SAFETY: `dev` is a bound PCI device (the `Core` context is its
    // probe); the C side allocates device-managed state for it.
    unsafe { ffi::tdrv_p2p_provider(dev.cast(), bar as core::ffi::c_int) as usize }
}

/// Gives back a reservation made by [`io_reserve_wc`].
///
/// # Safety
///
/// `[start, start + size)` was reserved by [`io_reserve_wc`] and is no
/// longer mapped.
pub(crate) unsafe fn io_free_wc(start: u64, size: u64) {
    // SAFETY: By the caller's guarantee.
    unsafe { ffi::tdrv_io_free_wc(start, size) }
}

/// Zeroes `len` bytes of write-combined device memory at `addr` and drains
/// the write-combining buffers, so the zeroes are visible to the device
/// before any later MMIO write.
///
/// # Safety
///
/// `[addr, addr + len)` lies in a live `ioremap_wc` mapping that nothing
/// else writes while this runs.
pub(crate) unsafe fn zero_io_wc(addr: *mut core::ffi::c_void, len: usize) {
    // SAFETY: By the caller's guarantee.
    unsafe { ffi::tdrv_zero_io_wc(addr, len) }
}

/// Whether the current task has a fatal signal pending.
pub(crate) fn fatal_signal_pending() -> bool {
    // SAFETY: Reads the current task's pending signals.
    unsafe { ffi::tdrv_fatal_signal_pending() }
}

/// Lets the scheduler run something else if this task ran long.
pub(crate) fn cond_resched() {
    // SAFETY: Always callable from process context without locks held;
    // every caller is a work item or ioctl between pieces of work.
    unsafe { ffi::tdrv_cond_resched() }
}

/// Whether the current task holds CAP_SYS_RAWIO.
pub(crate) fn capable_rawio() -> bool {
    // SAFETY: `capable` only reads the current task's credentials.
    unsafe { ffi::tdrv_capable_rawio() }
}

/// A wait queue for `poll(2)` and epoll (see `glue.c`).
///
/// # Invariants
///
/// `wq` is an initialised wait queue head.
#[pin_data]
pub(crate) struct PollQueue {
    #[pin]
    wq: kernel::types::Opaque<bindings::wait_queue_head>,
}

// SAFETY: A wait queue head is used from any thread under its own lock.
unsafe impl Send for PollQueue {}
// SAFETY: As above.
unsafe impl Sync for PollQueue {}

impl PollQueue {
    pub(crate) fn new() -> impl PinInit<Self> {
        pin_init!(Self {
            // SAFETY: `init_waitqueue_head` initialises the head in place.
            // INVARIANT: initialised here.
            wq <- kernel::types::Opaque::ffi_init(|wq| unsafe { ffi::tdrv_poll_queue_init(wq) }),
        })
    }

    /// Adds the caller's poll table entry for `file` to the queue.
    ///
    /// # Safety
    ///
    /// `file` and `pt` are those the `poll` file operation was called
    /// with, and `self` lives until the file's `release` has run (epoll
    /// removes its entries before `release`, `poll(2)` before returning).
    pub(crate) unsafe fn register(
        &self,
        file: *mut bindings::file,
        pt: *mut bindings::poll_table_struct,
    ) {
        // SAFETY: The caller's guarantee; `wq` is initialised.
        unsafe { ffi::tdrv_poll_wait(file.cast(), self.wq.get(), pt) }
    }

    /// Wakes pollers waiting for input. Takes only the queue's spinlock.
    pub(crate) fn wake(&self) {
        // SAFETY: `wq` is initialised (type invariants).
        unsafe { ffi::tdrv_poll_wake(self.wq.get()) }
    }
}

/// `EPOLLIN | EPOLLRDNORM`.
pub(crate) fn poll_readable() -> bindings::__poll_t {
    // SAFETY: Returns a constant.
    unsafe { ffi::tdrv_poll_readable() }
}

/// How far a read may wait.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadWait {
    /// A blocking read: sleeps until there is something to read.
    Block,
    /// O_NONBLOCK: EAGAIN instead of waiting for data, but may sleep on a
    /// lock held briefly (an EPOLLET reader must not see a spurious
    /// EAGAIN while data is ready, or it waits for an edge that never
    /// comes).
    NonBlock,
    /// IOCB_NOWAIT (RWF_NOWAIT, io_uring's first try): EAGAIN instead of
    /// any sleep, locks included; io_uring retries from a worker.
    NoWait,
}

/// How far the read of `iocb` may wait.
///
/// # Safety
///
/// `iocb` is the valid kiocb of a read in progress.
pub(crate) unsafe fn kiocb_wait(iocb: *const bindings::kiocb) -> ReadWait {
    // SAFETY: The caller's guarantee.
    match unsafe { ffi::tdrv_kiocb_wait_mode(iocb.cast()) } {
        0 => ReadWait::Block,
        1 => ReadWait::NonBlock,
        _ => ReadWait::NoWait,
    }
}

/// Lets `read(2)` of `file` take RWF_NOWAIT.
///
/// # Safety
///
/// `file` is being opened (its `f_mode` is not yet shared).
pub(crate) unsafe fn file_allow_nowait(file: *mut bindings::file) {
    // SAFETY: The caller's guarantee.
    unsafe { ffi::tdrv_file_allow_nowait(file.cast()) }
}

/// The sysfs attribute groups of a tdrv misc device (`glue.c`).
pub(crate) fn node_groups() -> *mut *const bindings::attribute_group {
    // SAFETY: Returns the address of a static, NULL-terminated array.
    unsafe { ffi::tdrv_node_groups_get() }
}

/// Checks that `T` is a whole number of aligned 64-bit words.
const fn assert_words<T>() {
    assert!(core::mem::size_of::<T>() % 8 == 0 && core::mem::align_of::<T>() >= 8);
}

/// Reads a `T` (a whole number of 64-bit words) from user address `addr`
/// a word at a time: cheaper than `UserSliceReader` for a few words.
/// EFAULT on a fault.
pub(crate) fn get_user_words<T: FromBytes>(addr: usize) -> Result<T> {
    const { assert_words::<T>() };
    let mut value = core::mem::MaybeUninit::<T>::uninit();
    let words = u32::try_from(core::mem::size_of::<T>() / 8).map_err(|_| EINVAL)?;
    // SAFETY: `value` is valid for writes of `words` aligned words; the C
    // side checks the user range and handles faults. No Rust reference to
    // `value` exists during the call.
    let r =
        unsafe { ffi::tdrv_get_user_words(value.as_mut_ptr().cast(), addr as *const u64, words) };
    if r != 0 {
        return Err(Error::from_errno(r));
    }
    // SAFETY: The call succeeded, so every byte of `value` was written, and
    // any bytes are a valid `T` (`FromBytes`).
    Ok(unsafe { value.assume_init() })
}

/// Writes the 64-bit words `words` of `value` to user address `addr` (the
/// address of `value`'s first word) a word at a time: cheaper than
/// `UserSliceWriter` for a few words. EFAULT on a fault, EINVAL if `words`
/// is not inside `T`.
pub(crate) fn put_user_words<T: AsBytes>(
    addr: usize,
    value: &T,
    words: core::ops::Range<usize>,
) -> Result {
    const { assert_words::<T>() };
    if words.start > words.end || words.end > core::mem::size_of::<T>() / 8 {
        return Err(EINVAL);
    }
    let len = u32::try_from(words.len()).map_err(|_| EINVAL)?;
    let src = core::ptr::from_ref(value)
        .cast::<u64>()
        .wrapping_add(words.start);
    let dst = addr.wrapping_add(words.start * 8) as *mut u64;
    // SAFETY: `src` points to `words.len()` initialised (`AsBytes`), aligned
    // words inside `*value`, borrowed for the call; the C side checks the
    // user range and handles faults.
    let r = unsafe { ffi::tdrv_put_user_words(dst, src, len) };
    if r != 0 {
        return Err(Error::from_errno(r));
    }
    Ok(())
}
