// SPDX-License-Identifier: MIT OR Apache-2.0
//! What a Python view of a tensor's bytes holds: a mapping guard of the
//! crate (`Tensor::map_read_owned` / `map_write_owned`).
//!
//! While a guard lives, the crate's rules apply to everyone else: host
//! access that conflicts with it (a write to a range a read guard lends, or
//! any access to a range a write guard lends, through tdrv calls, accessors
//! or other guards) fails with `tdrv.BusyError`, and for a device (`Dma`)
//! tensor every device write to the buffer (job, COPY, COPY_IN, MEMSET) is
//! refused with `BusyError` too (the pin). Taking the guard waits for the
//! device work in flight (writes for a read guard, everything for a write
//! guard) and fails with `DeviceWriteFailedError` if a failed job left the
//! buffer undefined.

use std::sync::Arc;

use tdrv::{OwnedMappedBytes, OwnedMappedBytesMut, Tensor};

use crate::dlpack::Import;

enum Kind {
    Read { _g: OwnedMappedBytes },
    // Never dereferenced after `ptr` is taken from it: the bytes are
    // written only through that pointer, by Python's consumers.
    Write { _g: OwnedMappedBytesMut },
}

/// A guard over a whole tensor view, shared (`Arc`) by the exports that use
/// it: buffer-protocol views, DLPack capsules, a `tdrv.Mapping`.
pub struct Guard {
    // Declared first: released before the import it may lend.
    _kind: Kind,
    ptr: *mut u8,
    len: usize,
    /// The DLPack producer's tensor under a `User` storage, kept until the
    /// guard is gone.
    _keep: Option<Arc<Import>>,
}

// SAFETY: `ptr` is an address inside the guard's own bytes, only handed to
// Python consumers; the guards are `Send + Sync` (see the crate), and
// `Import` is too.
unsafe impl Send for Guard {}
// SAFETY: as above: `&Guard` gives the address and the length only.
unsafe impl Sync for Guard {}

impl Guard {
    /// Lends all of `t`'s bytes: for writing if `write`.
    pub fn new(t: &Tensor, write: bool, keep: Option<Arc<Import>>) -> tdrv::Result<Guard> {
        let (kind, ptr, len) = if write {
            let mut g = t.map_write_owned(..)?;
            let ptr = g.as_mut_ptr();
            let len = g.len();
            (Kind::Write { _g: g }, ptr, len)
        } else {
            let g = t.map_read_owned(..)?;
            // Read-only: consumers get the read-only flag, never write.
            let ptr = g.as_ptr().cast_mut();
            let len = g.len();
            (Kind::Read { _g: g }, ptr, len)
        };
        Ok(Guard {
            _kind: kind,
            ptr,
            len,
            _keep: keep,
        })
    }

    /// The first byte (dangling but non-null for 0 bytes).
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Number of bytes lent.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the bytes are lent for writing.
    pub fn writable(&self) -> bool {
        matches!(self._kind, Kind::Write { .. })
    }
}
