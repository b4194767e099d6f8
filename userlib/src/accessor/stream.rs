//! The buffered stream accessors (the seed's `TensorStreamAccessor.h`): a
//! reader that serves elements from a 4 KiB staging buffer refilled from the
//! tensor, and an exclusive writer that collects elements in one and
//! flushes it to the tensor.

use std::marker::PhantomData;
use std::mem::size_of;

use super::{check_element, staged_kind, AccessorError, Element, Result};
use crate::coherency::{AccessorKind, Admission, CoherenceSlot};
use crate::log::log_warn;
use crate::memcpy::{neuron_memcpy_from_tensor, neuron_memcpy_to_tensor, LocalBuffer};
use crate::tensor::Tensor;

/// Size of a stream's staging buffer (the seed's `BUFFER_SIZE_BYTES`).
pub const STREAM_BUFFER_BYTES: usize = 4096;

/// Elements of `T` one staging buffer holds.
const fn capacity<T>() -> usize {
    STREAM_BUFFER_BYTES / size_of::<T>()
}

/// A buffered reader of the tensor's `size() / size_of::<T>()` elements, in
/// order (a trailing partial element is not read). It holds a
/// buffered-reader slot: other readers may be open, nothing else.
///
/// The constructor fills the staging buffer; each time it is used up the
/// next [`next_element`](Self::next_element) refills it with the next (up
/// to) 4 KiB through `neuron_memcpy`. Bytes the tensor gets after a refill
/// are not seen until the next one: that is why readers are incoherent with
/// writers and with unbuffered accessors.
///
/// ```
/// use tdrv::accessor::TensorAccessors;
/// use tdrv::Tensor;
///
/// let t = Tensor::allocate_host(12, None)?;
/// t.write(0, &[1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0])?;
/// let r = t.read_stream_accessor::<u16>()?;
/// let v: Vec<u16> = r.collect::<Result<_, _>>()?;
/// assert_eq!(v, [1, 2, 3, 4, 5, 6].map(u16::from_le));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct TensorReadStreamAccessor<'a, T: Element> {
    slot: Option<CoherenceSlot<'a>>,
    tensor: &'a Tensor,
    staging: LocalBuffer,
    /// Elements in the tensor.
    len: usize,
    /// Elements copied into the staging buffer so far.
    fetched: usize,
    /// Elements in the staging buffer now, and the next one to serve.
    buffered: usize,
    pos: usize,
    refills: usize,
    failed: bool,
    _t: PhantomData<T>,
}

impl<'a, T: Element> TensorReadStreamAccessor<'a, T> {
    /// Opens the reader and primes its buffer.
    pub fn new(tensor: &'a Tensor) -> Result<Self> {
        const OP: &str = "read_stream_accessor";
        check_element::<T>(OP)?;
        staged_kind(tensor, OP)?;
        let slot = tensor.enforcer().slot(AccessorKind::BufferedReader)?;
        let staging = LocalBuffer::staging_for(tensor, capacity::<T>() * size_of::<T>())?;
        let mut s = TensorReadStreamAccessor {
            slot: Some(slot),
            tensor,
            staging,
            len: tensor.size() / size_of::<T>(),
            fetched: 0,
            buffered: 0,
            pos: 0,
            refills: 0,
            failed: false,
            _t: PhantomData,
        };
        // Prime, as the seed's constructor does; an error drops `s`, which
        // releases the slot.
        if s.len > 0 {
            s.refill()?;
        }
        Ok(s)
    }

    fn refill(&mut self) -> Result<()> {
        let count = capacity::<T>().min(self.len - self.fetched);
        let size = size_of::<T>();
        neuron_memcpy_from_tensor(
            &mut self.staging,
            0,
            self.tensor,
            self.fetched * size,
            count * size,
        )?;
        self.buffered = count;
        self.pos = 0;
        self.fetched += count;
        self.refills += 1;
        Ok(())
    }

    /// The next element, `None` at the end of the tensor.
    pub fn next_element(&mut self) -> Result<Option<T>> {
        if self.slot.is_none() {
            return Err(AccessorError::Closed.into());
        }
        if self.pos == self.buffered {
            if self.fetched == self.len {
                return Ok(None);
            }
            self.refill()?;
        }
        // SAFETY: `pos < buffered <= capacity`, so the element lies inside
        // the staging buffer, which is aligned to at least 64 bytes (host)
        // or a page (device) and holds `T`s at multiples of their size;
        // every byte pattern is a valid `T`.
        let v = unsafe {
            self.staging
                .as_ptr()
                .add(self.pos * size_of::<T>())
                .cast::<T>()
                .read()
        };
        self.pos += 1;
        Ok(Some(v))
    }

