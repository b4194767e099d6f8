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
//! - `charge.rs`: what an open file is charged for its buffers (also
//!   after FREE, while dma-bufs exported from the handle live);
//! - `buffer.rs`: a DMA-coherent buffer, charged to a channel
//!   (`channel.rs`) and mapped by `mmap.rs`;
//! - `job.rs`: a submitted job, its fence marks and the completion path;
//! - `engine.rs`: the [`engine::Engine`] seam every backend implements;
//! - `fence.rs`: per-buffer pending-read/write counters and completion
//!   counts, whose wait queues the waiters sleep on;
//! - `device.rs`: the device state and unbind sequence;
//! - `backends/`: the devices, each with its engine: `soft.rs` (CPU copies
//!   in a work item) and `edu.rs` (QEMU edu's DMA engine, advanced by its
//!   MSI completion interrupt) and `sim/` (the tdrv sim device: HBM
//!   behind a BAR, several DMA queues with descriptor rings and MSI-X);
//! - `dmabuf.rs` (with `dmabuf.c`): dma-buf export and import;
//! - `node.rs`: the `/dev/tdrv<N>` misc device and why it pins the module;
//!   `stats.rs`: statistics in debugfs; `glue.c`/`glue.rs`: the few C
//!   helpers 7.2's Rust bindings lack;
//! - `fence_fd.rs` (with `fence_fd.c`): jobs' out-fences and in-fences as
//!   `sync_file` fds, and why they are safe after `rmmod`;
//! - `event.rs`: completion events read from the file itself (JOB_NOTIFY,
//!   `read(2)`, `poll(2)`), on every kernel.

use kernel::{
    driver,
    pci,
    prelude::*,
    InPlaceModule, //
};

mod backends;
mod buffer;
mod channel;
mod charge;
mod device;
mod dmabuf;
mod engine;
mod event;
mod fence;
mod fence_fd;
mod file;
mod glue;
mod handle;
mod job;
mod mmap;
mod node;
mod range;
mod registry;
mod resv;
mod stats;
mod uapi;
mod waitqueue;

use device::{
    Limits,
    MAX_DEVICES, //
};
use backends::{
    edu,
    sim,
    soft::SoftDevice, //
};

module! {
    type: TdrvModule,
    name: "tdrv",
    authors: ["tdrv developers"],
    description: "tdrv accelerator driver: DMA buffers, copy engines, fences",
    license: "GPL",
}

/// Most software devices, leaving device numbers for hardware.
const MAX_SOFT_DEVICES: u32 = 4;

/// The module parameters, checked.
#[derive(Clone, Copy)]
pub(crate) struct Params {
    pub(crate) soft_devices: u32,
    pub(crate) channels: u32,
    pub(crate) channel_limit: u64,
    pub(crate) edu_dma_bits: u32,
    pub(crate) edu_timeout_ms: u32,
    pub(crate) sim_timeout_ms: u32,
    pub(crate) limits: Limits,
}

/// Checks one module parameter against its allowed range; logs which one
/// is wrong and what it allows, so that a failed insmod says why.
fn check_param(name: &str, value: u32, min: u32, max: u32) -> Result<u32> {
    if (min..=max).contains(&value) {
        Ok(value)
    } else {
        pr_err!("invalid module parameter {name}={value}: allowed range is {min}-{max}\n");
        Err(EINVAL)
    }
}

