// SPDX-License-Identifier: GPL-2.0

//! The device's registry of live buffers: an XArray of their addresses,
//! so that unbind reaches every buffer, also those only jobs, mappings or
//! exports still hold.
//!
//! An XArray grows a node (576 bytes for 64 entries) at a time, so the
//! registry holds as many buffers as memory allows; a single array would
//! need one contiguous allocation for all of them. Entries do not own
//! their buffers: a buffer leaves the registry in its drop. 7.2's Rust
//! `XArray` stores owned pointers (`ForeignOwnable`) and cannot iterate,
//! so this calls the C API directly.
//!
//! Locking: the XArray's spinlock keeps the tree consistent. [`Registry`]
//! adds a mutex that callers of [`Registry::for_each`] hold while they use
//! a buffer (they may sleep there), and that removal takes, so a buffer
//! listed there stays alive until the sweep moves on. Reserving an index
//! allocates with neither lock held; removing never allocates.

use core::ptr::null_mut;

use kernel::{
    bindings,
    new_mutex,
    prelude::*,
    sync::Mutex,
    types::Opaque, //
};

use crate::buffer::Buffer;

/// `XA_PRESENT` (`include/linux/xarray.h`): find any entry but reserved
/// ones. A macro, so not in the bindings.
const XA_PRESENT: bindings::xa_mark_t = 8;

/// The live buffers of a device, by index.
///
/// # Invariants
///
/// `xa` is an initialised XArray with `XA_FLAGS_ALLOC`; every entry is
/// reserved (`XA_ZERO_ENTRY`) or the address of a live [`Buffer`], which
/// removes its entry, holding `sweep`, before it is freed.
#[pin_data(PinnedDrop)]
pub(crate) struct Registry {
    #[pin]
    xa: Opaque<bindings::xarray>,
    /// Held by sweeps while they use a listed buffer, and by removal.
    #[pin]
    sweep: Mutex<()>,
}

// SAFETY: The XArray synchronises itself (its spinlock, RCU for lookups);
// the addresses it holds are only dereferenced under `sweep` (see the type
// invariants), and `Buffer` is `Sync`.
unsafe impl Send for Registry {}
// SAFETY: As above.
unsafe impl Sync for Registry {}

impl Registry {
    pub(crate) fn new() -> impl PinInit<Self> {
        pin_init!(Self {
            // SAFETY: `xa_init_flags` initialises the XArray in place.
            // INVARIANT: An empty allocating XArray.
            xa <- Opaque::ffi_init(|xa| unsafe {
                bindings::xa_init_flags(xa, bindings::XA_FLAGS_ALLOC)
            }),
            sweep <- new_mutex!((), "Registry::sweep"),
        })
    }

    /// Reserves an index for a buffer under construction. Allocates (a
    /// node now and then) with no lock of ours held.
    pub(crate) fn reserve(&self) -> Result<u64> {
        let mut id = 0u32;
        // From 1: the index is also the buffer's `tdrv_buf_info.buf_id`,
        // which is never 0.
        let limit = bindings::xa_limit {
            min: 1,
            max: u32::MAX,
        };
        // SAFETY: `xa` is a valid allocating XArray (type invariants);
        // `__xa_alloc` is called with its lock held, as it requires, and
        // may drop it to allocate. A null entry reserves the index.
        let err = unsafe {
            bindings::xa_lock(self.xa.get());
            let err = bindings::__xa_alloc(
                self.xa.get(),
                &mut id,
                null_mut(),
                limit,
                bindings::GFP_KERNEL_ACCOUNT,
            );
            bindings::xa_unlock(self.xa.get());
            err
        };
        match err {
            0 => Ok(u64::from(id)),
            // Four billion live buffers: like any other limit.
            e if e == EBUSY.to_errno() => Err(ENOSPC),
            e => Err(Error::from_errno(e)),
        }
    }

    /// Lists `buf` at `id`, which [`Registry::reserve`] returned, under
    /// the sweep lock: a sweep that starts after this returns sees it, and
    /// one that ran before has released the lock, which orders whatever it
    /// did before this. Does not allocate: the slot exists.
    ///
    /// # Safety
    ///
    /// `buf` is a live buffer that calls [`Registry::remove`] with `id`
    /// before it is freed.
    pub(crate) unsafe fn publish(&self, id: u64, buf: *const Buffer) {
        let _sweep = self.sweep.lock();
        // SAFETY: A valid XArray; `id` is reserved, so storing there needs
        // no memory (GFP_NOWAIT could not sleep anyway). INVARIANT: the
        // caller's guarantee.
        unsafe {
            bindings::xa_store(
                self.xa.get(),
                id as usize,
                buf.cast_mut().cast(),
                bindings::GFP_NOWAIT,
            )
        };
    }

    /// Removes `id` (reserved or published) and then runs `then` while no
    /// sweep uses a buffer. Never allocates.
    pub(crate) fn remove(&self, id: u64, then: impl FnOnce()) {
        let _sweep = self.sweep.lock();
        // SAFETY: A valid XArray; erasing frees nodes, never allocates.
        unsafe { bindings::xa_erase(self.xa.get(), id as usize) };
        then();
    }

    /// Calls `f` on every listed buffer, with the sweep lock held.
    pub(crate) fn for_each(&self, f: impl Fn(&Buffer)) {
        let _sweep = self.sweep.lock();
        let mut index: usize = 0;
        // SAFETY: A valid XArray; `xa_find` takes its own RCU lock.
        let mut entry =
            unsafe { bindings::xa_find(self.xa.get(), &mut index, usize::MAX, XA_PRESENT) };
        while !entry.is_null() {
            // SAFETY: Listed entries are live buffers (type invariants),
            // and this one cannot leave before we release `sweep`.
            f(unsafe { &*entry.cast::<Buffer>() });
            // SAFETY: As for `xa_find`.
            entry = unsafe {
                bindings::xa_find_after(self.xa.get(), &mut index, usize::MAX, XA_PRESENT)
            };
        }
    }
}

#[pinned_drop]
impl PinnedDrop for Registry {
    fn drop(self: Pin<&mut Self>) {
        // SAFETY: A valid XArray, no longer used; its entries own nothing.
        unsafe { bindings::xa_destroy(self.xa.get()) };
    }
}

#[kunit_tests(tdrv_registry)]
mod tests {
    use super::*;
    use kernel::sync::atomic::{
        Atomic,
        Relaxed, //
    };

    /// More buffers than one kmalloc'd array of their addresses could
    /// list (4 MiB / 16 bytes = 262144 entries).
    #[test]
    fn holds_more_buffers_than_an_array_could() -> Result {
        let r = KBox::pin_init(Registry::new(), GFP_KERNEL)?;
        let n = 300_000u64;
        // Indices start at 1 (a buffer's id is never 0).
        for i in 1..=n {
            assert_eq!(r.reserve()?, i);
            if i % 1024 == 0 {
                crate::glue::cond_resched();
            }
        }
        // Reserved entries are not buffers: a sweep skips them.
        let seen = Atomic::new(0u32);
        r.for_each(|_| seen.add(1, Relaxed));
        assert_eq!(seen.load(Relaxed), 0);
        let ran = Atomic::new(0u64);
        for i in 1..=n {
            r.remove(i, || ran.add(1, Relaxed));
            if i % 1024 == 0 {
                crate::glue::cond_resched();
            }
        }
        assert_eq!(ran.load(Relaxed), n);
        // Indices are reused once free.
        assert_eq!(r.reserve()?, 1);
        Ok(())
    }
}
