// SPDX-License-Identifier: GPL-2.0

//! BAR2 of the tdrv sim device (version 1): a header page, one block per
//! queue with its descriptor and completion rings, and the HBM channels.
//! All fields are little-endian. "sim:" fields are written by the device,
//! "drv:" fields by the driver. The full contract, with a diagram, is
//! `docs/sim-device.md`.
//!
//! The driver maps only the control part of BAR2 (header and queue blocks,
//! below `hbm_offset`) uncached; user mappings of HBM are write-combined
//! (see `mod.rs`).

use kernel::io::register;

/// `magic`: the bytes "TDRVSIM1", little-endian.
pub(crate) const MAGIC: u64 = 0x314D_4953_5652_4454;
/// The layout version this driver speaks.
pub(crate) const VERSION: u32 = 1;
/// Bytes of the header the driver reads before it knows the layout.
pub(crate) const HEADER_SIZE: usize = 0x1000;
/// Most queues a device may have (`inject` has this many entries).
pub(crate) const MAX_QUEUES: u32 = 8;
/// Most HBM channels.
pub(crate) const MAX_CHANNELS: u32 = 16;

register! {
    /// Identifies the device: `MAGIC`.
    pub(crate) HDR_MAGIC(u64) @ 0x00 {
        /// "TDRVSIM1".
        63:0 value;
    }

    /// Layout version (`VERSION`).
    pub(crate) HDR_VERSION(u32) @ 0x08 {
        /// Version number.
        31:0 value;
    }

    /// Number of queues, 1..=8.
    pub(crate) HDR_NUM_QUEUES(u32) @ 0x0c {
        /// Queue count.
        31:0 value;
    }

    /// Entries of each descriptor and completion ring: a power of two,
    /// 16..=512.
    pub(crate) HDR_RING_ENTRIES(u32) @ 0x10 {
        /// Ring size in entries.
        31:0 value;
    }

    /// Number of HBM channels, 1..=16.
    pub(crate) HDR_NUM_CHANNELS(u32) @ 0x14 {
        /// Channel count.
        31:0 value;
    }

    /// Bytes of each channel, a multiple of 2 MiB.
    pub(crate) HDR_CHANNEL_SIZE(u64) @ 0x18 {
        /// Channel size in bytes.
        63:0 value;
    }

    /// BAR2 offset of HBM; channel `c` starts at `hbm_offset + c * channel_size`.
    pub(crate) HDR_HBM_OFFSET(u64) @ 0x20 {
        /// Offset in bytes.
        63:0 value;
    }

    /// BAR2 offset of queue 0's block.
    pub(crate) HDR_QUEUE_OFFSET(u64) @ 0x28 {
        /// Offset in bytes.
        63:0 value;
    }

    /// Bytes between consecutive queue blocks.
    pub(crate) HDR_QUEUE_STRIDE(u64) @ 0x30 {
        /// Stride in bytes.
        63:0 value;
    }

    /// The ivshmem peer id the driver rings (BAR0 doorbell).
    pub(crate) HDR_SIM_PEER_ID(u32) @ 0x38 {
        /// Peer id.
        31:0 value;
    }

    /// Written last by the simulator (release) once the header is valid.
    pub(crate) HDR_READY(u32) @ 0x3c {
        /// 1 when ready.
        0:0 ready;
    }

    /// drv: a fault command for queue `q` (`INJECT_*`); the simulator
    /// takes it with an atomic swap to 0.
    pub(crate) HDR_INJECT(u32)[8] @ 0x100 {
        /// The command.
        31:0 cmd;
    }
}

/// Header word, drv: non-zero stops the device's DMA as a whole (the
/// simulator's model of bus mastering off, which it cannot see in config
/// space): every queue, also a hung one, discards what is pending, moves no
/// more bytes and sets its `DMA_OFF`. 0 lets the queues run again.
pub(crate) const HDR_DMA_STOP: usize = 0x40;

