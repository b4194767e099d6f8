// SPDX-License-Identifier: GPL-2.0

//! HBM: the device memory of the sim device, one range allocator per
//! channel.
//!
//! Each channel is a contiguous range of device addresses. A buffer gets
//! one contiguous, page-aligned range, so that its device address covers it
//! all (`dma_addr` in BUF_INFO) and mmap maps it page by page. The
//! allocator keeps the free ranges sorted by address; an allocation takes
//! the smallest free range that fits (best fit, lowest address on a tie,
//! which keeps large holes for large buffers), and a freed range merges
//! with its free neighbours, so that freeing everything always gives back
//! one range. Fragmentation can still refuse an allocation that the
//! channel's byte accounting would allow: that is ENOMEM.
//!
//! The first page of channel 0 is never given out: device address 0 would
//! read as "no address" in the ABI (`dma_addr` is 0 for callers without
//! CAP_SYS_RAWIO). So every channel offers its size less one page (the
//! channel limit in `mod.rs`), the same for all channels.
//!
//! New buffers must not show what earlier ones left, and zeroing a range
//! is a device round trip (milliseconds on the simulator). So the probe
//! zeroes each channel once, and each allocator remembers from where up
//! nothing has been given out since: `clean_from`. Best fit takes that top
//! range last, so a range is zeroed when it is handed out again, and a
//! device that keeps many live buffers zeroes none of them twice.

use kernel::{
    new_mutex,
    page::PAGE_SIZE,
    prelude::*,
    sync::{
        Arc,
        Mutex, //
    }, //
};

/// A free range `[start, start + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Free {
    start: u64,
    len: u64,
}

/// Best-fit allocator of one channel's address range, in units of
/// `granule` bytes.
///
/// # Invariants
///
/// `free` is sorted by `start`, its ranges are non-empty, disjoint and not
/// adjacent (adjacent ranges are merged), and its capacity exceeds the
/// number of allocated ranges, so that [`RangeAlloc::free`] never needs
/// memory.
pub(crate) struct RangeAlloc {
    size: u64,
    granule: u64,
    free: KVec<Free>,
    allocated: usize,
    /// `[clean_from, size)` reads as zero and none of it was given out
    /// since it was zeroed (`size`: nothing is known to be zero).
    clean_from: u64,
}

impl RangeAlloc {
    /// An allocator of `[0, size)`, all free; `granule` is a power of two.
    pub(crate) fn new(size: u64, granule: u64) -> Result<Self> {
        if !granule.is_power_of_two() || size % granule != 0 {
            return Err(EINVAL);
        }
        let mut free = KVec::with_capacity(2, GFP_KERNEL)?;
        if size > 0 {
            free.push(Free { start: 0, len: size }, GFP_KERNEL)?;
        }
        Ok(Self {
            size,
            granule,
            free,
            allocated: 0,
            clean_from: size,
        })
    }

    /// Allocates `len` bytes (rounded up to the granule): the start of the
    /// range. EINVAL for 0 bytes, ENOMEM if no free range is large enough.
    pub(crate) fn alloc(&mut self, len: u64) -> Result<u64> {
        self.alloc_dirty(len).map(|(start, _)| start)
    }

