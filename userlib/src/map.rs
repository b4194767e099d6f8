//! Guard-based views of a tensor's bytes: [`Tensor::map_read`] and
//! [`Tensor::map_write`] lend a range of the host memory or the device
//! buffer's mapping as `&[u8]` / `&mut [u8]`, without copying, for the
//! guard's life (as vulkano's buffer guards and wgpu's `BufferView` do).
//!
//! What makes the reference sound while the guard lives (see
//! `userlib/DESIGN.md`, "Mapping guards"):
//!
//! - host side: the guard holds a long-lived span of the storage's
//!   byte-range exclusion: conflicting plain copies, accessors and other
//!   guards are refused with [`Error::Busy`] (never kept waiting: the
//!   thread holding the guard might be the one asking);
//! - device side (`Dma`): the buffer is pinned in its [`crate::Device`],
//!   so every ioctl that would write its bytes (COPY_IN, MEMSET, COPY,
//!   SUBMIT, through the tensor layer or the raw [`crate::sys`] calls) is
//!   refused with [`crate::SysError::Pinned`]; then the guard waits for
//!   the device work in flight (writes for `map_read`, all for
//!   `map_write`) and checks the buffer's error latch.

use std::ops::{Deref, DerefMut, RangeBounds};
use std::ptr::NonNull;
use std::time::Duration;

use crate::builder::byte_range;
use crate::error::{Error, Result};
use crate::fence::{HeldSpan, Span};
use crate::storage::Storage;
use crate::sys::{FenceKind, Pin};
use crate::tensor::Tensor;
use crate::wait::Deadline;

/// Bytes of a tensor lent by [`Tensor::map_read`]; derefs to `[u8]`.
pub struct MappedBytes<'a> {
    ptr: NonNull<u8>,
    len: usize,
    // Dropped after the reference can no longer be used (fields drop in
    // declaration order, after the guard itself is gone).
    _pin: Option<Pin<'a>>,
    _span: HeldSpan<'a>,
}

/// Bytes of a tensor lent by [`Tensor::map_write`]; derefs to `&mut [u8]`.
pub struct MappedBytesMut<'a> {
    ptr: NonNull<u8>,
    len: usize,
    _pin: Option<Pin<'a>>,
    _span: HeldSpan<'a>,
}

impl Deref for MappedBytes<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes of the storage
        // (checked range, host memory or the live mapping; the tensor is
        // borrowed for 'a, so the storage lives); the read span excludes
        // every conflicting host write (plain copies, accessors, guards:
        // refused with Busy) and the pin every device write, for as long
        // as `self` (and so the returned borrow) lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Deref for MappedBytesMut<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: as for `MappedBytes`; the write span excludes every other
        // host access to the range.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for MappedBytesMut<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; the write span is exclusive over the range
        // (no other host access, read or write, can be registered while it
        // is held) and `&mut self` makes this borrow unique among the
        // guard's own.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for MappedBytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedBytes")
            .field("len", &self.len)
            .finish()
    }
}

impl std::fmt::Debug for MappedBytesMut<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedBytesMut")
            .field("len", &self.len)
            .finish()
    }
}

type Parts<'a> = (NonNull<u8>, usize, Option<Pin<'a>>, HeldSpan<'a>);

