//! Typed accessors onto a tensor's memory, gated by its
//! [`CoherencyEnforcer`] (seed 003, §5).
//!
//! | accessor                       | slot        | data path                          |
//! |--------------------------------|-------------|------------------------------------|
//! | [`TensorAccessor`]             | unbuffered  | direct loads/stores via the mapping |
//! | [`TensorReadStreamAccessor`]   | reader      | 4 KiB staging buffer, refilled      |
//! | [`TensorWriteStreamAccessor`]  | writer      | 4 KiB staging buffer, flushed       |
//! | [`TensorTcmAccessor`]          | unbuffered  | explicit copies to/from scratch     |
//!
//! Every accessor is RAII: its constructor acquires a slot of the tensor's
//! enforcer (failing with [`crate::Error::Coherence`] when the policy is
//! COHERENT and the slot would be incoherent) and `Drop` releases it. An
//! accessor borrows its tensor, so it cannot outlive it (the seed deletes
//! the rvalue-tensor factories for the same reason). Factories made from
//! `&Tensor` give read-only accessors and those made from `&mut Tensor`
//! read-write ones, like the seed's `const&`/`&` overloads.
//!
//! The enforcer is per view: handles cloned from one another
//! (`clone`, the seed's `get_reference`) share it, a slice has its own (as each
//! `at::Tensor` has its own). Staging copies use [`crate::memcpy`], so the
//! active `neuron_memcpy` method applies.
//!
//! ```
//! use tdrv::accessor::TensorAccessors;
//! use tdrv::coherency::{CoherenceError, Policy};
//! use tdrv::{Error, Tensor};
//!
//! let mut t = Tensor::allocate_host(2 * 3 * 4, None)?;
//! {
//!     let mut a = t.accessor_mut::<u32, 2>([2, 3])?;
//!     a.set([1, 2], 7)?;
//!     assert_eq!(a.get([1, 2])?, 7);
//! } // the unbuffered slot is released here
//! let mut r = t.read_stream_accessor::<u32>()?;
//! assert_eq!(r.next_element()?, Some(0));
//! // COHERENT (the default): buffered and direct accessors never mix.
//! assert!(matches!(
//!     t.accessor::<u32, 2>([2, 3]),
//!     Err(Error::Coherence(CoherenceError::Incoherent { .. }))
//! ));
//! t.set_accessor_coherence_policy(Policy::IncoherentQuiet);
//! assert_eq!(t.accessor::<u32, 2>([2, 3])?.get([1, 2])?, 7);
//! # Ok::<(), tdrv::Error>(())
//! ```
//!
//! A read-only accessor has no `set`:
//!
//! ```compile_fail
//! use tdrv::accessor::TensorAccessors;
//! let t = tdrv::Tensor::allocate_host(16, None).unwrap();
//! let mut a = t.accessor::<u32, 1>([4]).unwrap();
//! a.set([0], 1).unwrap();
//! ```

mod indexed;
mod stream;
mod tcm;

pub use indexed::{TensorAccessor, TensorSubAccessor};
pub use stream::{TensorReadStreamAccessor, TensorWriteStreamAccessor, STREAM_BUFFER_BYTES};
pub use tcm::{TcmBuffer, TensorTcmAccessor};

use std::mem::{align_of, size_of};
use std::ptr::NonNull;

use crate::coherency::{CoherencyEnforcer, Policy};
use crate::storage::StorageKind;
use crate::tensor::Tensor;

/// Plain data an accessor can load from and store to tensor memory:
/// every [`bytemuck::Pod`] type that is `Send + Sync` (all of them in
/// practice: numbers, [`half::f16`], [`half::bf16`], arrays of them and
/// `#[repr(C)]` structs deriving `Pod`). `Pod` is what makes it sound to
/// read arbitrary tensor bytes as a `T` and to write a `T` out: no padding,
/// every bit pattern valid.
pub trait Element: bytemuck::Pod + Send + Sync {}

impl<T: bytemuck::Pod + Send + Sync> Element for T {}

/// Marker of accessors made from a shared tensor: loads only.
#[derive(Debug, Clone, Copy)]
pub enum ReadOnly {}
/// Marker of accessors made from an exclusive tensor: loads and stores.
#[derive(Debug, Clone, Copy)]
pub enum ReadWrite {}

