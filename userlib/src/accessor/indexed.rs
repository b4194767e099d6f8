//! [`TensorAccessor`]: unbuffered, multi-dimensional element access
//! straight through the tensor's host mapping (the seed's
//! `TensorAccessorBase`/`operator[]` indexer).

use std::marker::PhantomData;
use std::mem::size_of;
use std::ptr::NonNull;

use super::{direct_base, AccessorError, Element, Mode, ReadOnly, ReadWrite, Result};
use crate::coherency::{AccessorKind, Admission, CoherenceSlot};
use crate::completion::Access;
use crate::tensor::Tensor;

/// An unbuffered accessor of rank `N` over a tensor: element `index` lives
/// at element offset `sum(index[d] * strides[d])` from the view's first
/// byte. Holds one unbuffered slot of the tensor's enforcer for its whole
/// life; [`select`](Self::select) descends a rank without acquiring again.
///
/// Loads and stores are volatile: the bytes may be device memory that other
/// accessors (allowed by an `INCOHERENT_*` policy) or the device change
/// behind the compiler's back. Made with the tensor's fences waited out
/// (device writes for a read-only accessor, any device access for a
/// read-write one); it does not hold host I/O of the tensor off meanwhile.
pub struct TensorAccessor<'a, T: Element, const N: usize, M: Mode = ReadOnly> {
    slot: CoherenceSlot<'a>,
    base: NonNull<T>,
    sizes: [usize; N],
    strides: [usize; N],
    _marker: PhantomData<(&'a Tensor, M)>,
}

// SAFETY: the accessor points into storage kept alive by the borrowed
// tensor (which is Send + Sync); loads are volatile reads of `T: Element`
// and stores need `&mut self`, so sharing or moving it across threads is no
// different from sharing the tensor.
unsafe impl<T: Element, const N: usize, M: Mode> Send for TensorAccessor<'_, T, N, M> {}
// SAFETY: as above: `&self` methods only load.
unsafe impl<T: Element, const N: usize, M: Mode> Sync for TensorAccessor<'_, T, N, M> {}

/// Row-major strides of `sizes`, in elements.
fn contiguous_strides<const N: usize>(sizes: [usize; N]) -> Result<[usize; N]> {
    let mut strides = [0; N];
    let mut step: usize = 1;
    for d in (0..N).rev() {
        strides[d] = step;
        step = step
            .checked_mul(sizes[d])
            .ok_or_else(|| too_big(&sizes, &strides, 0))?;
    }
    Ok(strides)
}

fn too_big(sizes: &[usize], strides: &[usize], len: usize) -> AccessorError {
    AccessorError::ShapeOutOfBounds {
        sizes: sizes.to_vec(),
        strides: strides.to_vec(),
        needed: u128::MAX,
        len,
    }
}

/// Bytes the furthest element needs: `(sum((size - 1) * stride) + 1) *
/// size_of::<T>()`, or 0 when some size is 0 (nothing is addressable).
fn bytes_needed<T>(sizes: &[usize], strides: &[usize]) -> Option<u128> {
    if sizes.contains(&0) {
        return Some(0);
    }
    let mut last: u128 = 0;
    for (&n, &s) in sizes.iter().zip(strides) {
        last = last.checked_add((n as u128 - 1).checked_mul(s as u128)?)?;
    }
    last.checked_add(1)?.checked_mul(size_of::<T>() as u128)
}

/// Element offset of `index`, after checking it against `sizes`.
fn element_offset(index: &[usize], sizes: &[usize], strides: &[usize]) -> Result<usize> {
    if index.len() != sizes.len() || index.iter().zip(sizes).any(|(i, n)| i >= n) {
        return Err(AccessorError::IndexOutOfBounds {
            index: index.to_vec(),
            sizes: sizes.to_vec(),
        });
    }
    // Cannot overflow: every in-range index addresses at most the furthest
    // element, whose offset was checked to fit in the tensor.
    Ok(index.iter().zip(strides).map(|(i, s)| i * s).sum())
}

impl<'a, T: Element, const N: usize> TensorAccessor<'a, T, N, ReadOnly> {
    /// A read-only accessor over `sizes` with row-major strides.
    pub fn new(tensor: &'a Tensor, sizes: [usize; N]) -> Result<Self> {
        Self::with_strides(tensor, sizes, contiguous_strides(sizes)?)
    }

