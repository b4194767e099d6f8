//! BAR2 layout of the sim device, version 1 (docs/sim-device.md): the
//! header page, the queue blocks and the HBM channels, with the limits the
//! header fields obey.

use std::fmt;

/// `magic` at 0x00: the bytes "TDRVSIM1" read as a little-endian u64.
pub const MAGIC: u64 = 0x314D_4953_5652_4454;
/// `version` at 0x08.
pub const VERSION: u32 = 1;

/// Header field offsets.
pub mod hdr {
    /// u64 magic.
    pub const MAGIC: usize = 0x00;
    /// u32 version.
    pub const VERSION: usize = 0x08;
    /// u32 number of queues.
    pub const NUM_QUEUES: usize = 0x0C;
    /// u32 entries per ring.
    pub const RING_ENTRIES: usize = 0x10;
    /// u32 number of HBM channels.
    pub const NUM_CHANNELS: usize = 0x14;
    /// u64 bytes per channel.
    pub const CHANNEL_SIZE: usize = 0x18;
    /// u64 BAR2 offset of HBM.
    pub const HBM_OFFSET: usize = 0x20;
    /// u64 BAR2 offset of queue 0's block.
    pub const QUEUE_OFFSET: usize = 0x28;
    /// u64 bytes between queue blocks.
    pub const QUEUE_STRIDE: usize = 0x30;
    /// u32 ivshmem peer id of the simulator (the doorbell's destination).
    pub const SIM_PEER_ID: usize = 0x38;
    /// u32 1 once the header is valid, written last.
    pub const READY: usize = 0x3C;
    /// u32 drv: non-zero stops the device's DMA as a whole (the driver's
    /// bus mastering off): each queue discards what is pending, moves no
    /// more bytes and says so in its `DMA_OFF`, whatever state it is in
    /// (also hung). 0 lets the queues run again.
    pub const DMA_STOP: usize = 0x40;
    /// u32 inject[q] at INJECT + 4 * q.
    pub const INJECT: usize = 0x100;
}

/// Queue block field offsets (relative to the block).
pub mod qb {
    /// u32 drv: descriptors posted (free-running).
    pub const SQ_TAIL: usize = 0x00;
    /// u32 sim: descriptors consumed (free-running).
    pub const SQ_HEAD: usize = 0x04;
    /// u32 sim: completions written (free-running).
    pub const CQ_TAIL: usize = 0x08;
    /// u32 drv: completions consumed (free-running).
    pub const CQ_HEAD: usize = 0x0C;
    /// u32 drv writes 1, sim writes 0 when the reset is done.
    pub const RESET: usize = 0x10;
    /// u32 sim: 0 idle, 1 busy, 2 stalled.
    pub const STATUS: usize = 0x14;
    /// u32 sim: 1 once the queue saw the header's `DMA_STOP` between two
    /// descriptors (nothing of it moves bytes from then on), 0 once it
    /// saw it cleared.
    pub const DMA_OFF: usize = 0x18;
    /// The descriptor ring.
    pub const DESC: usize = 0x1000;
    /// The completion ring.
    pub const CPL: usize = 0x8000;
}

/// Descriptor size in bytes: `u64 src; u64 dst; u64 id; u32 len; u32 flags`.
pub const DESC_SIZE: usize = 32;
/// Completion size in bytes: `u64 id; u32 status; u32 len_done`.
pub const CPL_SIZE: usize = 16;

/// Descriptor flag: src is a device (HBM) address.
pub const FLAG_SRC_DEV: u32 = 1 << 0;
/// Descriptor flag: dst is a device (HBM) address.
pub const FLAG_DST_DEV: u32 = 1 << 1;
/// Descriptor flag: raise the queue's vector after this completion.
pub const FLAG_IRQ: u32 = 1 << 2;
/// Every defined flag; other bits make a descriptor BAD_DESC.
pub const FLAGS_ALL: u32 = FLAG_SRC_DEV | FLAG_DST_DEV | FLAG_IRQ;
/// Largest `len` of one descriptor.
pub const MAX_LEN: u32 = 16 << 20;

/// Queue `status` values.
pub mod qstatus {
    /// Nothing pending.
    pub const IDLE: u32 = 0;
    /// Executing descriptors.
    pub const BUSY: u32 = 1;
    /// Stopped by an injected STALL (or a broken sq_tail) until reset.
    pub const STALLED: u32 = 2;
}

