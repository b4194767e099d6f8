// SPDX-License-Identifier: GPL-2.0

//! mmap of whole buffers into userspace, page by page on fault.
//!
//! `->mmap` maps nothing: it checks the request, marks the VMA as a raw
//! PFN mapping and stores a buffer reference in `vm_private_data`. The
//! `fault` handler inserts a few pages at a time, inside an active section
//! of the device (see `device.rs`), and answers SIGBUS once unbind began.
//!
//! Why not fill the page tables in `->mmap` (`dma_mmap_attrs`): the VMA is
//! linked into the file's `i_mmap` tree only after `->mmap` returns, so an
//! unbind in between could not zap those page table entries and would
//! free pages that stay mapped. With fault-time insertion a page table
//! entry can only appear after the VMA is linked, and unbind orders itself
//! with the fault handler: it refuses new active sections, waits for the
//! ones in progress (faults among them), then zaps every mapping, then
//! frees.
//!
//! Each mapping holds a reference to its buffer: the `open` callback (VMA
//! split or copy) takes another one, `close` drops one. So a buffer
//! outlives FREE while it is mapped. Every mapping also holds its file, and
//! with it the module (see `node.rs`), so `rmmod` fails while one exists.
//! Mappings of an exported dma-buf (`dmabuf.rs`) use the same operations;
//! their file is the dma-buf's, which pins the module through its owner,
//! and their page offset is the page index in the buffer from the start.
//!
//! Pages are mapped with the VMA's default (cacheable) protection, which
//! is right for cache-coherent DMA without memory encryption: every device
//! tdrv drives (x86, QEMU). A platform with non-coherent DMA or encrypted
//! memory would need `dma_pgprot`, which 7.2 does not export to modules;
//! tdrv would have to refuse mmap there. Device memory (a BAR) is mapped
//! write-combined: stores stream to the device, and reads are uncached,
//! so the CPU always sees what the device's DMA wrote.
//!
//! The mmap offset of a buffer is its handle in pages. Once the handle is
//! decoded `vm_pgoff` is set to 0, so that a fault's page offset is the
//! page index in the buffer, also in the pieces of a split VMA.

use kernel::{
    bindings,
    mm::virt::{
        flags,
        VmaNew,
        VmaRef, //
    },
    page::{
        PAGE_SHIFT,
        PAGE_SIZE, //
    },
    prelude::*,
    sync::Arc, //
};

use crate::{
    buffer::Buffer,
    glue, //
};

/// The mmap offset userspace passes for `handle`: the handle in pages.
/// Handles are small enough (see `handle.rs`) that this is a positive
/// 64-bit offset for every page size.
pub(crate) fn offset_of_handle(handle: u64) -> u64 {
    handle << PAGE_SHIFT
}

/// `vm_operations_struct.open`: a VMA was copied or split.
///
/// # Safety
///
/// Called by the kernel only, for a VMA set up by [`map_buffer`].
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

/// `vm_operations_struct.close`: a VMA goes away.
///
/// # Safety
///
/// Called by the kernel only, once per VMA set up by [`map_buffer`] or
/// copied from one.
unsafe extern "C" fn vma_close(vma: *mut bindings::vm_area_struct) {
    // SAFETY: Every VMA using `BUFFER_VM_OPS` owns one reference, taken in
    // `map_buffer` or `vma_open`; `close` runs once per VMA, so this gives
    // back exactly that reference.
    drop(unsafe { Arc::<Buffer>::from_raw((*vma).vm_private_data.cast()) });
}

