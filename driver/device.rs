// SPDX-License-Identifier: GPL-2.0

//! State shared by everything that serves one tdrv device: its bus device,
//! channels, engine, limits and statistics, and the unbind sequence.
//!
//! Open files, buffers and in-flight jobs each hold an `Arc<TdrvDevice>`, so
//! the state outlives an unbind; `bound` tells whether the bus device may
//! still be used for new DMA work. The device knows its files only through
//! the [`Client`] trait, and its engine only through [`Engine`].

use kernel::{
    device::{
        self,
        Bound, //
    },
    new_condvar,
    new_mutex,
    prelude::*,
    sync::{
        aref::ARef,
        atomic::{
            Acquire,
            Atomic,
            Full,
            Relaxed, //
        },
        Arc,
        CondVar,
        Mutex, //
    }, //
};

use crate::{
    buffer::Buffer,
    channel::Channels,
    dmabuf::{
        Exports,
        Import,
        ImportCount, //
    },
    engine::{
        Engine,
        EngineCounters, //
    },
    event::EventBudget,
    registry::Registry, //
};
/// Most tdrv devices at once (software and hardware together).
pub(crate) const MAX_DEVICES: usize = 8;

/// Node names: `MiscDeviceOptions` needs `'static` names.
const NAMES: [&CStr; MAX_DEVICES] = [
    c"tdrv0", c"tdrv1", c"tdrv2", c"tdrv3", c"tdrv4", c"tdrv5", c"tdrv6", c"tdrv7",
];

/// Bitmap of device numbers in use.
static USED_INDICES: Atomic<u32> = Atomic::new(0);

/// A device number `N` of `/dev/tdrv<N>`, returned to the pool on drop.
pub(crate) struct DeviceIndex(u32);

impl DeviceIndex {
    /// Takes the lowest free number; EBUSY when all are taken.
    pub(crate) fn take() -> Result<Self> {
        let mut used = USED_INDICES.load(Relaxed);
        loop {
            let free = (!used).trailing_zeros();
            if free as usize >= MAX_DEVICES {
                return Err(EBUSY);
            }
            match USED_INDICES.cmpxchg(used, used | (1 << free), Relaxed) {
                Ok(_) => return Ok(Self(free)),
                Err(now) => used = now,
            }
        }
    }

    pub(crate) fn get(&self) -> u32 {
        self.0
    }

    pub(crate) fn name(&self) -> &'static CStr {
        NAMES[self.0 as usize]
    }
}

impl Drop for DeviceIndex {
    fn drop(&mut self) {
        let mut used = USED_INDICES.load(Relaxed);
        while let Err(now) = USED_INDICES.cmpxchg(used, used & !(1 << self.0), Relaxed) {
            used = now;
        }
    }
}

/// Counters shown in debugfs.
pub(crate) struct DeviceStats {
    pub(crate) jobs_submitted: Atomic<u64>,
    pub(crate) jobs_completed: Atomic<u64>,
    pub(crate) jobs_failed: Atomic<u64>,
    pub(crate) jobs_cancelled: Atomic<u64>,
    pub(crate) waits: Atomic<u64>,
    pub(crate) wait_timeouts: Atomic<u64>,
    pub(crate) open_files: Atomic<u64>,
    /// Nanoseconds the engine spent running jobs.
    pub(crate) busy_ns: Atomic<u64>,
}

impl DeviceStats {
    fn new() -> Self {
        Self {
            jobs_submitted: Atomic::new(0),
            jobs_completed: Atomic::new(0),
            jobs_failed: Atomic::new(0),
            jobs_cancelled: Atomic::new(0),
            waits: Atomic::new(0),
            wait_timeouts: Atomic::new(0),
            open_files: Atomic::new(0),
            busy_ns: Atomic::new(0),
        }
    }
}

