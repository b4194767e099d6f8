// SPDX-License-Identifier: GPL-2.0

//! Per-device statistics in debugfs: `/sys/kernel/debug/tdrv/tdrv<N>/stats`.

use core::fmt;

use kernel::{
    debugfs::{
        Dir,
        File, //
    },
    prelude::*,
    sync::{
        atomic::Relaxed,
        Arc, //
    },
    uaccess::UserSliceReader, //
};

use crate::{
    device::TdrvDevice,
    uapi::{
        DEVICE_EDU,
        DEVICE_SIM, //
    }, //
};

kernel::sync::global_lock! {
    // SAFETY: `init_root` initialises the lock in module init, before any
    // device (and so any user of the lock) exists.
    unsafe(uninit) static ROOT: Mutex<Option<Dir>> = None;
}

/// Creates `/sys/kernel/debug/tdrv`. Call once, from module init.
pub(crate) fn init_root() {
    // SAFETY: Called exactly once, from module init, before any other use.
    unsafe { ROOT.init() };
    *ROOT.lock() = Some(Dir::new(c"tdrv"));
}

/// Removes `/sys/kernel/debug/tdrv` (after every device has gone).
pub(crate) struct RootGuard;

impl Drop for RootGuard {
    fn drop(&mut self) {
        ROOT.lock().take();
    }
}

/// The debugfs directory and files of one device; removed on drop.
pub(crate) struct DeviceDebugfs {
    _stats: Pin<KBox<File<Arc<TdrvDevice>>>>,
    _clients: Pin<KBox<File<Arc<TdrvDevice>>>>,
    _inject: Pin<KBox<File<Arc<TdrvDevice>>>>,
    _dir: Dir,
}

impl DeviceDebugfs {
    pub(crate) fn new(device: &Arc<TdrvDevice>) -> Result<Self> {
        let dir = match ROOT.lock().as_ref() {
            Some(root) => root.subdir(device.name()),
            None => return Err(ENOENT),
        };
        let stats = KBox::pin_init(
            dir.read_callback_file(c"stats", device.clone(), &write_stats),
            GFP_KERNEL,
        )?;
        let clients = KBox::pin_init(
            dir.read_callback_file(c"clients", device.clone(), &write_clients),
            GFP_KERNEL,
        )?;
        let inject = KBox::pin_init(
            dir.write_callback_file(c"inject", device.clone(), &inject),
            GFP_KERNEL,
        )?;
        Ok(Self {
            _stats: stats,
            _clients: clients,
            _inject: inject,
            _dir: dir,
        })
    }
}

/// `inject`: one fault-injection command for the device's engine (see the
/// engine's docs, e.g. `edu.rs`); root-only, for tests.
fn inject(d: &Arc<TdrvDevice>, reader: &mut UserSliceReader) -> Result {
    let mut buf = [0u8; 32];
    let n = reader.len();
    if n == 0 || n > buf.len() {
        return Err(EINVAL);
    }
    reader.read_slice(&mut buf[..n])?;
    let cmd = buf[..n].strip_suffix(b"\n").unwrap_or(&buf[..n]);
    d.engine().inject(cmd)
}

/// `clients`: one line per open file (who holds the channels).
fn write_clients(d: &Arc<TdrvDevice>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    d.describe_clients(f)
}

fn write_stats(d: &Arc<TdrvDevice>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let s = &d.stats;
    let kind = match d.kind {
        DEVICE_EDU => "edu",
        DEVICE_SIM => "sim",
        _ => "soft",
    };
    writeln!(f, "kind: {kind}")?;
    writeln!(f, "bound: {}", d.is_bound())?;
    writeln!(f, "open_files: {}", s.open_files.load(Relaxed))?;
    for ch in 0..d.channels.count() {
        if let Ok(c) = d.channels.stats(ch) {
            writeln!(
                f,
                "channel{ch}: buffers {} used {} peak {} limit {} failed_allocs {}",
                c.buffers, c.used, c.peak, c.limit, c.failed
            )?;
        }
    }
    writeln!(f, "imports: {}", d.imports.held())?;
    writeln!(f, "jobs_submitted: {}", s.jobs_submitted.load(Relaxed))?;
    writeln!(f, "jobs_completed: {}", s.jobs_completed.load(Relaxed))?;
    writeln!(f, "jobs_failed: {}", s.jobs_failed.load(Relaxed))?;
    writeln!(f, "waits: {}", s.waits.load(Relaxed))?;
    writeln!(f, "wait_timeouts: {}", s.wait_timeouts.load(Relaxed))?;
    writeln!(f, "jobs_cancelled: {}", s.jobs_cancelled.load(Relaxed))?;
    writeln!(f, "busy_ns: {}", s.busy_ns.load(Relaxed))?;
    let e = d.engine_counters();
    writeln!(f, "irqs: {}", e.irqs)?;
    writeln!(f, "spurious_irqs: {}", e.spurious_irqs)?;
    writeln!(f, "watchdog_timeouts: {}", e.watchdog_timeouts)?;
    writeln!(f, "resets: {}", e.resets)?;
    writeln!(f, "polled_completions: {}", e.polled)?;
    d.engine().describe(f)
}