/// Reads and range-checks the module parameters. Every parameter is
/// checked (and every bad one logged) before the first error is returned.
pub(crate) fn params() -> Result<Params> {
    let m = glue::module_params();
    const _: () = assert!(handle::MAX_HANDLES <= u32::MAX as usize);
    // All checked first, so that every bad parameter is logged.
    let soft_devices = check_param("soft_devices", m.soft_devices, 0, MAX_SOFT_DEVICES);
    let channels = check_param("channels", m.channels, 1, 16);
    let channel_mib = check_param("channel_mib", m.channel_mib, 1, 4096);
    let edu_dma_bits = check_param("edu_dma_bits", m.edu_dma_bits, 24, 64);
    let edu_timeout_ms = check_param(
        "edu_timeout_ms",
        m.edu_timeout_ms,
        edu::MIN_TIMEOUT_MS,
        600_000,
    );
    let sim_timeout_ms = check_param(
        "sim_timeout_ms",
        m.sim_timeout_ms,
        sim::MIN_TIMEOUT_MS,
        sim::MAX_TIMEOUT_MS,
    );
    let file_max_buffers = check_param(
        "file_max_buffers",
        m.file_max_buffers,
        1,
        handle::MAX_HANDLES as u32,
    );
    let file_max_mib = check_param("file_max_mib", m.file_max_mib, 1, 1 << 20);
    let file_max_jobs = check_param(
        "file_max_jobs",
        m.file_max_jobs,
        1,
        job::JOB_WINDOW as u32 - 1,
    );
    let file_max_inflight_mib = check_param(
        "file_max_inflight_mib",
        m.file_max_inflight_mib,
        1,
        1 << 20,
    );
    let file_max_imports = check_param(
        "file_max_imports",
        m.file_max_imports,
        1,
        handle::MAX_HANDLES as u32,
    );
    let device_max_imports = check_param(
        "device_max_imports",
        m.device_max_imports,
        1,
        handle::MAX_HANDLES as u32,
    );
    let file_max_events = check_param(
        "file_max_events",
        m.file_max_events,
        1,
        uapi::MAX_EVENTS,
    );
    let device_max_events = check_param(
        "device_max_events",
        m.device_max_events,
        1,
        1 << 24,
    );
    Ok(Params {
        soft_devices: soft_devices?,
        channels: channels?,
        channel_limit: u64::from(channel_mib?) << 20,
        edu_dma_bits: edu_dma_bits?,
        edu_timeout_ms: edu_timeout_ms?,
        sim_timeout_ms: sim_timeout_ms?,
        limits: Limits {
            handles: file_max_buffers? as usize,
            bytes: u64::from(file_max_mib?) << 20,
            jobs: file_max_jobs?,
            inflight_bytes: u64::from(file_max_inflight_mib?) << 20,
            imports: file_max_imports? as usize,
            device_imports: device_max_imports?,
            events: file_max_events?,
            device_events: device_max_events?,
        },
    })
}

#[pin_data(PinnedDrop)]
struct TdrvModule {
    // Dropped first: unbind (and so stop) every PCI device.
    #[pin]
    _pci: driver::Registration<pci::Adapter<edu::EduDriver>>,
    #[pin]
    _sim: driver::Registration<pci::Adapter<sim::SimDriver>>,
    soft: KVec<Pin<KBox<SoftDevice>>>,
    // The devices' debugfs entries live inside it.
    _debugfs: stats::RootGuard,
    // Dropped last, once every device is gone: see `fence_fd.rs`.
    _fences: fence_fd::FenceModule,
    // Drained after every device is gone (unbind flushed each device's).
    _imports: dmabuf::DmabufModule,
}

impl InPlaceModule for TdrvModule {
    fn init(module: &'static ThisModule) -> impl PinInit<Self, Error> {
        const _: () = assert!(MAX_SOFT_DEVICES as usize <= MAX_DEVICES);
        pin_init::pin_init_scope(move || {
            let p = params()?;
            // First: devices' files queue work on it.
            let fences = fence_fd::FenceModule::init()?;
            let imports = dmabuf::DmabufModule::init()?;
            stats::init_root();
            let root = stats::RootGuard;
            let mut soft = KVec::with_capacity(p.soft_devices as usize, GFP_KERNEL)?;
            for _ in 0..p.soft_devices {
                soft.push(KBox::pin_init(SoftDevice::new(&p), GFP_KERNEL)?, GFP_KERNEL)?;
            }
            pr_info!(
                "loaded: {} software device(s), {} channel(s) of {} MiB each\n",
                p.soft_devices,
                p.channels,
                p.channel_limit >> 20
            );
            Ok(try_pin_init!(TdrvModule {
                _pci <- driver::Registration::new(c"tdrv", module),
                _sim <- driver::Registration::new(c"tdrv-sim", module),
                soft,
                _debugfs: root,
                _fences: fences,
                _imports: imports,
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
