// SPDX-License-Identifier: GPL-2.0

//! `/dev/tdrv<N>`: the misc device through which userspace reaches a tdrv
//! device, registered with file operations that pin the module.
//!
//! # Module lifetime
//!
//! 7.2's `MiscDeviceRegistration` registers a `file_operations` table with
//! no `.owner`, so nothing stops `rmmod` while a file is open, and the next
//! `close` jumps into freed module text. Taking a module reference in
//! `open` and dropping it in `release` is not sound either: `release` would
//! still be running module code after the last `module_put`.
//!
//! Instead tdrv registers its own `struct miscdevice` whose `fops` is a
//! copy of the table Rust builds for [`TdrvFile`] with `.owner` set to this
//! module. The VFS then holds a module reference for every open file
//! (`misc_open` takes it through `fops_get`, `__fput` drops it after
//! `release` returned), and every mapping holds its file, so `rmmod` fails
//! while a file is open or a buffer is mapped, and module code never runs
//! after the reference that protects it is gone.
//!
//! The open trampoline of that table reads the `struct miscdevice` as a
//! `MiscDeviceRegistration<TdrvFile>`, a `#[repr(transparent)]` wrapper of
//! it; [`Node`] has the same layout, so [`DeviceNode::from_registration`]
//! recovers the node from what `open` is given.

use kernel::{
    bindings,
    error::to_result,
    miscdevice::{
        MiscDeviceOptions,
        MiscDeviceRegistration, //
    },
    prelude::*,
    sync::Arc,
    types::{
        ForeignOwnable,
        Opaque, //
    },
};

use crate::{
    device::TdrvDevice,
    file::TdrvFile, //
};

/// The file operations of every tdrv node.
#[repr(transparent)]
struct NodeFops(bindings::file_operations);

// SAFETY: The table is immutable; the kernel only reads it, from any
// thread. Its pointers are to this module's functions and to the module
// itself.
unsafe impl Sync for NodeFops {}

static FOPS: NodeFops = NodeFops(bindings::file_operations {
    owner: crate::THIS_MODULE.as_ptr(),
    // 7.2's `MiscDevice` has no `poll`: completion events need one.
    poll: Some(poll),
    // SAFETY: `into_raw` stores in `fops` the address of the constant
    // table Rust builds for `TdrvFile`, valid for the whole program; it is
    // read here at compile time.
    ..unsafe { *MiscDeviceOptions { name: c"tdrv" }.into_raw::<TdrvFile>().fops }
});

/// `file_operations.poll`: readable while the file has completion events
/// (see `event.rs`).
///
/// # Safety
///
/// Called by the VFS only, for a file opened through [`FOPS`], between its
/// `open` and `release`.
unsafe extern "C" fn poll(
    file: *mut bindings::file,
    pt: *mut bindings::poll_table_struct,
) -> bindings::__poll_t {
    // SAFETY: `open` stored a `Pin<KBox<TdrvFile>>` in `private_data`
    // (`into_foreign`), which `release` takes back only after every poll
    // of the file returned.
    let me = unsafe { <Pin<KBox<TdrvFile>> as ForeignOwnable>::borrow((*file).private_data) };
    // SAFETY: `file` is this file and `pt` the table of this call.
    unsafe { me.poll(file, pt) }
}

/// A registered `struct miscdevice` using [`FOPS`].
///
/// # Invariants
///
/// `inner` is registered with `misc_register` from [`Node::register`] until
/// the node is dropped.
#[repr(transparent)]
#[pin_data(PinnedDrop)]
struct Node {
    #[pin]
    inner: Opaque<bindings::miscdevice>,
}

// SAFETY: `misc_deregister` may be called from any thread, and the kernel
// synchronises its own accesses to the registered `struct miscdevice`; the
// driver never touches it after registration.
unsafe impl Send for Node {}
// SAFETY: `Node` has no `&self` methods that touch `inner`.
unsafe impl Sync for Node {}

// The open trampoline treats our `struct miscdevice` as the registration.
const _: () = assert!(
    core::mem::size_of::<Node>() == core::mem::size_of::<MiscDeviceRegistration<TdrvFile>>()
);

impl Node {
    fn register(name: &'static CStr) -> impl PinInit<Self, Error> {
        try_pin_init!(Self {
            inner <- Opaque::try_ffi_init(move |slot: *mut bindings::miscdevice| {
                let mut raw = MiscDeviceOptions { name }.into_raw::<TdrvFile>();
                raw.fops = &FOPS.0;
                raw.groups = crate::glue::node_groups();
                // SAFETY: The initializer may write to `slot`.
                unsafe { slot.write(raw) };
                // SAFETY: `slot` holds a complete `struct miscdevice`, pinned
                // until `drop` deregisters it.
                // INVARIANT: On success the device is registered.
                to_result(unsafe { bindings::misc_register(slot) })
            }),
        })
    }
}

#[pinned_drop]
impl PinnedDrop for Node {
    fn drop(self: Pin<&mut Self>) {
        // SAFETY: Registered by the type invariant; deregistered only here.
        unsafe { bindings::misc_deregister(self.inner.get()) };
    }
}

/// The misc device of a [`TdrvDevice`]. `open` finds the device through
/// `container_of!` on the registration.
#[pin_data]
pub(crate) struct DeviceNode {
    // Dropped first: `open` and the sysfs attributes use `device` for as
    // long as the misc device is registered.
    #[pin]
    reg: Node,
    pub(crate) device: Arc<TdrvDevice>,
}

impl DeviceNode {
    pub(crate) fn new(device: Arc<TdrvDevice>) -> impl PinInit<Self, Error> {
        let name = device.name();
        try_pin_init!(Self {
            reg <- Node::register(name),
            device,
        })
    }

    /// Recovers the node from the registration `open` is given.
    pub(crate) fn from_registration(reg: &MiscDeviceRegistration<TdrvFile>) -> &Self {
        let node = core::ptr::from_ref(reg).cast::<Node>().cast_mut();
        // SAFETY: Every `struct miscdevice` using `FOPS` is the `inner` of
        // the `reg` field of a pinned `DeviceNode` (only `DeviceNode::new`
        // registers one), and `Node` is `repr(transparent)` over it, so
        // `node` is that field. `misc_open` keeps the registration, hence
        // the node, alive for the duration of the `open` call.
        unsafe { &*kernel::container_of!(node, DeviceNode, reg) }
    }
}

/// `busy_ns` of the device behind a registered tdrv `struct miscdevice`,
/// for the sysfs attribute in `glue.c`.
///
/// # Safety
///
/// `misc` is the `inner` of a registered [`Node`] (sysfs attributes of the
/// misc device exist only while it is registered).
#[no_mangle]
unsafe extern "C" fn tdrv_node_busy_ns(misc: *mut bindings::miscdevice) -> u64 {
    let node = misc.cast::<Node>();
    // SAFETY: By the caller's guarantee `node` is the `reg` field of a live
    // `DeviceNode` (`Node` is `repr(transparent)` over the miscdevice).
    let dn = unsafe { &*kernel::container_of!(node, DeviceNode, reg) };
    dn.device.stats.busy_ns.load(kernel::sync::atomic::Relaxed)
}
