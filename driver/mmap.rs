// SPDX-License-Identifier: GPL-2.0

//! mmap of whole buffers into userspace.
//!
//! The pages are mapped with `dma_mmap_attrs` (`Buffer::dma_mmap`), which
//! goes through the DMA API and so stays correct behind an IOMMU (the
//! original driver used `remap_pfn_range` on the physical address). 7.2 has
//! no safe wrapper for it, nor for `vm_operations_struct`.
//!
//! Each mapping holds a reference to its buffer in `vm_private_data`: the
//! `open` callback (VMA split or copy) takes another one, `close` drops one.
//! So a buffer outlives FREE while it is mapped, and its memory is released
//! when the last mapping goes. On unbind the device removes the mappings'
//! pages before it frees the memory (`TdrvDevice::revoke_all`).

use kernel::{
    bindings,
    mm::virt::{
        flags,
        VmaNew, //
    },
    page::{
        PAGE_SHIFT,
        PAGE_SIZE, //
    },
    prelude::*,
    sync::Arc, //
};

use crate::buffer::Buffer;

/// The mmap offset userspace passes for `handle`: the handle in pages.
pub(crate) fn offset_of_handle(handle: u64) -> u64 {
    handle << PAGE_SHIFT
}

unsafe extern "C" fn vma_open(vma: *mut bindings::vm_area_struct) {
    // SAFETY: `vma` is a copy of a VMA set up by `map_buffer`, so its
    // `vm_private_data` came from `Arc::into_raw`, and that reference is
    // still held by the original VMA.
    let original = unsafe { Arc::<Buffer>::from_raw((*vma).vm_private_data.cast()) };
    // The copy's own reference, given back by its `vma_close`.
    let _ = Arc::into_raw(original.clone());
    // The original VMA keeps its reference.
    let _ = Arc::into_raw(original);
}

unsafe extern "C" fn vma_close(vma: *mut bindings::vm_area_struct) {
    // SAFETY: Every VMA using `BUFFER_VM_OPS` owns one reference, taken in
    // `map_buffer` or `vma_open`; `close` runs once per VMA, so this gives
    // back exactly that reference.
    drop(unsafe { Arc::<Buffer>::from_raw((*vma).vm_private_data.cast()) });
}

/// A `vm_operations_struct` that may live in a `static`.
///
/// Depending on the kernel configuration the C struct holds raw pointers
/// (for example `uffd_ops` with CONFIG_USERFAULTFD), which are not `Sync`.
#[repr(transparent)]
struct VmOps(bindings::vm_operations_struct);

// SAFETY: The table is immutable after compilation; the kernel only reads
// it, from any thread, and every pointer in it is to code or to other
// immutable statics.
unsafe impl Sync for VmOps {}

static BUFFER_VM_OPS: VmOps = VmOps(bindings::vm_operations_struct {
    open: Some(vma_open),
    close: Some(vma_close),
    // SAFETY: All-zero is a valid `vm_operations_struct` (no callbacks).
    ..unsafe { core::mem::zeroed() }
});

/// Maps `buf` into `vma`. The VMA must be shared, start at buffer offset 0
/// (the caller has decoded and cleared the handle cookie in `vm_pgoff`) and
/// be no longer than the buffer rounded up to pages.
pub(crate) fn map_buffer(buf: Arc<Buffer>, vma: &VmaNew) -> Result {
    if vma.flags() & flags::SHARED == 0 {
        return Err(EINVAL);
    }
    let len = vma.end() - vma.start();
    if len > buf.size().next_multiple_of(PAGE_SIZE) {
        return Err(EINVAL);
    }
    vma.set_dontcopy();
    vma.set_dontexpand();
    vma.set_dontdump();
    // SAFETY: `vma` is under set-up with `vm_pgoff` 0 (see above); the VMA
    // holds a buffer reference from here on (below), dropped by
    // `vma_close` only when the VMA is torn down.
    unsafe { buf.dma_mmap(vma.as_ptr())? };
    // SAFETY: As above, the VMA is ours to set up; the reference moved into
    // `vm_private_data` is given back by `vma_close`.
    unsafe {
        (*vma.as_ptr()).vm_private_data = Arc::into_raw(buf).cast_mut().cast();
        (*vma.as_ptr()).vm_ops = &BUFFER_VM_OPS.0;
    }
    Ok(())
}