/// `vm_operations_struct.fault`: maps the page of the buffer at the fault.
///
/// # Safety
///
/// Called by the kernel only, with a valid `vmf` for a VMA set up by
/// [`map_buffer`].
unsafe extern "C" fn vma_fault(vmf: *mut bindings::vm_fault) -> bindings::vm_fault_t {
    // SAFETY: The fault handler is called with a valid `vm_fault` whose
    // VMA uses `BUFFER_VM_OPS`, so it holds a buffer reference in
    // `vm_private_data` for as long as the VMA exists (at least this call).
    let (vma, address, index) = unsafe {
        let f = &(*vmf).__bindgen_anon_1;
        (f.vma, f.address, f.pgoff)
    };
    // SAFETY: As above.
    let buf = unsafe { &*(*vma).vm_private_data.cast::<Buffer>() };
    // SAFETY: A fault runs with the VMA's mmap (or per-VMA) read lock
    // held, which is what `VmaRef` requires for the call.
    let vm_end = unsafe { VmaRef::from_raw(vma) }.end();
    // The faulting page, then (like TTM's prefault) the next few pages of
    // the VMA. Their frames are read under the buffer's memory lock and
    // inserted after it is released: inserting allocates page tables, and
    // the completion paths that signal dma-fences take the memory lock
    // (a job's last buffer reference frees the memory there), so holding
    // it across an allocation could deadlock in reclaim waiting for a
    // fence. What keeps the frames valid meanwhile is the active guard:
    // unbind frees the memory only after the guards in progress are gone
    // and every mapping was zapped, and no guard can be taken once unbind
    // has begun. A fault never waits for userspace under the guard. For
    // a foreign import the guard is also an access, which the exporter's
    // revocation waits for before it zaps and unmaps (SIGBUS after).
    let sigbus = bindings::vm_fault_reason_VM_FAULT_SIGBUS as bindings::vm_fault_t;
    let Ok(_active) = buf.enter() else {
        return sigbus;
    };
    let around = ((vm_end - address) / PAGE_SIZE).clamp(1, FAULT_AROUND);
    let mut pfns = [0usize; FAULT_AROUND];
    let Some(n) = buf.page_pfns(index, &mut pfns[..around]) else {
        return sigbus;
    };
    let mut result = sigbus;
    for (i, &pfn) in pfns[..n].iter().enumerate() {
        let addr = address + i * PAGE_SIZE;
        // SAFETY: `vma` is the faulting VMA (a VM_PFNMAP mapping set up by
        // `map_buffer`), `addr` lies inside it (bounded by `around`), and
        // `pfn` is a page of the buffer's memory, which stays allocated
        // while `_active` lives; unbind zaps these entries before it
        // frees the memory.
        let r = unsafe { bindings::vmf_insert_pfn(vma, addr, pfn) };
        if i == 0 {
            result = r;
        }
        if r != bindings::vm_fault_reason_VM_FAULT_NOPAGE as bindings::vm_fault_t {
            break;
        }
    }
    result
}

/// Pages mapped per fault (the faulting one and those after it).
const FAULT_AROUND: usize = 16;

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
    fault: Some(vma_fault),
    // SAFETY: All-zero is a valid `vm_operations_struct` (no callbacks).
    ..unsafe { core::mem::zeroed() }
});

/// Maps `buf` into `vma`. The VMA must be shared, not executable, no
/// longer than the buffer rounded up to pages, and start at buffer offset
/// 0 (the caller has decoded and cleared the handle cookie in `vm_pgoff`).
pub(crate) fn map_buffer(buf: Arc<Buffer>, vma: &VmaNew) -> Result {
    if vma.flags() & flags::SHARED == 0 {
        return Err(EINVAL);
    }
    let len = vma.end() - vma.start();
    if len > buf.size().next_multiple_of(PAGE_SIZE) {
        return Err(EINVAL);
    }
    // SAFETY: `vma` is under set-up (mmap write lock held).
    unsafe { glue::vma_init(vma.as_ptr(), buf.on_device() || buf.is_p2p())? };
    // SAFETY: As above, the VMA is ours to set up; the reference moved into
    // `vm_private_data` is given back by `vma_close`, which the kernel
    // calls for every VMA that gets these operations.
    unsafe {
        (*vma.as_ptr()).vm_private_data = Arc::into_raw(buf).cast_mut().cast();
        (*vma.as_ptr()).vm_ops = &BUFFER_VM_OPS.0;
    }
    Ok(())
}
