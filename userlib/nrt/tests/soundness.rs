// SPDX-License-Identifier: MIT OR Apache-2.0
//! Issue 11, holes 2 and 3, through the C ABI: caller memory is never
//! turned into Rust references (Miri checks the aliasing), and stale,
//! foreign or doubly freed handles are clean errors (Miri checks that no
//! freed memory is read).

use std::ffi::CString;
use std::ptr::null_mut;

use nrt::*;

fn alloc(size: usize, name: &str) -> *mut nrt_tensor_t {
    let name = CString::new(name).unwrap();
    let mut t = null_mut();
    // SAFETY: valid name and out pointer.
    let s = unsafe {
        nrt_tensor_allocate(
            NRT_TENSOR_PLACEMENT_VIRTUAL,
            -1,
            size,
            name.as_ptr(),
            &mut t,
        )
    };
    assert_eq!(s, NRT_SUCCESS);
    t
}

fn free(mut t: *mut nrt_tensor_t) {
    // SAFETY: a writable variable holding a handle.
    unsafe { nrt_tensor_free(&mut t) };
    assert!(t.is_null());
}

fn fill(t: *mut nrt_tensor_t) {
    let bytes: Vec<u8> = (0..nrt_tensor_get_size(t)).map(|i| i as u8).collect();
    // SAFETY: `bytes` is valid for its length.
    let s = unsafe { nrt_tensor_write(t, bytes.as_ptr().cast(), 0, bytes.len()) };
    assert_eq!(s, NRT_SUCCESS);
}

// ----------------------------------------------------------- hole 2

/// Two ops of one read batch with overlapping destinations: legal C. One
/// `&mut [u8]` per op made them alias (a Stacked Borrows violation).
#[test]
fn read_batch_with_overlapping_destinations() {
    let t = alloc(16, "src");
    fill(t);
    let mut buf = [0u8; 12];
    let base = buf.as_mut_ptr();
    let ops = [
        nrt_tensor_batch_op_t {
            offset: 0,
            size: 8,
            buffer: base.cast(),
        },
        nrt_tensor_batch_op_t {
            offset: 8,
            size: 8,
            // SAFETY: inside `buf`.
            buffer: unsafe { base.add(4) }.cast(),
        },
    ];
    let batch = nrt_tensor_batch_t {
        tensor: t,
        ops: ops.as_ptr(),
        num_ops: 2,
    };
    // SAFETY: every pointer is valid for its size.
    assert_eq!(
        unsafe { nrt_tensor_read_batch(&batch, 1, false) },
        NRT_SUCCESS
    );
    // Ops apply in order: the second overwrites bytes 4..8 of the first.
    assert_eq!(buf, [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]);
    free(t);
}

/// A caller buffer inside the tensor's own memory (from
/// `nrt_tensor_get_va`): copied as by memmove.
#[test]
fn buffers_inside_the_tensor_itself() {
    let t = alloc(16, "self");
    fill(t);
    let va = nrt_tensor_get_va(t).cast::<u8>();
    // SAFETY: `va` is the tensor's 16 bytes; no other thread uses them.
    unsafe {
        assert_eq!(nrt_tensor_read(t, va.add(2).cast(), 0, 8), NRT_SUCCESS);
        let mut back = [0u8; 16];
        assert_eq!(
            nrt_tensor_read(t, back.as_mut_ptr().cast(), 0, 16),
            NRT_SUCCESS
        );
        assert_eq!(back, [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15]);
        assert_eq!(nrt_tensor_write(t, va.add(8).cast(), 4, 8), NRT_SUCCESS);
        let op = nrt_tensor_batch_op_t {
            offset: 0,
            size: 4,
            buffer: va.add(12).cast(),
        };
        let batch = nrt_tensor_batch_t {
            tensor: t,
            ops: &op,
            num_ops: 1,
        };
        assert_eq!(nrt_tensor_write_batch(&batch, 1, false), NRT_SUCCESS);
        assert_eq!(
            nrt_tensor_read(t, back.as_mut_ptr().cast(), 0, 16),
            NRT_SUCCESS
        );
        assert_eq!(
            back,
            [12, 13, 14, 15, 6, 7, 10, 11, 12, 13, 14, 15, 12, 13, 14, 15]
        );
    }
    free(t);
}

/// A read batch whose destination is its own op array: the descriptors
/// are copied before any byte moves.
#[test]
fn a_batch_may_overwrite_its_own_descriptors() {
    let t = alloc(64, "desc");
    let mut ops = [nrt_tensor_batch_op_t {
        offset: 0,
        size: 24,
        buffer: null_mut(),
    }];
    let p = ops.as_mut_ptr();
    // SAFETY: `p` points at `ops[0]`.
    unsafe { (*p).buffer = p.cast() };
    let batch = nrt_tensor_batch_t {
        tensor: t,
        ops: p,
        num_ops: 1,
    };
    // SAFETY: the destination is the 24-byte op array itself, valid.
    assert_eq!(
        unsafe { nrt_tensor_read_batch(&batch, 1, false) },
        NRT_SUCCESS
    );
    // The zeroed tensor bytes landed in the descriptor.
    assert_eq!(ops[0].size, 0);
    free(t);
}