/// Fault commands written to `inject[q]`.
pub mod inject {
    /// The next descriptor completes with FAULT and copies nothing.
    pub const FAIL_NEXT: u32 = 1;
    /// The queue stops executing until reset.
    pub const STALL: u32 = 2;
    /// The next interrupt is not raised.
    pub const LOSE_IRQ: u32 = 3;
    /// The queue stops executing and does not answer a reset until
    /// RESUME: a device that hangs and ignores the driver.
    pub const HANG: u32 = 4;
    /// A hung queue wakes up: it executes the descriptors still pending
    /// (the late writes of a device that was only slow), then answers a
    /// reset requested meanwhile. Ignored unless the queue hangs.
    pub const RESUME: u32 = 5;
    /// Not a fault: before its next descriptor the queue times a host
    /// memcpy of [`PROBE_BYTES`](crate::probe::PROBE_BYTES) and keeps the
    /// result for its exit statistics (`make bench`'s figure 9s baseline,
    /// see [`crate::probe`]).
    pub const MEMCPY_PROBE: u32 = 6;
}

/// Completion status of a descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    /// Copied `len` bytes.
    Ok = 0,
    /// A range outside HBM or guest RAM.
    BadAddr = 1,
    /// Undefined flags, or len 0 or above 16 MiB.
    BadDesc = 2,
    /// An injected FAIL_NEXT.
    Fault = 3,
}

/// Defaults of the simulator's options.
pub mod defaults {
    /// Queues (and MSI-X vectors).
    pub const QUEUES: u32 = 4;
    /// Entries per ring.
    pub const RING_ENTRIES: u32 = 256;
    /// HBM channels.
    pub const CHANNELS: u32 = 2;
    /// Bytes per channel.
    pub const CHANNEL_SIZE: u64 = 64 << 20;
    /// BAR2 offset of HBM.
    pub const HBM_OFFSET: u64 = 0x10_0000;
    /// BAR2 offset of queue 0's block.
    pub const QUEUE_OFFSET: u64 = 0x1_0000;
    /// Bytes between queue blocks.
    pub const QUEUE_STRIDE: u64 = 0x1_0000;
}

/// Largest BAR2 the simulator makes (a 64-bit BAR; the memfd is sparse).
pub const MAX_BAR_SIZE: u64 = 64 << 30;

/// The device's shape: what the header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// 1..=8.
    pub queues: u32,
    /// Power of two, 16..=512.
    pub ring_entries: u32,
    /// 1..=16.
    pub channels: u32,
    /// Multiple of 2 MiB, non-zero.
    pub channel_size: u64,
    /// The ivshmem peer id the driver rings.
    pub sim_peer_id: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            queues: defaults::QUEUES,
            ring_entries: defaults::RING_ENTRIES,
            channels: defaults::CHANNELS,
            channel_size: defaults::CHANNEL_SIZE,
            sim_peer_id: 1,
        }
    }
}

/// Why a [`Config`] is refused.
#[derive(Debug, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Checks the limits of the contract and computes the layout.
    pub fn layout(&self) -> Result<Layout, ConfigError> {
        let err = |s: String| Err(ConfigError(s));
        if !(1..=8).contains(&self.queues) {
            return err(format!("queues must be 1..=8, not {}", self.queues));
        }
        if !(16..=512).contains(&self.ring_entries) || !self.ring_entries.is_power_of_two() {
            return err(format!(
                "ring entries must be a power of two in 16..=512, not {}",
                self.ring_entries
            ));
        }
        if !(1..=16).contains(&self.channels) {
            return err(format!("channels must be 1..=16, not {}", self.channels));
        }
        if self.channel_size == 0 || self.channel_size % (2 << 20) != 0 {
            return err(format!(
                "channel size must be a non-zero multiple of 2 MiB, not {}",
                self.channel_size
            ));
        }
        if self.sim_peer_id > u32::from(u16::MAX) {
            return err(format!(
                "peer id must fit 16 bits, not {}",
                self.sim_peer_id
            ));
        }
        let hbm_size = u64::from(self.channels)
            .checked_mul(self.channel_size)
            .filter(|&s| s <= MAX_BAR_SIZE)
            .ok_or_else(|| ConfigError("HBM larger than 64 GiB".into()))?;
        let bar_size = (defaults::HBM_OFFSET + hbm_size).next_power_of_two();
        if bar_size > MAX_BAR_SIZE {
            return err("BAR2 larger than 64 GiB".into());
        }
        Ok(Layout {
            config: *self,
            hbm_offset: defaults::HBM_OFFSET,
            hbm_size,
            queue_offset: defaults::QUEUE_OFFSET,
            queue_stride: defaults::QUEUE_STRIDE,
            bar_size,
        })
    }
}

