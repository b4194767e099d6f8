//! Operations on tensors, apart from the memory they work on.
//!
//! [`Tensor`] is typed memory: allocation, views (slices, typed views),
//! storage, addressing and host access (reads, writes, mappings).
//! [`TensorOps`] is what runs *on* that memory: fills and copies (on a
//! device, its MEMSET and COPY ioctls), and the state the device's work
//! leaves on it: the fences of in-flight accesses and the per-view
//! output-completion count that jobs raise. Asynchronous device jobs are
//! [`crate::Job`]s. The split follows the usual one of GPU libraries
//! between device memory and the streams that operate on it; here the
//! operations stay methods of the tensor through this extension trait:
//!
//! ```
//! use tdrv::ops::TensorOps; // or tdrv::TensorOps
//! use tdrv::Tensor;
//!
//! let a = Tensor::from_slice(&[1u8, 2, 3, 4])?.into_tensor();
//! let b = Tensor::allocate_host(4, Some("b"))?;
//! b.memset(0, 0xff, 4)?;
//! Tensor::copy(&a, 1, &b, 0, 2)?;
//! assert_eq!(b.to_vec()?, [2, 3, 0xff, 0xff]);
//! # Ok::<(), tdrv::Error>(())
//! ```

use std::time::Duration;

use crate::completion::{Access, Completion, PendingAccess};
use crate::error::Result;
use crate::tensor::Tensor;

mod sealed {
    /// Only the crate implements [`super::TensorOps`], so that it can
    /// grow without breaking anyone.
    pub trait Sealed {}
    impl Sealed for crate::Tensor {}
}

/// The operations on a [`Tensor`]'s memory (see [the module](self)).
/// Implemented for [`Tensor`] only (sealed).
pub trait TensorOps: sealed::Sealed {
    /// Fills `size` bytes at `offset` with `value`, after every in-flight
    /// device access (Dma: `TDRV_IOC_MEMSET`, fenced by the kernel).
    fn memset(&self, offset: usize, value: u8, size: usize) -> Result<()>;

    /// Copies `size` bytes from `src` at `src_offset` to `dst` at
    /// `dst_offset`: `Tensor::copy(&src, 0, &dst, 0, n)`.
    ///
    /// Two `Dma` tensors of one device use the device's copy
    /// (`TDRV_IOC_COPY`), and must be on the same HBM channel
    /// ([`crate::Error::CrossChannel`] otherwise). Every other combination
    /// does the host round trip: a host-side memmove through the host
    /// addresses, or `COPY_IN`/`COPY_OUT` for unmapped buffers. Overlapping
    /// ranges of one storage are copied as by memmove. A `Fake` source
    /// reads as zeros (the destination range is zero-filled, as by
    /// [`TensorOps::memset`]); a `Fake` destination discards the bytes.
    fn copy(
        src: &Tensor,
        src_offset: usize,
        dst: &Tensor,
        dst_offset: usize,
        size: usize,
    ) -> Result<()>;

    /// In-flight device accesses of the storage.
    fn pending_async(&self) -> Result<PendingAccess>;

    /// Waits until host access of kind `access` is safe from the device:
    /// for `Read`, no device write in flight; for `Write`, no device access
    /// at all. Call it before touching the bytes through [`Tensor::va`].
    /// `timeout`: `None` waits without limit, `Some(ZERO)` polls.
    ///
    /// For a `Dma` tensor whose buffer a failed job wrote this is
    /// [`crate::Error::DeviceWriteFailed`] (see [`crate::Error`]).
    fn wait_device_idle(&self, access: Access, timeout: Option<Duration>) -> Result<()>;

    /// The output-completion count of this view: how many jobs wrote its
    /// buffer and succeeded since the view was made or last reset (host
    /// storages: how many [`Completion::record`] calls). A small borrowed
    /// view; every call on it reads or waits on the count anew.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tdrv::TensorOps;
    ///
    /// let out = tdrv::Tensor::allocate_host(64, Some("out"))?;
    /// let done = out.completion();
    /// assert_eq!(done.count()?, 0);
    /// done.record()?; // a host producer's completion
    /// done.wait(1, Some(Duration::ZERO))?; // already reached: no wait
    /// done.reset()?;
    /// assert!(done.wait(1, Some(Duration::ZERO)).unwrap_err().is_timeout());
    /// # Ok::<(), tdrv::Error>(())
    /// ```
    fn completion(&self) -> Completion<'_>;
}

impl TensorOps for Tensor {
    fn memset(&self, offset: usize, value: u8, size: usize) -> Result<()> {
        self.fill(offset, value, size)
    }

    fn copy(
        src: &Tensor,
        src_offset: usize,
        dst: &Tensor,
        dst_offset: usize,
        size: usize,
    ) -> Result<()> {
        Tensor::copy_bytes(src, src_offset, dst, dst_offset, size)
    }

    fn pending_async(&self) -> Result<PendingAccess> {
        self.pending_accesses()
    }

    fn wait_device_idle(&self, access: Access, timeout: Option<Duration>) -> Result<()> {
        self.device_idle_wait(access, timeout)
    }

    fn completion(&self) -> Completion<'_> {
        Completion::new(self)
    }
}