impl Tensor {
    /// With `shared_ok`, the caller has promised (`map_*_shared`) that no
    /// other process writes (or, for `write`, accesses) the range while
    /// the guard lives; otherwise a buffer shared through a dma-buf is
    /// [`Error::SharedBuffer`].
    fn map_range(
        &self,
        op: &'static str,
        range: impl RangeBounds<usize>,
        write: bool,
        shared_ok: bool,
        timeout: Option<Duration>,
    ) -> Result<Parts<'_>> {
        let deadline = Deadline::from_timeout(timeout);
        let timed_out = || Error::Timeout {
            op,
            name: self.name().to_owned(),
            waited: timeout.unwrap_or_default(),
        };
        let (offset, len) = byte_range(op, range, self.size())?;
        let (st, abs) = self.locate(op, offset, len)?;
        let st: &Storage = st;
        let Some(base) = st.host_base() else {
            return Err(Error::Unsupported {
                op,
                kind: st.kind(),
            });
        };
        // Host side first: waits for the plain copies it overlaps, refuses
        // accessors and other guards.
        let Some(span) = st
            .sync
            .hold_until(op, Span::guard(abs, len, write), deadline)?
        else {
            return Err(timed_out());
        };
        let pin = match st.dma() {
            Some(b) => {
                // No device write can start from here on, and no export
                // (it refuses a pinned buffer) ...
                let pin = b.device.pin(b.handle)?;
                // ... so whether another process may write the bytes is
                // settled now.
                if b.device.is_shared(b.handle) && !shared_ok {
                    return Err(Error::SharedBuffer { op });
                }
                // ... and those in flight are waited for.
                let kind = if write {
                    FenceKind::All
                } else {
                    FenceKind::Writes
                };
                let done = b.fence_until(kind, deadline).map_err(|e| match e {
                    Error::Sys(e) => self.dma_error(op, b, e),
                    e => e,
                })?;
                if !done {
                    return Err(timed_out());
                }
                Some(pin)
            }
            None => {
                // Host storage: the async marks stand for device access.
                if !st.sync.wait_device(write, deadline) {
                    return Err(timed_out());
                }
                None
            }
        };
        // SAFETY: `abs + len` is inside the storage (`locate`).
        let ptr = unsafe { NonNull::new_unchecked(base.as_ptr().add(abs)) };
        Ok((ptr, len, pin, span))
    }

    /// Lends the bytes of `range` (of this view) for reading, without a
    /// copy. While the guard lives, host writes to the range (plain copies,
    /// accessors, `map_write`) are [`Error::Busy`], and device writes to
    /// the buffer are refused ([`crate::SysError::Pinned`]). Waits for
    /// device writes in flight; a buffer a failed job wrote is
    /// [`Error::DeviceWriteFailed`]. `Fake` tensors and unmapped buffers
    /// are [`Error::Unsupported`]; a buffer shared through a dma-buf,
    /// which another process may write, is [`Error::SharedBuffer`] (see
    /// [`Tensor::map_read_shared`]).
    ///
    /// ```
    /// use tdrv::Tensor;
    ///
    /// let t = Tensor::from_slice(&[1u8, 2, 3, 4, 5])?.into_tensor();
    /// {
    ///     let bytes = t.map_read(1..4)?;
    ///     assert_eq!(&*bytes, [2, 3, 4]);
    ///     assert!(t.write(0, &[9, 9]).is_err()); // Busy: overlaps the guard
    ///     t.write(4, &[6])?; // disjoint: fine
    /// }
    /// {
    ///     let mut bytes = t.map_write(..)?;
    ///     bytes.fill(7);
    /// }
    /// assert_eq!(t.to_vec()?, [7; 5]);
    /// # Ok::<(), tdrv::Error>(())
    /// ```
    pub fn map_read(&self, range: impl RangeBounds<usize>) -> Result<MappedBytes<'_>> {
        let (ptr, len, _pin, _span) = self.map_range("map_read", range, false, false, None)?;
        Ok(MappedBytes {
            ptr,
            len,
            _pin,
            _span,
        })
    }

    /// Lends the bytes of `range` for reading and writing, without a copy.
    /// While the guard lives, every other host access to the range is
    /// [`Error::Busy`] and device writes to the buffer are refused. Waits
    /// for all device access in flight. Writes through the guard do not
    /// clear a failed job's error latch (the kernel does not see them): a
    /// latched buffer is [`Error::DeviceWriteFailed`] here; write it with
    /// [`Tensor::write`] first. See [`Tensor::map_read`].
    pub fn map_write(&self, range: impl RangeBounds<usize>) -> Result<MappedBytesMut<'_>> {
        let (ptr, len, _pin, _span) = self.map_range("map_write", range, true, false, None)?;
        Ok(MappedBytesMut {
            ptr,
            len,
            _pin,
            _span,
        })
    }

    /// [`Tensor::map_read`] that waits at most `timeout` for the device
    /// writes in flight ([`Error::Timeout`] then, with nothing held).
    /// `map_read` itself waits without limit and logs a warning every
    /// heartbeat interval ([`crate::set_heartbeat_interval`]) meanwhile.
    pub fn map_read_timeout(
        &self,
        range: impl RangeBounds<usize>,
        timeout: Duration,
    ) -> Result<MappedBytes<'_>> {
        let (ptr, len, _pin, _span) =
            self.map_range("map_read", range, false, false, Some(timeout))?;
        Ok(MappedBytes {
            ptr,
            len,
            _pin,
            _span,
        })
    }

    /// [`Tensor::map_write`] that waits at most `timeout` for the device
    /// accesses in flight ([`Error::Timeout`] then); see
    /// [`Tensor::map_read_timeout`].
    pub fn map_write_timeout(
        &self,
        range: impl RangeBounds<usize>,
        timeout: Duration,
    ) -> Result<MappedBytesMut<'_>> {
        let (ptr, len, _pin, _span) =
            self.map_range("map_write", range, true, false, Some(timeout))?;
        Ok(MappedBytesMut {
            ptr,
            len,
            _pin,
            _span,
        })
    }

    /// [`Tensor::map_read`] of a buffer shared through a dma-buf, which
    /// the safe form refuses ([`Error::SharedBuffer`]). Everything done
    /// through this tensor's storage in this process is still excluded as
    /// by `map_read` (host writes are [`Error::Busy`], device writes through
    /// this device's files are refused); what the library cannot see is
    /// the other holders of the dma-buf. An import of the buffer on another
    /// device ([`Tensor::share_to`], or [`Tensor::from_dmabuf`] on another
    /// [`crate::Device`]) is one of those, even in this process: it is a
    /// separate buffer of that device, whose copies and jobs this guard
    /// does not exclude.
    ///
    /// # Safety
    /// No other process, no device user of the dma-buf outside this
    /// device's tdrv files, and no tensor of another device's import of it
    /// may write the bytes of `range` while the guard lives: a reference's
    /// bytes must not change under it.
    pub unsafe fn map_read_shared(
        &self,
        range: impl RangeBounds<usize>,
    ) -> Result<MappedBytes<'_>> {
        let (ptr, len, _pin, _span) =
            self.map_range("map_read_shared", range, false, true, None)?;
        Ok(MappedBytes {
            ptr,
            len,
            _pin,
            _span,
        })
    }

    /// [`Tensor::map_write`] of a buffer shared through a dma-buf; see
    /// [`Tensor::map_read_shared`].
    ///
    /// # Safety
    /// No other process, no device user of the dma-buf outside this
    /// device's tdrv files, and no tensor of another device's import of it
    /// may read or write the bytes of `range` while the guard lives.
    pub unsafe fn map_write_shared(
        &self,
        range: impl RangeBounds<usize>,
    ) -> Result<MappedBytesMut<'_>> {
        let (ptr, len, _pin, _span) =
            self.map_range("map_write_shared", range, true, true, None)?;
        Ok(MappedBytesMut {
            ptr,
            len,
            _pin,
            _span,
        })
    }
}