/// Where everything lies in BAR2 for a valid [`Config`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The configuration it was computed from.
    pub config: Config,
    /// BAR2 offset of HBM.
    pub hbm_offset: u64,
    /// channels * channel_size.
    pub hbm_size: u64,
    /// BAR2 offset of queue 0's block.
    pub queue_offset: u64,
    /// Bytes between queue blocks.
    pub queue_stride: u64,
    /// Size of BAR2 (the shared memory): a power of two.
    pub bar_size: u64,
}

impl Layout {
    /// BAR2 offset of queue `q`'s block.
    pub fn queue_block(&self, q: u32) -> usize {
        (self.queue_offset + u64::from(q) * self.queue_stride) as usize
    }

    /// BAR2 offset of `inject[q]`.
    pub fn inject(&self, q: u32) -> usize {
        hdr::INJECT + 4 * q as usize
    }

    /// BAR2 offset of descriptor slot `idx % ring_entries` of queue `q`.
    pub fn desc(&self, q: u32, idx: u32) -> usize {
        self.queue_block(q) + qb::DESC + (idx % self.config.ring_entries) as usize * DESC_SIZE
    }

    /// BAR2 offset of completion slot `idx % ring_entries` of queue `q`.
    pub fn cpl(&self, q: u32, idx: u32) -> usize {
        self.queue_block(q) + qb::CPL + (idx % self.config.ring_entries) as usize * CPL_SIZE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_layout_matches_the_contract() {
        let l = Config::default().layout().unwrap();
        assert_eq!(l.bar_size, 256 << 20);
        assert_eq!(l.hbm_offset, 0x10_0000);
        assert_eq!(l.queue_block(0), 0x1_0000);
        assert_eq!(l.queue_block(3), 0x4_0000);
        assert_eq!(l.desc(1, 257), 0x2_0000 + 0x1000 + 32);
        assert_eq!(l.cpl(1, 255), 0x2_0000 + 0x8000 + 255 * 16);
        assert_eq!(&MAGIC.to_le_bytes(), b"TDRVSIM1");
    }

    #[test]
    fn rings_and_queues_fit_their_blocks() {
        let c = Config {
            queues: 8,
            ring_entries: 512,
            ..Config::default()
        };
        let l = c.layout().unwrap();
        // Descriptor ring ends before the completion ring, which ends
        // before the next block; the last block ends before HBM.
        const { assert!(qb::DESC + 512 * DESC_SIZE <= qb::CPL) };
        assert!(qb::CPL + 512 * CPL_SIZE <= l.queue_stride as usize);
        assert!(l.queue_block(7) as u64 + l.queue_stride <= l.hbm_offset);
        assert!(l.inject(7) + 4 <= 0x1000);
    }

    #[test]
    fn limits_are_enforced() {
        let bad = [
            Config {
                queues: 0,
                ..Config::default()
            },
            Config {
                queues: 9,
                ..Config::default()
            },
            Config {
                ring_entries: 8,
                ..Config::default()
            },
            Config {
                ring_entries: 100,
                ..Config::default()
            },
            Config {
                ring_entries: 1024,
                ..Config::default()
            },
            Config {
                channels: 17,
                ..Config::default()
            },
            Config {
                channel_size: 3 << 20,
                ..Config::default()
            },
            Config {
                channel_size: 0,
                ..Config::default()
            },
            Config {
                channels: 16,
                channel_size: 8 << 30,
                ..Config::default()
            },
        ];
        for c in bad {
            assert!(c.layout().is_err(), "{c:?} accepted");
        }
        let l = Config {
            channels: 3,
            channel_size: 2 << 20,
            ..Config::default()
        }
        .layout()
        .unwrap();
        assert_eq!(l.bar_size, 8 << 20);
    }
}