/// `inject[q]`: the next descriptor copies nothing and completes with
/// `CPL_FAULT`.
pub(crate) const INJECT_FAIL_NEXT: u32 = 1;
/// `inject[q]`: the queue stops executing until it is reset.
pub(crate) const INJECT_STALL: u32 = 2;
/// `inject[q]`: the next interrupt is not raised (its completion is).
pub(crate) const INJECT_LOSE_IRQ: u32 = 3;
/// The queue stops and ignores resets until `INJECT_RESUME` (a device
/// that hangs).
pub(crate) const INJECT_HANG: u32 = 4;
/// A hung queue executes what is pending, then answers a pending reset.
pub(crate) const INJECT_RESUME: u32 = 5;
/// Not a fault: before its next descriptor the queue times a host memcpy
/// for the simulator's statistics (`make bench`'s figure 9s baseline).
pub(crate) const INJECT_MEMCPY_PROBE: u32 = 6;

/// Registers of a queue block, at `queue_offset + q * queue_stride`.
pub(crate) mod queue {
    /// drv: free-running count of descriptors posted (slot = idx % entries).
    pub(crate) const SQ_TAIL: usize = 0x00;
    /// sim: free-running count of descriptors consumed.
    pub(crate) const SQ_HEAD: usize = 0x04;
    /// sim: free-running count of completions written.
    pub(crate) const CQ_TAIL: usize = 0x08;
    /// drv: free-running count of completions consumed.
    pub(crate) const CQ_HEAD: usize = 0x0c;
    /// drv: 1 resets the queue; sim: discards pending descriptors (no
    /// completions), clears a stall, zeroes the four indices, then 0.
    pub(crate) const RESET: usize = 0x10;
    /// sim: 0 idle, 1 busy, 2 stalled.
    pub(crate) const STATUS: usize = 0x14;
    /// sim: 1 once the queue saw `HDR_DMA_STOP` set between two
    /// descriptors (it moves no more bytes), 0 once it saw it cleared.
    pub(crate) const DMA_OFF: usize = 0x18;
    /// The descriptor ring: `ring_entries` descriptors of `DESC_SIZE` bytes.
    pub(crate) const DESC_RING: usize = 0x1000;
    /// The completion ring: `ring_entries` records of `CPL_SIZE` bytes.
    pub(crate) const CPL_RING: usize = 0x8000;
    /// `STATUS` of a stalled queue.
    pub(crate) const STATUS_STALLED: u32 = 2;
}

/// A descriptor: `u64 src; u64 dst; u64 id; u32 len; u32 flags;`.
pub(crate) const DESC_SIZE: usize = 32;
/// A completion: `u64 id; u32 status; u32 len_done;`.
pub(crate) const CPL_SIZE: usize = 16;
/// Largest `len` of one descriptor.
pub(crate) const DESC_MAX_LEN: usize = 16 << 20;

/// Descriptor flag: `src` is a device (HBM) address, else guest physical.
pub(crate) const DESC_SRC_DEV: u32 = 1 << 0;
/// Descriptor flag: `dst` is a device (HBM) address, else guest physical.
pub(crate) const DESC_DST_DEV: u32 = 1 << 1;
/// Descriptor flag: raise the queue's MSI-X vector after its completion.
pub(crate) const DESC_IRQ: u32 = 1 << 2;

/// Completion status: copied. The failures (all EIO for the op) are
/// 1 BAD_ADDR (a range outside HBM or guest RAM), 2 BAD_DESC (bad flags or
/// length) and 3 FAULT (injected `INJECT_FAIL_NEXT`).
pub(crate) const CPL_OK: u32 = 0;

/// BAR0 (ivshmem registers): the doorbell; the driver writes
/// `(sim_peer_id << 16) | queue`.
pub(crate) const BAR0_DOORBELL: usize = 0x0c;
/// Size of BAR0 the driver maps.
pub(crate) const BAR0_SIZE: usize = 0x100;
