// SPDX-License-Identifier: GPL-2.0

//! State shared by everything that serves one tdrv device: its bus device,
//! channels, engine and statistics, plus the misc device (`/dev/tdrv<N>`)
//! that userspace opens.
//!
//! Open files, buffers and in-flight jobs each hold an `Arc<TdrvDevice>`, so
//! the state outlives an unbind; `bound` tells whether the bus device may
//! still be used for new DMA work.

use kernel::{
    device::{
        self,
        Bound, //
    },
    miscdevice::{
        MiscDeviceOptions,
        MiscDeviceRegistration, //
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
    engine::Engine,
    file::{
        FileState,
        TdrvFile, //
    },
    handle::HandleTable, //
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
    pub(crate) waits: Atomic<u64>,
    pub(crate) wait_timeouts: Atomic<u64>,
    pub(crate) open_files: Atomic<u64>,
}

impl DeviceStats {
    fn new() -> Self {
        Self {
            jobs_submitted: Atomic::new(0),
            jobs_completed: Atomic::new(0),
            jobs_failed: Atomic::new(0),
            waits: Atomic::new(0),
            wait_timeouts: Atomic::new(0),
            open_files: Atomic::new(0),
        }
    }
}

/// The raw `struct device` behind `dev`, for the C calls 7.2 does not wrap.
pub(crate) fn raw_device(dev: &device::Device) -> *mut kernel::bindings::device {
    // `device::Device` is a `#[repr(transparent)]` wrapper of `struct device`.
    core::ptr::from_ref(dev).cast_mut().cast()
}

/// Address of a live buffer, kept in the device's buffer registry.
struct BufferAddr(*const Buffer);

// SAFETY: The registry only dereferences the address under its lock while
// the buffer is alive (a buffer leaves the registry in its drop, under the
// same lock), and `Buffer` is `Sync`.
unsafe impl Send for BufferAddr {}

/// One tdrv device.
#[pin_data]
pub(crate) struct TdrvDevice {
    dev: ARef<device::Device>,
    /// `TDRV_DEVICE_SOFT` or `TDRV_DEVICE_EDU`.
    pub(crate) kind: u32,
    pub(crate) index: DeviceIndex,
    #[pin]
    pub(crate) channels: Channels,
    engine: Engine,
    /// Cleared before the bus device is unbound; unbind then waits (on
    /// `idle`) for `active`, the ioctls and mmaps in progress, to drop to
    /// zero. Atomics keep the ioctl path free of locks and wake-ups; the
    /// lock and wait queue are used only while unbinding.
    bound: Atomic<bool>,
    active: Atomic<u64>,
    #[pin]
    idle_lock: Mutex<()>,
    #[pin]
    idle: CondVar,
    /// Every live buffer of the device, so unbind can free their memory.
    #[pin]
    buffers: Mutex<HandleTable<BufferAddr>>,
    /// State of every open file, so that unbind can reach their waiters.
    #[pin]
    files: Mutex<KVec<Arc<FileState>>>,
    pub(crate) stats: DeviceStats,
}

impl TdrvDevice {
    pub(crate) fn new(
        dev: &device::Device,
        kind: u32,
        index: DeviceIndex,
        channels: u32,
        channel_limit: u64,
        engine: Engine,
    ) -> Result<Arc<Self>> {
        Arc::pin_init(
            try_pin_init!(Self {
                dev: dev.into(),
                kind,
                index,
                channels <- Channels::new(channels, channel_limit)?,
                engine,
                bound: Atomic::new(true),
                active: Atomic::new(0),
                idle_lock <- new_mutex!((), "TdrvDevice::idle_lock"),
                idle <- new_condvar!("TdrvDevice::idle"),
                buffers <- new_mutex!(HandleTable::new(), "TdrvDevice::buffers"),
                files <- new_mutex!(KVec::new(), "TdrvDevice::files"),
                stats: DeviceStats::new(),
            }),
            GFP_KERNEL,
        )
    }

    /// The bus device (PCI or faux) that DMA memory is allocated for.
    pub(crate) fn bus_device(&self) -> &device::Device {
        &self.dev
    }

    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    pub(crate) fn name(&self) -> &'static CStr {
        self.index.name()
    }

    pub(crate) fn is_bound(&self) -> bool {
        self.bound.load(Acquire)
    }

    /// Enters an ioctl or mmap that uses the device: ENODEV after unbind.
    /// Unbind waits until every guard is gone before it frees memory.
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

    /// The bound bus device, for an ioctl in progress: unbind waits for
    /// every active guard, so the device stays bound while `_active` lives.
    pub(crate) fn bound_device<'a>(
        &'a self,
        _active: &'a ActiveGuard<'a>,
    ) -> &'a device::Device<Bound> {
        // SAFETY: `_active` proves that an ioctl is in progress: the
        // driver's unbind does not return (so the device stays bound) until
        // `drain_users` has seen every guard dropped.
        unsafe { self.dev.as_bound() }
    }

    /// Called from the bus driver's unbind, before the device goes away:
    /// later [`TdrvDevice::enter`] calls fail with ENODEV.
    pub(crate) fn mark_unbound(&self) {
        self.bound.xchg(false, Full);
    }

    /// Waits until no ioctl or mmap uses the device. Call after
    /// [`TdrvDevice::mark_unbound`] and after waking every waiter.
    fn drain_users(&self) {
        let mut guard = self.idle_lock.lock();
        while self.active.load(Acquire) > 0 {
            self.idle.wait(&mut guard);
        }
    }

    /// Takes a key in the buffer registry for a buffer under construction.
    pub(crate) fn register_buffer(&self) -> Result<u64> {
        self.buffers.lock().insert(BufferAddr(core::ptr::null()))
    }

    /// Records the address of the buffer built under `key`.
    pub(crate) fn publish_buffer(&self, key: u64, buf: &Arc<Buffer>) {
        if let Some(slot) = self.buffers.lock().get_mut(key) {
            slot.0 = Arc::as_ptr(buf);
        }
    }

    /// Removes a buffer from the registry (from its drop).
    pub(crate) fn unregister_buffer(&self, key: u64) {
        self.buffers.lock().remove(key);
    }

    /// Unbind, after the engine stopped: wakes every waiter with ENODEV,
    /// waits for ioctls and mmaps in progress to leave, removes the pages
    /// of every user mapping, and frees the DMA memory of every buffer, so
    /// that no DMA allocation outlives the device's binding. Buffers stay
    /// as empty shells until their last reference goes.
    pub(crate) fn revoke_all(&self) {
        // Holding `files` while draining is fine: no ioctl takes it, and a
        // release that waits for it holds no active guard.
        let files = self.files.lock();
        for file in files.iter() {
            file.kill_fences();
        }
        self.drain_users();
        for file in files.iter() {
            file.zap_mappings();
        }
        drop(files);
        let buffers = self.buffers.lock();
        buffers.for_each(|addr| {
            if !addr.0.is_null() {
                // SAFETY: Registered addresses belong to live buffers: a
                // buffer unregisters in its drop, which takes this lock
                // first. The device is unbound, its engine stopped (the
                // caller's duty), no ioctl or mmap runs (drained above) or
                // can start (`bound` is false), and every user mapping's
                // pages are gone (zapped above).
                unsafe { (*addr.0).revoke() };
            }
        });
    }

    /// Records an open file.
    pub(crate) fn add_file(&self, file: Arc<FileState>) -> Result {
        self.files.lock().push(file, GFP_KERNEL)?;
        self.stats.open_files.add(1, Relaxed);
        Ok(())
    }

    /// Forgets a released file.
    pub(crate) fn remove_file(&self, file: &Arc<FileState>) {
        let mut files = self.files.lock();
        if let Some(i) = files.iter().position(|f| Arc::ptr_eq(f, file)) {
            files.remove(i).ok();
            self.stats.open_files.fetch_sub(1, Relaxed);
        }
    }
}

