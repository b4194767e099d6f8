// SPDX-License-Identifier: GPL-2.0

//! Per-channel (HBM index) memory accounting of one device.
//!
//! Each channel has a byte limit. Usage, peak and refused allocations are
//! kept so that an allocation failure can be explained (TDRV_IOC_CHANNEL_INFO
//! and debugfs), which the original runtime's "Failed to allocate" could not.

use kernel::{
    new_mutex,
    prelude::*,
    sync::Mutex, //
};

/// Accounting of one channel.
#[derive(Clone, Copy, Default)]
pub(crate) struct ChannelStats {
    pub(crate) limit: u64,
    pub(crate) used: u64,
    pub(crate) peak: u64,
    pub(crate) buffers: u64,
    pub(crate) failed: u64,
}

/// The channels of one device.
#[pin_data]
pub(crate) struct Channels {
    #[pin]
    stats: Mutex<KVec<ChannelStats>>,
    count: u32,
}

impl Channels {
    /// `count` channels of `limit` bytes each.
    pub(crate) fn new(count: u32, limit: u64) -> Result<impl PinInit<Self, Error>> {
        let mut stats = KVec::with_capacity(count as usize, GFP_KERNEL)?;
        for _ in 0..count {
            stats.push(
                ChannelStats {
                    limit,
                    ..Default::default()
                },
                GFP_KERNEL,
            )?;
        }
        Ok(try_pin_init!(Self {
            stats <- new_mutex!(stats, "Channels::stats"),
            count,
        }))
    }

    pub(crate) fn count(&self) -> u32 {
        self.count
    }

    /// Charges `size` bytes to `channel`: EINVAL for a channel that does not
    /// exist, ENOSPC if the limit would be passed.
    pub(crate) fn reserve(&self, channel: u32, size: u64) -> Result {
        let mut stats = self.stats.lock();
        let ch = stats.get_mut(channel as usize).ok_or(EINVAL)?;
        match ch.used.checked_add(size) {
            Some(used) if used <= ch.limit => {
                ch.used = used;
                ch.peak = ch.peak.max(used);
                ch.buffers += 1;
                Ok(())
            }
            _ => {
                ch.failed += 1;
                Err(ENOSPC)
            }
        }
    }

    /// Undoes a [`Channels::reserve`].
    pub(crate) fn release(&self, channel: u32, size: u64) {
        let mut stats = self.stats.lock();
        if let Some(ch) = stats.get_mut(channel as usize) {
            ch.used = ch.used.saturating_sub(size);
            ch.buffers = ch.buffers.saturating_sub(1);
        }
    }

    /// Counts an allocation that passed accounting but failed for lack of
    /// memory, so that it shows up as a refused allocation too.
    pub(crate) fn note_failure(&self, channel: u32) {
        if let Some(ch) = self.stats.lock().get_mut(channel as usize) {
            ch.failed += 1;
        }
    }

    pub(crate) fn stats(&self, channel: u32) -> Result<ChannelStats> {
        self.stats
            .lock()
            .get(channel as usize)
            .copied()
            .ok_or(EINVAL)
    }
}

#[kunit_tests(tdrv_channel)]
mod tests {
    use super::*;

    #[test]
    fn limit_and_peak() -> Result {
        let ch = KBox::pin_init(Channels::new(2, 100)?, GFP_KERNEL)?;
        ch.reserve(0, 60)?;
        assert_eq!(ch.reserve(0, 41), Err(ENOSPC));
        ch.reserve(1, 100)?;
        assert_eq!(ch.reserve(2, 1), Err(EINVAL));
        assert_eq!(ch.reserve(0, u64::MAX), Err(ENOSPC));
        ch.release(0, 60);
        let s = ch.stats(0)?;
        assert_eq!((s.used, s.peak, s.buffers, s.failed), (0, 60, 0, 2));
        assert_eq!(ch.stats(1)?.used, 100);
        Ok(())
    }
}