/// Batches are checked whole before any byte moves: a bad second batch
/// leaves the first tensor untouched.
#[test]
fn a_bad_batch_moves_no_byte() {
    let (a, b) = (alloc(8, "a"), alloc(8, "b"));
    let src = [7u8; 8];
    let good = nrt_tensor_batch_op_t {
        offset: 0,
        size: 8,
        buffer: src.as_ptr().cast_mut().cast(),
    };
    let bad = nrt_tensor_batch_op_t {
        offset: 4,
        size: 8,
        buffer: src.as_ptr().cast_mut().cast(),
    };
    let batches = [
        nrt_tensor_batch_t {
            tensor: a,
            ops: &good,
            num_ops: 1,
        },
        nrt_tensor_batch_t {
            tensor: b,
            ops: &bad,
            num_ops: 1,
        },
    ];
    // SAFETY: valid descriptors and buffers.
    unsafe {
        assert_eq!(
            nrt_tensor_write_batch(batches.as_ptr(), 2, false),
            NRT_INVALID
        );
        let mut back = [1u8; 8];
        assert_eq!(
            nrt_tensor_read(a, back.as_mut_ptr().cast(), 0, 8),
            NRT_SUCCESS
        );
        assert_eq!(back, [0; 8]);
    }
    free(a);
    free(b);
}

// ----------------------------------------------------------- hole 3

/// A freed handle used again: NRT_INVALID_HANDLE, and no read of the freed
/// view (the old magic check read it: Valgrind and Miri saw a
/// use-after-free).
#[test]
fn a_stale_handle_is_invalid_handle() {
    let t = alloc(8, "stale");
    let stale = t;
    free(t);
    // SAFETY: the buffer is valid; the handle is stale on purpose.
    unsafe {
        assert_eq!(
            nrt_tensor_write(stale, [1u8; 8].as_ptr().cast(), 0, 8),
            NRT_INVALID_HANDLE
        );
    }
    assert_eq!(nrt_tensor_get_size(stale), 0);
    assert_eq!(nrt_tensor_memset(stale, 0, 0, 1), NRT_INVALID_HANDLE);
    // A newer tensor never answers to the old handle.
    let newer = alloc(8, "newer");
    assert_ne!(newer, stale);
    assert_eq!(nrt_tensor_memset(stale, 0, 0, 1), NRT_INVALID_HANDLE);
    free(newer);
}

/// Freeing twice is a logged error, not a double free.
#[test]
fn a_double_free_is_a_clean_error() {
    let t = alloc(8, "twice");
    let mut again = t;
    free(t);
    // SAFETY: a writable variable holding a stale handle.
    unsafe { nrt_tensor_free(&mut again) };
    // Left alone: the library did not recognise it.
    assert_eq!(again, t);
}

/// Pointers that were never handles of this library, and handles of the
/// wrong kind.
#[test]
fn foreign_pointers_are_invalid_handles() {
    #[repr(C)]
    struct NotATensor {
        magic: u32,
        junk: [u64; 8],
    }
    let mut fake = NotATensor {
        magic: 0x7456_6965,
        junk: [0; 8],
    };
    let p: *mut nrt_tensor_t = (&raw mut fake).cast();
    assert_eq!(nrt_tensor_memset(p, 0, 0, 1), NRT_INVALID_HANDLE);
    assert_eq!(nrt_tensor_get_size(p), 0);
    let mut set = null_mut();
    // SAFETY: valid out pointers throughout.
    unsafe {
        assert_eq!(nrt_allocate_tensor_set(&mut set), NRT_SUCCESS);
        // A set is not a tensor, a tensor not a set.
        assert_eq!(nrt_tensor_get_size(set.cast()), 0);
        let t = alloc(4, "t");
        let name = CString::new("x").unwrap();
        assert_eq!(
            nrt_add_tensor_to_tensor_set(t.cast(), name.as_ptr(), t),
            NRT_INVALID_HANDLE
        );
        let mut p2 = p;
        nrt_tensor_free(&mut p2);
        assert_eq!(p2, p);
        let mut s2: *mut nrt_tensor_set_t = (&raw mut fake).cast();
        nrt_destroy_tensor_set(&mut s2);
        assert!(!s2.is_null());
        nrt_destroy_tensor_set(&mut set);
        free(t);
    }
    assert_eq!(fake.magic, 0x7456_6965);
}

/// A handle freed by one thread while others use it: each call either
/// works on a live tensor or gets NRT_INVALID_HANDLE.
#[test]
fn free_racing_with_use() {
    let t = alloc(64, "racy");
    let h = t as usize;
    let users: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(move || {
                let t = h as *mut nrt_tensor_t;
                for _ in 0..10 {
                    let mut b = [0u8; 8];
                    // SAFETY: `b` is valid; the handle may go stale.
                    let s = unsafe { nrt_tensor_read(t, b.as_mut_ptr().cast(), 0, 8) };
                    assert!(s == NRT_SUCCESS || s == NRT_INVALID_HANDLE, "{s}");
                }
            })
        })
        .collect();
    free(t);
    for u in users {
        u.join().unwrap();
    }
}
