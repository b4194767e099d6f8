//! Issue 11, hole 4: out of memory while making a view or its name is an
//! error (`Error::OutOfMemory`), not an abort of the process.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use tdrv::compat::TensorCompat;
use tdrv::{Error, Tensor};

/// The system allocator, failing every allocation of this thread while
/// `FAIL` is set.
struct Failing;

thread_local! {
    static FAIL: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: forwards to the system allocator, or returns null (allowed).
unsafe impl GlobalAlloc for Failing {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if FAIL.with(Cell::get) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded: `ptr` came from `System.alloc`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Failing = Failing;

fn failing<R>(f: impl FnOnce() -> R) -> R {
    FAIL.with(|c| c.set(true));
    let r = f();
    FAIL.with(|c| c.set(false));
    r
}

#[test]
fn views_and_names_fail_cleanly_without_memory() {
    let t = Tensor::allocate_host(64, Some("parent")).unwrap();
    let r = failing(|| t.slice(0, 8, None).map(drop));
    assert!(matches!(r, Err(Error::OutOfMemory(_))), "{r:?}");
    let r = failing(|| t.slice(0, 8, Some("named")).map(drop));
    assert!(matches!(r, Err(Error::OutOfMemory(_))), "{r:?}");
    let r = failing(|| Tensor::allocate_empty(Some("empty")).map(drop));
    assert!(matches!(r, Err(Error::OutOfMemory(_))), "{r:?}");
    let r = failing(|| Tensor::allocate_host(16, None).map(drop));
    assert!(matches!(r, Err(Error::OutOfMemory(_))), "{r:?}");
    // Nothing leaked or broke: the parent still works.
    assert_eq!(t.storage_ref_count(), 1);
    assert_eq!(t.slice(0, 8, Some("later")).unwrap().size(), 8);
}