/// Per-file limits (module parameters, see `tdrv.rs`).
#[derive(Clone, Copy)]
pub(crate) struct Limits {
    /// Live buffer handles.
    pub(crate) handles: usize,
    /// Bytes of live buffers the file allocated (page-rounded).
    pub(crate) bytes: u64,
    /// Jobs submitted and not yet finished.
    pub(crate) jobs: u32,
    /// Bytes those jobs move.
    pub(crate) inflight_bytes: u64,
    /// Live handles of buffers imported from foreign dma-bufs (which are
    /// not charged to a channel).
    pub(crate) imports: usize,
    /// Live buffers imported from foreign dma-bufs on the whole device.
    pub(crate) device_imports: u32,
    /// Completion events queued and not yet read.
    pub(crate) events: u32,
    /// The same on the whole device.
    pub(crate) device_events: u32,
}

/// The raw `struct device` behind `dev`, for the C calls 7.2 does not wrap.
pub(crate) fn raw_device(dev: &device::Device) -> *mut kernel::bindings::device {
    // `device::Device` is a `#[repr(transparent)]` wrapper of `struct device`.
    core::ptr::from_ref(dev).cast_mut().cast()
}

/// What the device needs from an open file, implemented by the file
/// layer: revocation at unbind, and a usage line for debugfs.
pub(crate) trait Client: Send + Sync {
    /// Removes the pages of every user mapping made through the file; a
    /// later access faults again (and gets SIGBUS once memory is detached).
    fn zap_mappings(&self);

    /// Ends with `err` the file's jobs that are not on the engine yet
    /// (held for their in-fences).
    fn cancel_held_jobs(&self, err: Error);

    /// Writes one line describing the file's usage (debugfs `clients`).
    fn describe(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result;
}

/// Ids of open files, unique across devices (fdinfo's `drm-client-id`).
static NEXT_CLIENT_ID: Atomic<u64> = Atomic::new(1);

/// A new client id.
pub(crate) fn client_id() -> u64 {
    NEXT_CLIENT_ID.fetch_add(1, Relaxed)
}

/// One tdrv device.
#[pin_data]
pub(crate) struct TdrvDevice {
    dev: ARef<device::Device>,
    /// `TDRV_DEVICE_SOFT`, `TDRV_DEVICE_EDU` or `TDRV_DEVICE_SIM`.
    pub(crate) kind: u32,
    pub(crate) index: DeviceIndex,
    #[pin]
    pub(crate) channels: Channels,
    engine: KBox<dyn Engine>,
    pub(crate) limits: Limits,
    /// Cleared when unbinding starts; unbind then waits (on `idle`) for
    /// `active`, the sections of ioctls and mmaps that use the bus device or
    /// buffer memory, to drop to zero. Atomics keep the ioctl path free of
    /// locks and wake-ups; the lock and wait queue are used only while
    /// unbinding.
    bound: Atomic<bool>,
    active: Atomic<u64>,
    #[pin]
    idle_lock: Mutex<()>,
    #[pin]
    idle: CondVar,
    /// Every live buffer of the device, so unbind can reach their fences
    /// and memory, also those only jobs or mappings still hold.
    #[pin]
    buffers: Registry,
    /// Foreign dma-bufs imported (not charged to a channel) and not yet
    /// released, at most `limits.device_imports`.
    pub(crate) imports: Arc<ImportCount>,
    /// Completion events of all its files, at most `limits.device_events`.
    pub(crate) events: Arc<EventBudget>,
    /// Every open file, by client id, so that unbind can zap their mappings
    /// and debugfs can show who holds what.
    #[pin]
    files: Mutex<KVec<(u64, Arc<dyn Client>)>>,
    /// Live dma-buf exports of the device's buffers, for unbind.
    #[pin]
    pub(crate) exports: Exports,
    pub(crate) stats: DeviceStats,
}

impl TdrvDevice {
    pub(crate) fn new(
        dev: &device::Device,
        kind: u32,
        index: DeviceIndex,
        params: &crate::Params,
        engine: KBox<dyn Engine>,
    ) -> Result<Arc<Self>> {
        Arc::pin_init(
            try_pin_init!(Self {
                dev: dev.into(),
                kind,
                index,
                channels <- Channels::new(params.channels, params.channel_limit)?,
                engine,
                limits: params.limits,
                bound: Atomic::new(true),
                active: Atomic::new(0),
                idle_lock <- new_mutex!((), "TdrvDevice::idle_lock"),
                idle <- new_condvar!("TdrvDevice::idle"),
                buffers <- Registry::new(),
                imports: ImportCount::new(params.limits.device_imports)?,
                events: EventBudget::new(params.limits.device_events)?,
                files <- new_mutex!(KVec::new(), "TdrvDevice::files"),
                exports <- Exports::new(),
                stats: DeviceStats::new(),
            }),
            GFP_KERNEL,
        )
    }