/// A [`MappedBytes`] that owns a handle of its tensor instead of
/// borrowing it, so it can be kept anywhere (`'static`, `Send`): for
/// owners that reference-count the view, such as Python's buffer protocol
/// and DLPack capsules. Made by [`Tensor::map_read_owned`]; the same
/// exclusion and pin hold until it is dropped.
pub struct OwnedMappedBytes {
    // Declared first, so dropped first: the span and pin are released
    // while the handle still keeps their storage and device alive.
    guard: MappedBytes<'static>,
    _tensor: Tensor,
}

/// A [`MappedBytesMut`] that owns a handle of its tensor; see
/// [`OwnedMappedBytes`]. Made by [`Tensor::map_write_owned`].
pub struct OwnedMappedBytesMut {
    guard: MappedBytesMut<'static>,
    _tensor: Tensor,
}

// SAFETY: the guard is a pointer into storage its own handle keeps alive,
// plus a span and a pin whose release locks the storage's and the device's
// locks from whichever thread drops it (nothing in them is bound to the
// thread that took them). Across threads it lends `&[u8]` only through
// `&self` and `&mut [u8]` only through `&mut self`, as a `Vec<u8>` does.
unsafe impl Send for OwnedMappedBytes {}
// SAFETY: as above.
unsafe impl Sync for OwnedMappedBytes {}
// SAFETY: as above.
unsafe impl Send for OwnedMappedBytesMut {}
// SAFETY: as above.
unsafe impl Sync for OwnedMappedBytesMut {}

