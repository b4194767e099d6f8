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
//!   work item; edu: DMA chunks advanced by interrupts, see `edu.rs`);
//! - `fence.rs`: per-buffer pending-read/write counters and completion
//!   counts, whose wait queues the waiters sleep on;
//! - `device.rs`, `soft.rs`, `edu.rs` (+ `edu_regs.rs`): the device state,
//!   the software device, and the QEMU edu PCI device whose DMA engine and
//!   MSI interrupt run jobs in hardware; `stats.rs`: statistics in debugfs.

use kernel::{
    driver,
    pci,
    prelude::*,
    InPlaceModule, //
};

mod buffer;
mod channel;
mod device;
mod edu;
mod edu_regs;
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
    description: "tdrv accelerator driver: DMA buffers, copy engines, fences",
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
        edu_dma_bits: u32 {
            default: 28,
            description: "DMA mask width of edu devices (28 = QEMU's default; match -device edu,dma_mask=)",
        },
        edu_timeout_ms: u32 {
            default: 5000,
            description: "Watchdog: time one edu DMA chunk may take before its job fails (10-600000)",
        },
    },
}

/// Most software devices, leaving device numbers for hardware.
const MAX_SOFT_DEVICES: u32 = 4;

/// The module parameters, checked.
pub(crate) struct Params {
    pub(crate) soft_devices: u32,
    pub(crate) channels: u32,
    pub(crate) channel_limit: u64,
    pub(crate) edu_dma_bits: u32,
    pub(crate) edu_timeout_ms: u32,
}

/// Reads and range-checks the module parameters.
pub(crate) fn params() -> Result<Params> {
    let p = Params {
        soft_devices: *module_parameters::soft_devices.value(),
        channels: *module_parameters::channels.value(),
        channel_limit: u64::from(*module_parameters::channel_mib.value()) << 20,
        edu_dma_bits: *module_parameters::edu_dma_bits.value(),
        edu_timeout_ms: *module_parameters::edu_timeout_ms.value(),
    };
    if p.soft_devices > MAX_SOFT_DEVICES
        || !(1..=16).contains(&p.channels)
        || !((1 << 20)..=(4096 << 20)).contains(&p.channel_limit)
        || !(24..=64).contains(&p.edu_dma_bits)
        || !(10..=600_000).contains(&p.edu_timeout_ms)
    {
        pr_err!("invalid module parameters\n");
        return Err(EINVAL);
    }
    Ok(p)
}

#[pin_data(PinnedDrop)]
struct TdrvModule {
    // Dropped first: unbinds (and so stops) every edu device.
    #[pin]
    _pci: driver::Registration<pci::Adapter<edu::EduDriver>>,
    soft: KVec<Pin<KBox<SoftDevice>>>,
    // Dropped last: the devices' debugfs entries live inside it.
    _debugfs: stats::RootGuard,
}

impl InPlaceModule for TdrvModule {
    fn init(module: &'static ThisModule) -> impl PinInit<Self, Error> {
        const _: () = assert!(MAX_SOFT_DEVICES as usize <= MAX_DEVICES);
        pin_init::pin_init_scope(move || {
            let p = params()?;
            stats::init_root();
            let root = stats::RootGuard;
            let mut soft = KVec::with_capacity(p.soft_devices as usize, GFP_KERNEL)?;
            for _ in 0..p.soft_devices {
                soft.push(
                    KBox::pin_init(SoftDevice::new(p.channels, p.channel_limit), GFP_KERNEL)?,
                    GFP_KERNEL,
                )?;
            }
            pr_info!(
                "loaded: {} software device(s), {} channel(s) of {} MiB each\n",
                p.soft_devices,
                p.channels,
                p.channel_limit >> 20
            );
            Ok(try_pin_init!(TdrvModule {
                _pci <- driver::Registration::new(c"tdrv", module),
                soft,
                _debugfs: root,
            }))
        })
    }
}

#[pinned_drop]
impl PinnedDrop for TdrvModule {
    fn drop(self: Pin<&mut Self>) {
        pr_info!("unloading\n");
    }
}