/// Proof that an ioctl or mmap is using the device (see
/// [`TdrvDevice::enter`]).
pub(crate) struct ActiveGuard<'a> {
    device: &'a TdrvDevice,
}

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.device.leave();
    }
}

/// The misc device of a [`TdrvDevice`]. `open` finds the device through
/// `container_of!` on the registration.
#[pin_data]
pub(crate) struct DeviceNode {
    pub(crate) device: Arc<TdrvDevice>,
    #[pin]
    reg: MiscDeviceRegistration<TdrvFile>,
}

impl DeviceNode {
    pub(crate) fn new(device: Arc<TdrvDevice>) -> impl PinInit<Self, Error> {
        let name = device.name();
        try_pin_init!(Self {
            device,
            reg <- MiscDeviceRegistration::register(MiscDeviceOptions { name }),
        })
    }

    /// Recovers the node from the registration `open` is given.
    pub(crate) fn from_registration(reg: &MiscDeviceRegistration<TdrvFile>) -> &Self {
        // SAFETY: Every `MiscDeviceRegistration<TdrvFile>` is the `reg` field
        // of a pinned `DeviceNode` (it is only created in `DeviceNode::new`),
        // and `misc_open` keeps the registration, hence the node, alive for
        // the duration of the `open` call that lends us `reg`.
        unsafe { &*kernel::container_of!(core::ptr::from_ref(reg).cast_mut(), DeviceNode, reg) }
    }
}