impl Deref for OwnedMappedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.guard
    }
}

impl Deref for OwnedMappedBytesMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.guard
    }
}

impl DerefMut for OwnedMappedBytesMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.guard
    }
}

impl std::fmt::Debug for OwnedMappedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedMappedBytes")
            .field("len", &self.guard.len)
            .finish()
    }
}

impl std::fmt::Debug for OwnedMappedBytesMut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedMappedBytesMut")
            .field("len", &self.guard.len)
            .finish()
    }
}

impl Tensor {
    /// [`Tensor::map_read`] with a guard that holds its own handle of the
    /// view (a quiet clone) rather than borrowing `self`.
    ///
    /// ```
    /// let t = tdrv::Tensor::from_slice(&[1u8, 2, 3])?.into_tensor();
    /// let bytes = t.map_read_owned(1..)?;
    /// drop(t); // the guard keeps the view and its storage alive
    /// assert_eq!(&*bytes, [2, 3]);
    /// # Ok::<(), tdrv::Error>(())
    /// ```
    pub fn map_read_owned(&self, range: impl RangeBounds<usize>) -> Result<OwnedMappedBytes> {
        let tensor = self.clone_quiet();
        let guard = tensor.map_read(range)?;
        // SAFETY: the guard's borrows point into heap blocks, never into
        // the `tensor` handle itself: the view's `Arc<Storage>` (the span's
        // `HostSync`, the bytes) and the storage's `Arc<Device>` (the pin).
        // `tensor` moves into the result next to the guard and is dropped
        // after it, so those blocks outlive the guard; no view handle can
        // swap the storage meanwhile (`attach_buffer` needs the only
        // handle, and `tensor` counts as one).
        let guard = unsafe { std::mem::transmute::<MappedBytes<'_>, MappedBytes<'static>>(guard) };
        Ok(OwnedMappedBytes {
            guard,
            _tensor: tensor,
        })
    }