/// The access mode of an accessor ([`ReadOnly`] or [`ReadWrite`]).
pub trait Mode: sealed::Sealed + 'static {
    /// Whether stores are allowed.
    const WRITABLE: bool;
}
impl Mode for ReadOnly {
    const WRITABLE: bool = false;
}
impl Mode for ReadWrite {
    const WRITABLE: bool = true;
}
mod sealed {
    pub trait Sealed {}
    impl Sealed for super::ReadOnly {}
    impl Sealed for super::ReadWrite {}
}

/// Why an accessor could not be made or used: the source of
/// [`crate::Error::Accessor`]. The accessor API returns the crate's one
/// error type, [`crate::Error`]: failures of the tensor layer underneath
/// (a fence, a copy) are its own variants, and a refusal by the coherency
/// enforcer is [`crate::Error::Coherence`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AccessorError {
    /// The tensor has no host-addressable bytes for direct access.
    #[error("{op}: {kind:?} tensor {name:?} has no host-addressable memory")]
    NotAddressable {
        /// The operation.
        op: &'static str,
        /// Name of the tensor.
        name: String,
        /// Kind of storage.
        kind: Option<StorageKind>,
    },
    /// The element type cannot be staged or addressed.
    #[error("{op}: unsupported element type of {size} bytes")]
    BadElement {
        /// The operation.
        op: &'static str,
        /// Size in bytes.
        size: usize,
    },
    /// The tensor's memory is not aligned for the element type.
    #[error("{op}: tensor address {addr:#x} is not aligned to {align} bytes")]
    Misaligned {
        /// The operation.
        op: &'static str,
        /// The address.
        addr: usize,
        /// The alignment `T` needs.
        align: usize,
    },
    /// Sizes and strides reach past the end of the tensor (or overflow).
    #[error("shape {sizes:?} with strides {strides:?} needs {needed} bytes, the tensor has {len}")]
    ShapeOutOfBounds {
        /// Sizes of the dimensions.
        sizes: Vec<usize>,
        /// Strides, in elements.
        strides: Vec<usize>,
        /// Bytes the shape needs.
        needed: u128,
        /// Length available.
        len: usize,
    },
    /// An index is outside the accessor's sizes.
    #[error("index {index:?} is outside sizes {sizes:?}")]
    IndexOutOfBounds {
        /// The index.
        index: Vec<usize>,
        /// Sizes of the dimensions.
        sizes: Vec<usize>,
    },
    /// An element range is outside the tensor or the scratch buffer.
    #[error("{op}: elements [{offset}, {offset}+{count}) are outside the {len} available")]
    RangeOutOfBounds {
        /// The operation.
        op: &'static str,
        /// Start of the range.
        offset: usize,
        /// Elements asked for.
        count: usize,
        /// Length available.
        len: usize,
    },
    /// A write stream already wrote every element of its tensor.
    #[error("write stream is full: the tensor holds {len} elements")]
    StreamFull {
        /// Length available.
        len: usize,
    },
    /// The stream was closed.
    #[error("the stream is closed")]
    Closed,
}

impl AccessorError {
    /// The errno this error stands for (see [`crate::Error::raw_os_error`]).
    pub fn errno(&self) -> i32 {
        match self {
            AccessorError::NotAddressable { .. } => libc::ENXIO,
            AccessorError::BadElement { .. }
            | AccessorError::Misaligned { .. }
            | AccessorError::ShapeOutOfBounds { .. } => libc::EINVAL,
            AccessorError::IndexOutOfBounds { .. } | AccessorError::RangeOutOfBounds { .. } => {
                libc::ERANGE
            }
            AccessorError::StreamFull { .. } => libc::ENOSPC,
            AccessorError::Closed => libc::EBADF,
        }
    }
}

/// Result of the accessor API: the crate's [`crate::Result`].
pub type Result<T, E = crate::Error> = std::result::Result<T, E>;

/// Checks that `T` can be staged: not zero-sized, and no bigger than a
/// stream buffer.
fn check_element<T: Element>(op: &'static str) -> Result<()> {
    let size = size_of::<T>();
    if size == 0 || size > STREAM_BUFFER_BYTES {
        return Err(AccessorError::BadElement { op, size }.into());
    }
    Ok(())
}

/// The tensor's bytes as a host address aligned for `T`, for direct access.
fn direct_base<T: Element>(tensor: &Tensor, op: &'static str) -> Result<NonNull<T>> {
    if size_of::<T>() == 0 {
        return Err(AccessorError::BadElement { op, size: 0 }.into());
    }
    staged_kind(tensor, op)?;
    let base = tensor.va().ok_or_else(|| AccessorError::NotAddressable {
        op,
        name: tensor.name().to_owned(),
        kind: tensor.kind(),
    })?;
    let addr = base.as_ptr() as usize;
    if addr % align_of::<T>() != 0 {
        return Err(AccessorError::Misaligned {
            op,
            addr,
            align: align_of::<T>(),
        }
        .into());
    }
    Ok(base.cast())
}

