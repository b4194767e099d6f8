// SPDX-License-Identifier: GPL-2.0

//! Safe wrappers of the C helpers in `glue.c`: the few static inlines and
//! macros that 7.2's Rust bindings do not reach.

use kernel::{bindings, prelude::*};

mod ffi {
    extern "C" {
        pub(super) fn tdrv_kaddr_to_pfn(addr: *const core::ffi::c_void) -> core::ffi::c_ulong;
        // (Opaque here: bindgen's `vm_area_struct` has zero-sized members
        // that the FFI lint rejects.)
        pub(super) fn tdrv_vma_init(vma: *mut core::ffi::c_void) -> core::ffi::c_int;
        pub(super) fn tdrv_cond_resched();
        pub(super) fn tdrv_capable_rawio() -> bool;
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

/// Flags a VMA under set-up for fault-time PFN insertion; EACCES if it was
/// asked to be executable.
///
/// # Safety
///
/// `vma` is a VMA being set up by `->mmap` (mmap write lock held).
pub(crate) unsafe fn vma_init(vma: *mut bindings::vm_area_struct) -> Result {
    // SAFETY: The caller guarantees `vma` is under set-up, which is when
    // its flags may be modified.
    kernel::error::to_result(unsafe { ffi::tdrv_vma_init(vma.cast()) })
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