    /// Like [`RangeAlloc::alloc`], and also how many bytes from the start
    /// of the range may hold an earlier buffer's data (the rest reads as
    /// zero).
    pub(crate) fn alloc_dirty(&mut self, len: u64) -> Result<(u64, u64)> {
        if len == 0 || len > self.size {
            return if len == 0 { Err(EINVAL) } else { Err(ENOMEM) };
        }
        let len = len.next_multiple_of(self.granule);
        let best = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, f)| f.len >= len)
            .min_by_key(|(_, f)| f.len)
            .map(|(i, _)| i)
            .ok_or(ENOMEM)?;
        // Keep room for one more free range per allocated one (see the
        // invariant) before changing anything.
        let want = (self.allocated + 2).saturating_sub(self.free.len());
        self.free.reserve(want, GFP_KERNEL)?;
        let f = &mut self.free[best];
        let start = f.start;
        f.start += len;
        f.len -= len;
        if f.len == 0 {
            let _ = self.free.remove(best);
        }
        self.allocated += 1;
        // `[clean_from, size)` is inside one free range (nothing there was
        // given out), so a range starting at or above `clean_from` lies
        // wholly in it; one starting below is dirty up to `clean_from`.
        let dirty = self.clean_from.saturating_sub(start).min(len);
        self.clean_from = self.clean_from.max(start + len);
        Ok((start, dirty))
    }

    /// Records that `[from, size)` was zeroed, if all of it is free (then
    /// nothing was given out while it was being zeroed). Returns whether it
    /// was recorded.
    pub(crate) fn mark_zeroed(&mut self, from: u64) -> bool {
        let top_free = self
            .free
            .last()
            .is_some_and(|f| f.start <= from && f.start + f.len == self.size);
        if top_free {
            self.clean_from = self.clean_from.min(from);
        }
        top_free
    }

    /// The capacity of the free list [`RangeAlloc::alloc`] needs, if it
    /// has less (then `alloc` would allocate).
    pub(crate) fn capacity_for_alloc(&self) -> Option<usize> {
        let need = (self.allocated + 2).max(self.free.len());
        (self.free.capacity() < need).then_some(need)
    }

    /// Moves the free list into `spare` if that has more room; returns the
    /// vector to free (by the caller, outside its lock).
    pub(crate) fn adopt(&mut self, mut spare: KVec<Free>) -> KVec<Free> {
        if spare.capacity() < self.free.len() || spare.capacity() <= self.free.capacity() {
            return spare;
        }
        for f in self.free.iter() {
            let _ = spare.push_within_capacity(*f);
        }
        core::mem::replace(&mut self.free, spare)
    }

    /// Gives back a range returned by [`RangeAlloc::alloc`] for `len`
    /// bytes. Never allocates.
    pub(crate) fn free(&mut self, start: u64, len: u64) {
        let len = len.next_multiple_of(self.granule);
        // The first free range after the freed one.
        let i = self.free.iter().position(|f| f.start > start).unwrap_or(self.free.len());
        let merge_prev = i > 0 && {
            let p = self.free[i - 1];
            p.start + p.len == start
        };
        let merge_next = i < self.free.len() && start + len == self.free[i].start;
        match (merge_prev, merge_next) {
            (true, true) => {
                let next = self.free[i];
                self.free[i - 1].len += len + next.len;
                let _ = self.free.remove(i);
            }
            (true, false) => self.free[i - 1].len += len,
            (false, true) => {
                self.free[i].start = start;
                self.free[i].len += len;
            }
            (false, false) => {
                // Within capacity by the invariant.
                let _ = self.free.insert_within_capacity(i, Free { start, len });
            }
        }
        self.allocated = self.allocated.saturating_sub(1);
    }

    /// Free bytes in all.
    pub(crate) fn free_bytes(&self) -> u64 {
        self.free.iter().map(|f| f.len).sum()
    }

    /// The largest allocation that would succeed now.
    pub(crate) fn largest_free(&self) -> u64 {
        self.free.iter().map(|f| f.len).max().unwrap_or(0)
    }

    /// Number of free ranges (1 when nothing is allocated).
    pub(crate) fn free_ranges(&self) -> usize {
        self.free.len()
    }
}

/// The HBM of one device: a range allocator per channel.
#[pin_data]
pub(crate) struct Hbm {
    #[pin]
    channels: Mutex<KVec<RangeAlloc>>,
    channel_size: u64,
}

impl Hbm {
    pub(crate) fn new(count: u32, channel_size: u64) -> Result<Arc<Self>> {
        let mut channels = KVec::with_capacity(count as usize, GFP_KERNEL)?;
        for c in 0..count {
            let mut a = RangeAlloc::new(channel_size, PAGE_SIZE as u64)?;
            if c == 0 {
                // Device address 0 stays unused (see the module docs); the
                // first allocation of an empty range is at its start.
                a.alloc(PAGE_SIZE as u64)?;
            }
            channels.push(a, GFP_KERNEL)?;
        }
        Arc::pin_init(
            pin_init!(Self {
                channels <- new_mutex!(channels, "Hbm::channels"),
                channel_size,
            }),
            GFP_KERNEL,
        )
    }