    /// Elements in the tensor.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the tensor holds no whole element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements served so far.
    pub fn position(&self) -> usize {
        self.fetched - (self.buffered - self.pos)
    }

    /// Times the staging buffer was filled (the first fill included).
    pub fn refills(&self) -> usize {
        self.refills
    }

    /// Whether the staging buffer is device memory (DMA-reachable).
    pub fn staging_is_device(&self) -> bool {
        self.staging.is_device()
    }

    /// Whether the slot was opened coherently.
    pub fn admission(&self) -> Option<Admission> {
        self.slot.as_ref().map(CoherenceSlot::admission)
    }

    /// Releases the reader slot (the seed's `close()`). Later reads fail
    /// with [`AccessorError::Closed`]; closing again does nothing.
    pub fn close(&mut self) -> Result<()> {
        match self.slot.take() {
            Some(slot) => Ok(slot.release()?),
            None => Ok(()),
        }
    }
}

impl<T: Element> Iterator for TensorReadStreamAccessor<'_, T> {
    type Item = Result<T>;

    /// Yields each element; an error is yielded once, then the iteration
    /// ends. A closed stream yields nothing.
    fn next(&mut self) -> Option<Result<T>> {
        if self.failed || self.slot.is_none() {
            return None;
        }
        let r = self.next_element().transpose();
        self.failed = matches!(r, Some(Err(_)));
        r
    }
}

impl<T: Element> Drop for TensorReadStreamAccessor<'_, T> {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            log_warn!("closing a read stream of {:?}: {e}", self.tensor.name());
        }
    }
}

/// The exclusive buffered writer of a tensor's elements, in order. It holds
/// the buffered-writer slot, which no other accessor may share.
///
/// [`write`](Self::write) fills the staging buffer and flushes it to the
/// tensor through `neuron_memcpy` whenever it is full; [`close`](Self::close)
/// (and `Drop`) flush what is left *before* releasing the slot, so no other
/// accessor can open while written data still sits in the buffer.
pub struct TensorWriteStreamAccessor<'a, T: Element> {
    slot: Option<CoherenceSlot<'a>>,
    tensor: &'a Tensor,
    staging: LocalBuffer,
    /// Elements in the tensor.
    len: usize,
    /// Elements accepted so far.
    written: usize,
    /// Elements in the staging buffer, not yet flushed.
    buffered: usize,
    flushes: usize,
    _t: PhantomData<T>,
}

impl<'a, T: Element> TensorWriteStreamAccessor<'a, T> {
    /// Opens the writer.
    pub fn new(tensor: &'a mut Tensor) -> Result<Self> {
        const OP: &str = "write_stream_accessor";
        let tensor: &'a Tensor = tensor;
        check_element::<T>(OP)?;
        staged_kind(tensor, OP)?;
        let slot = tensor.enforcer().slot(AccessorKind::BufferedWriter)?;
        let staging = LocalBuffer::staging_for(tensor, capacity::<T>() * size_of::<T>())?;
        Ok(TensorWriteStreamAccessor {
            slot: Some(slot),
            tensor,
            staging,
            len: tensor.size() / size_of::<T>(),
            written: 0,
            buffered: 0,
            flushes: 0,
            _t: PhantomData,
        })
    }

    /// Appends one element. Fails with [`AccessorError::StreamFull`] past
    /// the tensor's last element. If the flush of a full buffer fails the
    /// value stays buffered and the error is returned; the next write or
    /// `close` tries the flush again.
    pub fn write(&mut self, value: T) -> Result<()> {
        if self.slot.is_none() {
            return Err(AccessorError::Closed.into());
        }
        if self.written == self.len {
            return Err(AccessorError::StreamFull { len: self.len }.into());
        }
        if self.buffered == capacity::<T>() {
            // An earlier flush failed: make room first.
            self.flush()?;
        }
        // SAFETY: `buffered < capacity`, so the element fits in the staging
        // buffer, at an offset aligned for `T` (see the reader).
        unsafe {
            self.staging
                .as_mut_ptr()
                .add(self.buffered * size_of::<T>())
                .cast::<T>()
                .write(value)
        };
        self.buffered += 1;
        self.written += 1;
        if self.buffered == capacity::<T>() {
            self.flush()?;
        }
        Ok(())
    }

