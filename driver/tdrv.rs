// SPDX-License-Identifier: GPL-2.0

//! tdrv: the kernel half of an ML accelerator runtime's tensor layer.
//!
//! Userspace opens `/dev/tdrv<N>`, allocates DMA-coherent buffers, maps
//! them, moves bytes, and submits asynchronous copy jobs whose completions
//! drive per-buffer fences. The data path, file by file:
//!
//! - `file.rs`: the ioctl and mmap entry points of an open file, with the
//!   argument checks (`uapi.rs` mirrors the ABI header, `range.rs` checks
//!   `offset + size`, `handle.rs` maps the file's handles to buffers);
//! - `buffer.rs`: a DMA-coherent buffer, charged to a channel
//!   (`channel.rs`) and mapped by `mmap.rs`;
//! - `job.rs`: a submitted job, its fence marks and the completion path;
//! - `engine.rs`: the engine that runs jobs (software: CPU copies in a
//!   work item);
//! - `fence.rs`: per-buffer pending-read/write counters and completion
//!   counts, whose wait queues the waiters sleep on;
//! - `device.rs`, `soft.rs`: the device state and the software device;
//!   `stats.rs`: statistics in debugfs.

use kernel::{
    debugfs,
    prelude::*, //
};

mod buffer;
mod channel;
mod device;
mod engine;
mod fence;
mod file;
mod handle;
mod job;
mod mmap;
mod range;
mod soft;
mod stats;
mod uapi;

use device::MAX_DEVICES;
use soft::SoftDevice;

module! {
    type: TdrvModule,
    name: "tdrv",
    authors: ["tdrv developers"],
    description: "tdrv accelerator driver: DMA buffers, copy engine, fences",
    license: "GPL",
    params: {
        soft_devices: u32 {
            default: 1,
            description: "Number of software devices to create (0-4)",
        },
        channels: u32 {
            default: 2,
            description: "HBM channels per device (1-16)",
        },
        channel_mib: u32 {
            default: 64,
            description: "Byte limit of each channel, in MiB (1-4096)",
        },
    },
}

/// Most software devices, leaving device numbers for hardware.
const MAX_SOFT_DEVICES: u32 = 4;

struct TdrvModule {
    soft: KVec<Pin<KBox<SoftDevice>>>,
    // Dropped after the devices, whose entries live inside it.
    _debugfs: debugfs::Dir,
}

/// Reads and range-checks the module parameters.
fn params() -> Result<(u32, u32, u64)> {
    let soft = *module_parameters::soft_devices.value();
    let chans = *module_parameters::channels.value();
    let mib = *module_parameters::channel_mib.value();
    if soft > MAX_SOFT_DEVICES || !(1..=16).contains(&chans) || !(1..=4096).contains(&mib) {
        pr_err!("invalid parameters: soft_devices={soft} channels={chans} channel_mib={mib}\n");
        return Err(EINVAL);
    }
    Ok((soft, chans, u64::from(mib) << 20))
}

impl kernel::Module for TdrvModule {
    fn init(_module: &'static ThisModule) -> Result<Self> {
        const _: () = assert!(MAX_SOFT_DEVICES as usize <= MAX_DEVICES);
        let (soft_count, chans, limit) = params()?;
        let dir = debugfs::Dir::new(c"tdrv");
        let mut soft = KVec::with_capacity(soft_count as usize, GFP_KERNEL)?;
        for _ in 0..soft_count {
            soft.push(KBox::pin_init(SoftDevice::new(chans, limit, &dir), GFP_KERNEL)?, GFP_KERNEL)?;
        }
        pr_info!("loaded: {soft_count} software device(s), {chans} channel(s) of {} MiB\n", limit >> 20);
        Ok(TdrvModule {
            soft,
            _debugfs: dir,
        })
    }
}

impl Drop for TdrvModule {
    fn drop(&mut self) {
        // Tear devices down in reverse order of creation.
        while self.soft.pop().is_some() {}
        pr_info!("unloaded\n");
    }
}