    /// Allocates `len` bytes on `channel`: the range, freed when dropped.
    pub(crate) fn alloc(self: &Arc<Self>, channel: u32, len: u64) -> Result<HbmRange> {
        let (start, dirty) = loop {
            let want = {
                let mut channels = self.channels.lock();
                let a = channels.get_mut(channel as usize).ok_or(EINVAL)?;
                match a.capacity_for_alloc() {
                    // Room enough: `alloc` allocates nothing.
                    None => break a.alloc_dirty(len)?,
                    Some(want) => want,
                }
            };
            // The free list grows outside the lock: freeing a buffer takes
            // it, also on the completion path, which must not wait for an
            // allocation (dma-fence signalling rules).
            let spare = KVec::with_capacity(want, GFP_KERNEL)?;
            let old = {
                let mut channels = self.channels.lock();
                channels.get_mut(channel as usize).ok_or(EINVAL)?.adopt(spare)
            };
            drop(old);
        };
        Ok(HbmRange {
            hbm: self.clone(),
            channel,
            start,
            len,
            dirty,
        })
    }

    /// Where channel `channel`'s allocatable memory starts (device address
    /// 0 is never given out) and its length: what the probe zeroes.
    pub(crate) fn channel_span(&self, channel: u32) -> (u64, u64) {
        let skip = if channel == 0 { PAGE_SIZE as u64 } else { 0 };
        (
            u64::from(channel) * self.channel_size + skip,
            self.channel_size - skip,
        )
    }

    /// Records that the span [`Hbm::channel_span`] of `channel` was zeroed
    /// while nothing was allocated there; see [`RangeAlloc::mark_zeroed`].
    pub(crate) fn mark_zeroed(&self, channel: u32) -> bool {
        let (addr, _) = self.channel_span(channel);
        let from = addr - u64::from(channel) * self.channel_size;
        self.channels
            .lock()
            .get_mut(channel as usize)
            .is_some_and(|a| a.mark_zeroed(from))
    }

    /// Number of channels.
    pub(crate) fn channels(&self) -> u32 {
        self.channels.lock().len() as u32
    }

    /// `(free bytes, largest free range, free ranges)` of `channel`, for
    /// debugfs.
    pub(crate) fn usage(&self, channel: u32) -> (u64, u64, usize) {
        self.channels
            .lock()
            .get(channel as usize)
            .map_or((0, 0, 0), |a| (a.free_bytes(), a.largest_free(), a.free_ranges()))
    }
}

/// An allocated range of HBM, given back on drop.
pub(crate) struct HbmRange {
    hbm: Arc<Hbm>,
    channel: u32,
    /// Offset in the channel.
    start: u64,
    len: u64,
    /// Bytes from `start` that may hold an earlier buffer's data.
    dirty: u64,
}

impl HbmRange {
    /// The device address of byte 0 (offset in HBM).
    pub(crate) fn dev_addr(&self) -> u64 {
        u64::from(self.channel) * self.hbm.channel_size + self.start
    }

    /// How many bytes from the start may hold an earlier buffer's data:
    /// what a new buffer must zero.
    pub(crate) fn dirty_len(&self) -> u64 {
        self.dirty
    }
}

impl Drop for HbmRange {
    fn drop(&mut self) {
        if let Some(a) = self.hbm.channels.lock().get_mut(self.channel as usize) {
            a.free(self.start, self.len);
        }
    }
}

#[kunit_tests(tdrv_sim_hbm)]
mod tests {
    use super::*;

    const P: u64 = 4096;

    #[test]
    fn exhaustion() -> Result {
        let mut a = RangeAlloc::new(16 * P, P)?;
        assert_eq!(a.alloc(0), Err(EINVAL));
        assert_eq!(a.alloc(17 * P), Err(ENOMEM));
        let x = a.alloc(10 * P)?;
        let y = a.alloc(6 * P)?;
        assert_eq!((x, y), (0, 10 * P));
        assert_eq!(a.alloc(1), Err(ENOMEM));
        assert_eq!(a.free_bytes(), 0);
        a.free(x, 10 * P);
        // A partial page is rounded up to the granule.
        let z = a.alloc(1)?;
        assert_eq!(z, 0);
        assert_eq!(a.free_bytes(), 9 * P);
        Ok(())
    }