/// Accessors need real bytes: refuses empty and size-only tensors.
fn staged_kind(tensor: &Tensor, op: &'static str) -> Result<StorageKind> {
    match tensor.kind() {
        Some(StorageKind::Fake) | None => Err(AccessorError::NotAddressable {
            op,
            name: tensor.name().to_owned(),
            kind: tensor.kind(),
        }
        .into()),
        Some(kind) => Ok(kind),
    }
}

mod sealed_tensor {
    /// Only the crate implements [`super::TensorAccessors`].
    pub trait Sealed {}
    impl Sealed for crate::Tensor {}
}

/// The seed's tensor-side accessor API (`TensorBase.h`): the view's
/// coherency enforcer, its policy, and the accessor factories. An
/// extension trait of [`Tensor`] (sealed), so that the seed's typed
/// accessors are one role apart from the tensor's own memory and views;
/// `use tdrv::accessor::TensorAccessors` (also in [`crate::compat`]) to
/// call them as methods.
pub trait TensorAccessors: sealed_tensor::Sealed {
    /// The accessor coherency enforcer of this view.
    fn coherency_enforcer(&self) -> &CoherencyEnforcer;

    /// The view's accessor coherence policy (COHERENT when made).
    fn get_accessor_coherence_policy(&self) -> Policy;

    /// Sets the policy; works through a shared tensor, like the seed's
    /// `const` setter on its `mutable` enforcer.
    fn set_accessor_coherence_policy(&self, policy: Policy);

    /// A read-only, unbuffered accessor over `sizes` (row-major strides).
    fn accessor<T: Element, const N: usize>(
        &self,
        sizes: [usize; N],
    ) -> Result<TensorAccessor<'_, T, N, ReadOnly>>;

    /// A read-write, unbuffered accessor over `sizes` (row-major strides).
    fn accessor_mut<T: Element, const N: usize>(
        &mut self,
        sizes: [usize; N],
    ) -> Result<TensorAccessor<'_, T, N, ReadWrite>>;

    /// A buffered reader of the view's `size() / size_of::<T>()` elements.
    fn read_stream_accessor<T: Element>(&self) -> Result<TensorReadStreamAccessor<'_, T>>;

    /// The exclusive buffered writer of the view's elements.
    fn write_stream_accessor<T: Element>(&mut self) -> Result<TensorWriteStreamAccessor<'_, T>>;

    /// A read-only TCM (scratch) stager.
    fn tcm_accessor(&self) -> Result<TensorTcmAccessor<'_, ReadOnly>>;

    /// A read-write TCM (scratch) stager.
    fn tcm_accessor_mut(&mut self) -> Result<TensorTcmAccessor<'_, ReadWrite>>;
}

impl TensorAccessors for Tensor {
    fn coherency_enforcer(&self) -> &CoherencyEnforcer {
        self.enforcer()
    }

    fn get_accessor_coherence_policy(&self) -> Policy {
        self.enforcer().policy()
    }

    fn set_accessor_coherence_policy(&self, policy: Policy) {
        self.enforcer().set_policy(policy);
    }

    fn accessor<T: Element, const N: usize>(
        &self,
        sizes: [usize; N],
    ) -> Result<TensorAccessor<'_, T, N, ReadOnly>> {
        TensorAccessor::new(self, sizes)
    }

    fn accessor_mut<T: Element, const N: usize>(
        &mut self,
        sizes: [usize; N],
    ) -> Result<TensorAccessor<'_, T, N, ReadWrite>> {
        TensorAccessor::new_mut(self, sizes)
    }

    fn read_stream_accessor<T: Element>(&self) -> Result<TensorReadStreamAccessor<'_, T>> {
        TensorReadStreamAccessor::new(self)
    }

    fn write_stream_accessor<T: Element>(&mut self) -> Result<TensorWriteStreamAccessor<'_, T>> {
        TensorWriteStreamAccessor::new(self)
    }

    fn tcm_accessor(&self) -> Result<TensorTcmAccessor<'_, ReadOnly>> {
        TensorTcmAccessor::new(self)
    }

    fn tcm_accessor_mut(&mut self) -> Result<TensorTcmAccessor<'_, ReadWrite>> {
        TensorTcmAccessor::new_mut(self)
    }
}

#[cfg(test)]
mod tests;