    pub(crate) fn engine(&self) -> &dyn Engine {
        &*self.engine
    }

    pub(crate) fn engine_counters(&self) -> EngineCounters {
        self.engine.counters()
    }

    pub(crate) fn name(&self) -> &'static CStr {
        self.index.name()
    }

    pub(crate) fn is_bound(&self) -> bool {
        self.bound.load(Acquire)
    }

    /// Enters a section that uses the bus device or buffer memory: ENODEV
    /// after unbind started. Unbind waits until every guard is gone before
    /// it frees memory, so sections must be short and must not wait for
    /// userspace (no user page faults, no sleeping on fences).
    pub(crate) fn enter(&self) -> Result<ActiveGuard<'_>> {
        // Count first, then check: `mark_unbound` stores first, then waits
        // for the count, so one of the two sides always sees the other.
        self.active.fetch_add(1, Full);
        let guard = ActiveGuard { device: self };
        if !self.bound.load(Acquire) {
            return Err(ENODEV);
        }
        Ok(guard)
    }

    fn leave(&self) {
        if self.active.fetch_sub(1, Full) == 1 && !self.bound.load(Acquire) {
            // The last user after unbind started: wake the drain. Taking
            // the lock orders this with the drain's check of `active`.
            let _guard = self.idle_lock.lock();
            self.idle.notify_all();
        }
    }

    /// The bound bus device, for a section in progress: unbind waits for
    /// every active guard, so the device stays bound while `_active` lives.
    pub(crate) fn bound_device<'a>(
        &'a self,
        _active: &'a ActiveGuard<'a>,
    ) -> &'a device::Device<Bound> {
        // SAFETY: `_active` proves that a section is in progress: the
        // driver's unbind does not return (so the device stays bound) until
        // `drain_users` has seen every guard dropped.
        unsafe { self.dev.as_bound() }
    }

    /// Waits until no section uses the device. Call after `bound` was
    /// cleared and after waking every waiter.
    fn drain_users(&self) {
        let mut guard = self.idle_lock.lock();
        while self.active.load(Acquire) > 0 {
            self.idle.wait(&mut guard);
        }
    }

    /// Takes a key in the buffer registry for a buffer under construction.
    pub(crate) fn register_buffer(&self) -> Result<u64> {
        self.buffers.reserve()
    }

    /// Records the address of the buffer built under `key`. A buffer
    /// published after unbind started has its fence killed here: the
    /// unbind's own sweep may have run before it was visible.
    pub(crate) fn publish_buffer(&self, key: u64, buf: &Arc<Buffer>) {
        // SAFETY: `buf` is live; its drop removes `key` before it is freed.
        unsafe { self.buffers.publish(key, Arc::as_ptr(buf)) };
        // After the sweep lock: either the sweep (which takes it after
        // clearing `bound`) saw the address, or this sees `bound` cleared.
        if !self.is_bound() {
            buf.fence.kill();
        }
    }

    /// Removes a buffer from the registry (if its construction failed).
    pub(crate) fn unregister_buffer(&self, key: u64) {
        self.buffers.remove(key, || {});
    }

    /// Removes a buffer from the registry and runs `free` (which frees its
    /// memory) under the registry's sweep lock: unbind's sweeps hold that
    /// lock, so a buffer's memory is freed either before unbind frees it,
    /// or by unbind, never after unbind returned.
    pub(crate) fn unregister_buffer_with(&self, key: u64, free: impl FnOnce()) {
        self.buffers.remove(key, free);
    }

    /// Calls `f` on every registered buffer, under the registry's sweep
    /// lock.
    fn for_each_buffer(&self, f: impl Fn(&Buffer)) {
        self.buffers.for_each(f);
    }

    /// The bus driver's unbind (or the software device's removal), before
    /// the bus device goes away: refuses new work, stops the engine (its
    /// jobs fail with ENODEV), wakes every waiter with ENODEV, waits for
    /// the ioctl and mmap sections in progress, removes every user
    /// mapping's pages and frees the DMA memory of every buffer, so that
    /// no DMA allocation outlives the binding. Buffers stay as empty
    /// shells until their last reference goes.
    ///
    /// `stopped` runs once the engine has stopped and before any memory is
    /// freed (a PCI backend clears bus mastering there).
    pub(crate) fn unbind(&self, mut stopped: impl FnMut()) {
        self.bound.xchg(false, Full);
        self.engine.shutdown(&mut stopped);
        // Jobs held for in-fences never reach the engine now: end them
        // (their callbacks go), outside the file registry's lock (ending a
        // job may free buffers).
        let mut key = 0;
        while let Some((k, file)) = self.file_after(key) {
            file.cancel_held_jobs(ENODEV);
            key = k;
        }
        self.for_each_buffer(|buf| buf.fence.kill());
        // No lock is held while draining: sections are short and never
        // wait for userspace, and opens and closes must not wait for us.
        self.drain_users();
        // Detach before zapping: from here on the fault handler inserts no
        // page, so after the zap no user page table maps buffer memory.
        self.for_each_buffer(|buf| buf.detach());
        for (_, file) in self.files.lock().iter() {
            file.zap_mappings();
        }
        self.exports.zap_all();
        // Importers on other devices drop their mappings of exported
        // memory; what a non-revocable importer still maps is freed with
        // the buffer's last reference instead (the dma-buf's release, after
        // the importer let go), never while it is mapped.
        self.exports.revoke_all();
        // Without the list (no memory), every buffer keeps its memory until
        // its last reference: late, but never while something maps it.
        let in_use = self.exports.in_use_keys();
        self.for_each_buffer(|buf| {
            match &in_use {
                Ok(keys) if !keys.contains(&Exports::key_of(buf)) => {}
                _ => return,
            }
            // SAFETY: The device is unbound, its engine stopped (above), no
            // active guard exists (drained) or can be taken (`bound` is
            // false), the buffer was detached and then every mapping of
            // every open file and of every live export was zapped (exports
            // released earlier took their mappings with them); files opened later cannot mmap
            // (`enter` fails), and closed files' mappings were gone with
            // them.
            unsafe { buf.release_memory() };
        });
        // Foreign dma-bufs whose buffers went before the sweep above may
        // still be mapped for this device: their releases were queued
        // under the sweep lock, so before this flush.
        Import::flush_releases();
    }

    /// Removes the pages of every user mapping of every open file (an
    /// imported buffer was revoked: its pages must go; the others fault
    /// back in).
    pub(crate) fn zap_file_mappings(&self) {
        for (_, file) in self.files.lock().iter() {
            file.zap_mappings();
        }
    }

    /// Records an open file under its client id `key`.
    pub(crate) fn add_file(&self, key: u64, file: Arc<dyn Client>) -> Result {
        self.files.lock().push((key, file), GFP_KERNEL)?;
        self.stats.open_files.add(1, Relaxed);
        Ok(())
    }

    /// The open file with the lowest client id above `key`.
    fn file_after(&self, key: u64) -> Option<(u64, Arc<dyn Client>)> {
        self.files
            .lock()
            .iter()
            .filter(|(k, _)| *k > key)
            .min_by_key(|(k, _)| *k)
            .map(|(k, f)| (*k, f.clone()))
    }

    /// Writes one line per open file (debugfs `clients`).
    pub(crate) fn describe_clients(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        for (_, file) in self.files.lock().iter() {
            file.describe(f)?;
        }
        Ok(())
    }

    /// Forgets a released file.
    pub(crate) fn remove_file(&self, key: u64) {
        let removed = {
            let mut files = self.files.lock();
            match files.iter().position(|(k, _)| *k == key) {
                Some(i) => files.remove(i).ok(),
                None => None,
            }
        };
        if removed.is_some() {
            self.stats.open_files.fetch_sub(1, Relaxed);
        }
    }
}

/// Proof that a section using the device is in progress (see
/// [`TdrvDevice::enter`]).
pub(crate) struct ActiveGuard<'a> {
    device: &'a TdrvDevice,
}

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.device.leave();
    }
}