    /// [`Tensor::map_write`] with a guard that holds its own handle of the
    /// view; see [`Tensor::map_read_owned`].
    pub fn map_write_owned(&self, range: impl RangeBounds<usize>) -> Result<OwnedMappedBytesMut> {
        let tensor = self.clone_quiet();
        let guard = tensor.map_write(range)?;
        // SAFETY: as in `map_read_owned`.
        let guard =
            unsafe { std::mem::transmute::<MappedBytesMut<'_>, MappedBytesMut<'static>>(guard) };
        Ok(OwnedMappedBytesMut {
            guard,
            _tensor: tensor,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::accessor::TensorAccessors;
    use crate::ops::TensorOps;
    use crate::{Error, Tensor};

    #[test]
    fn guards_exclude_conflicting_host_access_without_waiting() {
        let t = Tensor::from_slice(&[0u8; 64]).unwrap().into_tensor();
        let other = t.clone();
        let mut third = t.clone();
        let s = t.slice(32, 32, None).unwrap();
        {
            let r = t.map_read(0..16).unwrap();
            assert_eq!(r.len(), 16);
            // Readers coexist; writers of the range are refused at once.
            let r2 = other.map_read(8..24).unwrap();
            assert_eq!(&r2[..], [0; 16]);
            assert!(matches!(other.write(4, &[1]), Err(Error::Busy { .. })));
            assert!(matches!(t.map_write(15..17), Err(Error::Busy { .. })));
            assert!(matches!(t.memset(0, 1, 64), Err(Error::Busy { .. })));
            assert!(third.accessor_mut::<u8, 1>([64]).is_err());
            // Outside the range: fine.
            s.write(0, &[5; 32]).unwrap();
            let mut b = [0; 4];
            other.read(0, &mut b).unwrap();
        }
        {
            let mut w = s.map_write(..).unwrap();
            assert_eq!(&w[..2], [5, 5]);
            w.copy_from_slice(&[9; 32]);
            let mut b = [0; 1];
            assert!(matches!(t.read(40, &mut b), Err(Error::Busy { .. })));
            assert!(matches!(s.map_read(..1), Err(Error::Busy { .. })));
            t.read(0, &mut b).unwrap(); // the first half is not lent
        }
        assert_eq!(t.to_vec().unwrap()[32..], [9; 32]);
        // Ranges are checked; Fake storage has no bytes to lend.
        assert!(matches!(t.map_read(60..65), Err(Error::OutOfBounds { .. })));
        let f = Tensor::allocate_fake(8, None).unwrap();
        assert!(matches!(f.map_read(..), Err(Error::Unsupported { .. })));
    }

    #[test]
    fn owned_guards_outlive_their_handle_and_keep_excluding() {
        let t = Tensor::from_slice(&[3u8; 32]).unwrap().into_tensor();
        let keep = t.clone();
        let mut w = t.map_write_owned(8..16).unwrap();
        drop(t);
        w.fill(5);
        // The guard still excludes conflicting access from other handles
        // and other threads, and can move to another thread.
        assert!(matches!(keep.write(10, &[1]), Err(Error::Busy { .. })));
        let w = std::thread::spawn(move || {
            assert_eq!(&w[..], [5; 8]);
            w
        })
        .join()
        .unwrap();
        assert!(matches!(keep.map_read(..), Err(Error::Busy { .. })));
        drop(w);
        assert_eq!(
            keep.to_vec().unwrap()[7..17],
            [3, 5, 5, 5, 5, 5, 5, 5, 5, 3]
        );
        // A read guard alone keeps the storage alive.
        let slice = keep.slice(4, 4, None).unwrap();
        let r = slice.map_read_owned(..).unwrap();
        drop((keep, slice));
        assert_eq!(&*r, [3, 3, 3, 3]);
    }

    #[test]
    fn a_guard_and_a_writer_thread_never_race() {
        let t = Tensor::from_slice(&[0u32; 16]).unwrap().into_tensor();
        let writer = {
            let t = t.clone();
            std::thread::spawn(move || {
                let mut busy = 0;
                for i in 0..if cfg!(miri) { 20 } else { 2000 } {
                    match t.write_from(0, &[i as u32; 16]) {
                        Ok(()) => {}
                        Err(Error::Busy { .. }) => busy += 1,
                        Err(e) => panic!("{e}"),
                    }
                }
                busy
            })
        };
        for _ in 0..if cfg!(miri) { 20 } else { 2000 } {
            if let Ok(g) = t.map_read(..) {
                // All 16 words come from one write: the guard's bytes do
                // not change under it.
                let first = g[0];
                assert!(g.iter().step_by(4).all(|b| *b == first));
            }
        }
        writer.join().unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "opens /dev/null and issues ioctls")]
    fn a_pinned_buffer_refuses_every_device_write() {
        use crate::sys::{tdrv_copy_desc, Device, SysError};
        let dev = Device::fake_for_tests();
        let desc = |dst| tdrv_copy_desc {
            src_handle: 1,
            src_offset: 0,
            dst_handle: dst,
            dst_offset: 0,
            size: 1,
        };
        let pin = dev.pin(7).unwrap();
        let pinned = |r: Result<(), crate::Error>| {
            matches!(r, Err(crate::Error::Sys(SysError::Pinned { .. })))
        };
        assert!(pinned(dev.copy_in(7, 0, &[1])));
        assert!(pinned(dev.memset(7, 0, 1, 0)));
        assert!(pinned(dev.copy(&desc(7))));
        assert!(pinned(dev.submit(&[desc(3), desc(7)]).map(drop)));
        // Other buffers, and reads of the pinned one, reach the driver
        // (here /dev/null: ENOTTY).
        assert!(matches!(
            dev.copy_in(8, 0, &[1]),
            Err(crate::Error::Sys(SysError::NotTdrv { .. }))
        ));
        let mut b = [0];
        assert!(matches!(
            dev.copy_out(7, 0, &mut b),
            Err(crate::Error::Sys(SysError::NotTdrv { .. }))
        ));
        let pin2 = dev.pin(7).unwrap();
        drop(pin);
        assert!(pinned(dev.memset(7, 0, 1, 0)));
        drop(pin2);
        assert!(matches!(
            dev.memset(7, 0, 1, 0),
            Err(crate::Error::Sys(SysError::NotTdrv { .. }))
        ));
    }
}