    #[test]
    fn coalescing() -> Result {
        let mut a = RangeAlloc::new(8 * P, P)?;
        let r: [u64; 4] = [a.alloc(2 * P)?, a.alloc(2 * P)?, a.alloc(2 * P)?, a.alloc(2 * P)?];
        // Free the 2nd and 4th: two holes; then the 3rd joins them.
        a.free(r[1], 2 * P);
        a.free(r[3], 2 * P);
        assert_eq!(a.free_ranges(), 2);
        a.free(r[2], 2 * P);
        assert_eq!(a.free_ranges(), 1);
        assert_eq!(a.largest_free(), 6 * P);
        a.free(r[0], 2 * P);
        assert_eq!(a.free_ranges(), 1);
        assert_eq!(a.largest_free(), 8 * P);
        assert_eq!(a.alloc(8 * P)?, 0);
        Ok(())
    }

    #[test]
    fn fragmentation() -> Result {
        let mut a = RangeAlloc::new(8 * P, P)?;
        let mut r = [0u64; 8];
        for x in r.iter_mut() {
            *x = a.alloc(P)?;
        }
        // Every other page free: 4 pages free, but no 2 contiguous.
        for x in r.iter().step_by(2) {
            a.free(*x, P);
        }
        assert_eq!(a.free_bytes(), 4 * P);
        assert_eq!(a.alloc(2 * P), Err(ENOMEM));
        // Best fit: a one-page request takes a one-page hole.
        assert_eq!(a.alloc(P)?, 0);
        a.free(0, P);
        a.free(r[1], P);
        // Pages 0..3 are free now: a 3-page request fits there.
        assert_eq!(a.alloc(3 * P)?, 0);
        Ok(())
    }

    #[test]
    fn best_fit_keeps_large_holes() -> Result {
        let mut a = RangeAlloc::new(16 * P, P)?;
        let x = a.alloc(4 * P)?;
        let _y = a.alloc(P)?;
        let z = a.alloc(2 * P)?;
        let _w = a.alloc(P)?;
        a.free(x, 4 * P);
        a.free(z, 2 * P);
        // Holes of 4, 2 and 8 pages: 2 pages go to the 2-page hole.
        assert_eq!(a.alloc(2 * P)?, z);
        assert_eq!(a.largest_free(), 8 * P);
        Ok(())
    }

    #[test]
    fn only_memory_given_out_before_is_dirty() -> Result {
        let mut a = RangeAlloc::new(16 * P, P)?;
        // Nothing is known to be zero before the probe zeroed it.
        assert_eq!(a.alloc_dirty(2 * P)?, (0, 2 * P));
        a.free(0, 2 * P);
        assert!(a.mark_zeroed(0));
        assert_eq!(a.alloc_dirty(2 * P)?, (0, 0));
        assert_eq!(a.alloc_dirty(P)?, (2 * P, 0));
        // Given out and freed: dirty when it is given out again; a range
        // reaching past it into never-used memory is dirty only up to
        // there.
        a.free(0, 2 * P);
        assert_eq!(a.alloc_dirty(P)?, (0, P));
        a.free(2 * P, P);
        assert_eq!(a.alloc_dirty(4 * P)?, (P, 2 * P));
        assert_eq!(a.alloc_dirty(11 * P)?, (5 * P, 0));
        // Zeroing is recorded only where everything is free.
        assert!(!a.mark_zeroed(0));
        Ok(())
    }

    #[test]
    fn hbm_ranges_free_on_drop() -> Result {
        let hbm = Hbm::new(2, 16 * P)?;
        let a = hbm.alloc(1, 3 * P)?;
        assert_eq!(a.dev_addr(), 16 * P);
        assert_eq!(hbm.alloc(2, P).err(), Some(EINVAL));
        // Device address 0 is never given out.
        let z = hbm.alloc(0, P)?;
        assert_eq!(z.dev_addr(), P);
        assert_eq!(hbm.usage(0), (14 * P, 14 * P, 1));
        drop(z);
        assert_eq!(hbm.usage(1), (13 * P, 13 * P, 1));
        drop(a);
        assert_eq!(hbm.usage(1), (16 * P, 16 * P, 1));
        Ok(())
    }
}