    /// A read-only accessor with explicit strides (in elements; 0
    /// broadcasts a dimension).
    pub fn with_strides(
        tensor: &'a Tensor,
        sizes: [usize; N],
        strides: [usize; N],
    ) -> Result<Self> {
        Self::make(tensor, sizes, strides, Access::Read)
    }
}

impl<'a, T: Element, const N: usize> TensorAccessor<'a, T, N, ReadWrite> {
    /// A read-write accessor over `sizes` with row-major strides.
    pub fn new_mut(tensor: &'a mut Tensor, sizes: [usize; N]) -> Result<Self> {
        Self::with_strides_mut(tensor, sizes, contiguous_strides(sizes)?)
    }

    /// A read-write accessor with explicit strides (in elements).
    pub fn with_strides_mut(
        tensor: &'a mut Tensor,
        sizes: [usize; N],
        strides: [usize; N],
    ) -> Result<Self> {
        Self::make(tensor, sizes, strides, Access::Write)
    }

    /// Stores `value` at `index`.
    pub fn set(&mut self, index: [usize; N], value: T) -> Result<()> {
        let off = element_offset(&index, &self.sizes, &self.strides)?;
        // SAFETY: `off` addresses an element inside the tensor (shape checked
        // at construction, index just now); the base is aligned for T and
        // the storage lives as long as the borrowed tensor.
        unsafe { self.base.as_ptr().add(off).write_volatile(value) };
        Ok(())
    }

    /// Descends one rank for writing, at `i` of the first dimension.
    pub fn select_mut(&mut self, i: usize) -> Result<TensorSubAccessor<'_, T, ReadWrite>> {
        let base = self.select_base(i)?;
        Ok(TensorSubAccessor::new(
            base,
            &self.sizes[1..],
            &self.strides[1..],
        ))
    }
}

impl<'a, T: Element, const N: usize, M: Mode> TensorAccessor<'a, T, N, M> {
    fn make(
        tensor: &'a Tensor,
        sizes: [usize; N],
        strides: [usize; N],
        access: Access,
    ) -> Result<Self> {
        let base = direct_base::<T>(tensor, "accessor")?;
        match bytes_needed::<T>(&sizes, &strides) {
            Some(needed) if needed <= tensor.size() as u128 => {}
            needed => {
                return Err(AccessorError::ShapeOutOfBounds {
                    sizes: sizes.to_vec(),
                    strides: strides.to_vec(),
                    needed: needed.unwrap_or(u128::MAX),
                    len: tensor.size(),
                })
            }
        }
        let slot = tensor.coherency_enforcer().slot(AccessorKind::Unbuffered)?;
        // The slot is released by its guard if the wait fails.
        tensor.wait_device_idle(access, -1)?;
        Ok(TensorAccessor {
            slot,
            base,
            sizes,
            strides,
            _marker: PhantomData,
        })
    }

    /// Loads the element at `index`.
    pub fn get(&self, index: [usize; N]) -> Result<T> {
        let off = element_offset(&index, &self.sizes, &self.strides)?;
        // SAFETY: as in `set`; a load only.
        Ok(unsafe { self.base.as_ptr().add(off).read_volatile() })
    }

    /// Descends one rank, at `i` of the first dimension (read-only).
    pub fn select(&self, i: usize) -> Result<TensorSubAccessor<'_, T, ReadOnly>> {
        let base = self.select_base(i)?;
        Ok(TensorSubAccessor::new(
            base,
            &self.sizes[1..],
            &self.strides[1..],
        ))
    }

    fn select_base(&self, i: usize) -> Result<NonNull<T>> {
        if N == 0 || i >= self.sizes[0] {
            return Err(AccessorError::IndexOutOfBounds {
                index: vec![i],
                sizes: self.sizes.to_vec(),
            });
        }
        // SAFETY: `i < sizes[0]`, so `i * strides[0]` is at most the
        // furthest element's offset, inside the tensor.
        Ok(unsafe { self.base.add(i * self.strides[0]) })
    }

    /// Sizes of every dimension.
    pub fn sizes(&self) -> &[usize; N] {
        &self.sizes
    }

    /// Strides of every dimension, in elements.
    pub fn strides(&self) -> &[usize; N] {
        &self.strides
    }

    /// Number of addressable indices (the product of the sizes).
    pub fn numel(&self) -> usize {
        // Cannot overflow: checked against the tensor size when made,
        // unless a stride is 0 (broadcast), where it saturates.
        self.sizes.iter().fold(1usize, |a, &n| a.saturating_mul(n))
    }

    /// Whether the slot was opened coherently.
    pub fn admission(&self) -> Admission {
        self.slot.admission()
    }
}