    /// Appends every element of `values`, stopping at the first error.
    pub fn write_all(&mut self, values: &[T]) -> Result<()> {
        values.iter().try_for_each(|&v| self.write(v))
    }

    /// Writes the buffered elements to the tensor now.
    pub fn flush(&mut self) -> Result<()> {
        if self.buffered == 0 {
            return Ok(());
        }
        let size = size_of::<T>();
        neuron_memcpy_to_tensor(
            self.tensor,
            (self.written - self.buffered) * size,
            &self.staging,
            0,
            self.buffered * size,
        )?;
        #[cfg(test)]
        order_probe::record(order_probe::Event::Flushed {
            bytes: self.buffered * size,
            writers_open: self.tensor.enforcer().counts().buffered_writers,
        });
        self.buffered = 0;
        self.flushes += 1;
        Ok(())
    }

    /// Flushes what is buffered, then releases the writer slot, and tells
    /// whether the data reached the tensor: the way to end a write stream.
    /// On failure the buffered elements are lost and the slot released (use
    /// [`close`](Self::close) to keep the stream and retry instead).
    /// Dropping a stream without `finish` flushes too, but can only log a
    /// failure.
    ///
    /// ```
    /// use tdrv::accessor::TensorAccessors;
    /// use tdrv::Tensor;
    ///
    /// let mut t = Tensor::allocate_host(8, None)?;
    /// let mut w = t.write_stream_accessor::<u16>()?;
    /// w.write_all(&[1, 2, 3, 4])?;
    /// w.finish()?;
    /// assert_eq!(t.to_vec()?, [1u16, 2, 3, 4].map(u16::to_ne_bytes).concat());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn finish(mut self) -> Result<()> {
        let r = self.close();
        if r.is_err() {
            // Nothing more to flush or log: the caller has the error.
            self.buffered = 0;
            drop(self.slot.take());
        }
        r
    }

    /// Flushes, then releases the writer slot (the seed's `close()`, in
    /// that order). If the flush fails the writer stays open and the error
    /// is returned. Closing again does nothing.
    pub fn close(&mut self) -> Result<()> {
        if self.slot.is_none() {
            return Ok(());
        }
        self.flush()?;
        if let Some(slot) = self.slot.take() {
            slot.release()?;
        }
        #[cfg(test)]
        order_probe::record(order_probe::Event::Released {
            writers_open: self.tensor.enforcer().counts().buffered_writers,
        });
        Ok(())
    }

    /// Elements in the tensor.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the tensor holds no whole element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements written so far (flushed or not).
    pub fn position(&self) -> usize {
        self.written
    }

    /// Elements waiting in the staging buffer.
    pub fn buffered(&self) -> usize {
        self.buffered
    }

    /// Flushes done so far.
    pub fn flushes(&self) -> usize {
        self.flushes
    }

    /// Whether the staging buffer is device memory (DMA-reachable).
    pub fn staging_is_device(&self) -> bool {
        self.staging.is_device()
    }

    /// Whether the slot was opened coherently.
    pub fn admission(&self) -> Option<Admission> {
        self.slot.as_ref().map(CoherenceSlot::admission)
    }
}

impl<T: Element> Drop for TensorWriteStreamAccessor<'_, T> {
    /// Flushes and releases, like [`finish`](TensorWriteStreamAccessor::finish),
    /// but a failure can only be logged: call `finish` to see it.
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            // The data could not be flushed; the slot is released anyway
            // (when `self.slot` drops after this) so the tensor does not
            // stay locked.
            log_warn!(
                "closing a write stream of {:?}: {e}; {} buffered elements are lost",
                self.tensor.name(),
                self.buffered
            );
        }
    }
}

/// Test-only record of the writer's flush and release, per thread, so a
/// test can check their order and the enforcer's state at each.
#[cfg(test)]
pub(crate) mod order_probe {
    use std::cell::RefCell;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Event {
        Flushed { bytes: usize, writers_open: i32 },
        Released { writers_open: i32 },
    }

    thread_local! {
        static EVENTS: RefCell<Vec<Event>> = const { RefCell::new(Vec::new()) };
    }

    pub(crate) fn record(e: Event) {
        EVENTS.with(|v| v.borrow_mut().push(e));
    }

    pub(crate) fn take() -> Vec<Event> {
        EVENTS.with(|v| std::mem::take(&mut *v.borrow_mut()))
    }
}