/// A lower-rank view into a [`TensorAccessor`], made by `select`: shares the
/// parent's slot (the seed forwards the enforcer reference without a new
/// acquire). Its rank is dynamic.
pub struct TensorSubAccessor<'b, T: Element, M: Mode> {
    base: NonNull<T>,
    sizes: &'b [usize],
    strides: &'b [usize],
    _marker: PhantomData<(&'b mut (), M)>,
}

// SAFETY: as for TensorAccessor: a borrow of it.
unsafe impl<T: Element, M: Mode> Send for TensorSubAccessor<'_, T, M> {}
// SAFETY: as for TensorAccessor.
unsafe impl<T: Element, M: Mode> Sync for TensorSubAccessor<'_, T, M> {}

impl<'b, T: Element, M: Mode> TensorSubAccessor<'b, T, M> {
    fn new(base: NonNull<T>, sizes: &'b [usize], strides: &'b [usize]) -> Self {
        TensorSubAccessor {
            base,
            sizes,
            strides,
            _marker: PhantomData,
        }
    }

    /// Remaining rank.
    pub fn rank(&self) -> usize {
        self.sizes.len()
    }

    /// Sizes of the remaining dimensions.
    pub fn sizes(&self) -> &[usize] {
        self.sizes
    }

    /// Loads the element at `index` (one entry per remaining dimension).
    pub fn get(&self, index: &[usize]) -> Result<T> {
        let off = element_offset(index, self.sizes, self.strides)?;
        // SAFETY: the base is an in-bounds element of the parent and every
        // in-range index below it stays inside the tensor (the parent's
        // shape check covers all of them).
        Ok(unsafe { self.base.as_ptr().add(off).read_volatile() })
    }

    /// The element of a rank-0 sub-accessor.
    pub fn value(&self) -> Result<T> {
        self.get(&[])
    }

    /// Descends one more rank (read-only).
    pub fn select(&self, i: usize) -> Result<TensorSubAccessor<'_, T, ReadOnly>> {
        let base = self.select_base(i)?;
        Ok(TensorSubAccessor::new(
            base,
            &self.sizes[1..],
            &self.strides[1..],
        ))
    }

    fn select_base(&self, i: usize) -> Result<NonNull<T>> {
        if self.sizes.first().is_none_or(|&n| i >= n) {
            return Err(AccessorError::IndexOutOfBounds {
                index: vec![i],
                sizes: self.sizes.to_vec(),
            });
        }
        // SAFETY: `i < sizes[0]`: still inside the parent's checked shape.
        Ok(unsafe { self.base.add(i * self.strides[0]) })
    }
}

impl<T: Element> TensorSubAccessor<'_, T, ReadWrite> {
    /// Stores `value` at `index`.
    pub fn set(&mut self, index: &[usize], value: T) -> Result<()> {
        let off = element_offset(index, self.sizes, self.strides)?;
        // SAFETY: as in `get`; the parent was made from an exclusive tensor
        // and is mutably borrowed by this sub-accessor.
        unsafe { self.base.as_ptr().add(off).write_volatile(value) };
        Ok(())
    }

    /// Stores into a rank-0 sub-accessor.
    pub fn set_value(&mut self, value: T) -> Result<()> {
        self.set(&[], value)
    }

    /// Descends one more rank for writing.
    pub fn select_mut(&mut self, i: usize) -> Result<TensorSubAccessor<'_, T, ReadWrite>> {
        let base = self.select_base(i)?;
        Ok(TensorSubAccessor::new(
            base,
            &self.sizes[1..],
            &self.strides[1..],
        ))
    }
}
