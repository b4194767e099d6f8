// SPDX-License-Identifier: GPL-2.0

//! The tdrv sim device: QEMU's ivshmem-doorbell PCI device (1af4:1110)
//! whose shared memory (BAR2) and interrupts are served by the `tdrv-sim`
//! process, which simulates an accelerator with device memory (HBM) and
//! several DMA queues. The layout of BAR2 is in `regs.rs` (and, with a
//! diagram, in `docs/sim-device.md`).
//!
//! - `regs.rs`: BAR2 and the doorbell;
//! - `hbm.rs`: the range allocator of each HBM channel;
//! - `queue.rs`: one queue's rings, posting, completion and reset;
//! - `engine.rs`: the scheduler that spreads jobs over the queues, the
//!   DMA paths of COPY_IN/COPY_OUT/MEMSET/COPY, the watchdog and fault
//!   injection.
//!
//! Probe binds only a device whose BAR2 carries the simulator's magic,
//! version 1 and `ready`; any other ivshmem device gets ENODEV. Every
//! field of the header is untrusted: a layout that breaks a limit of
//! `docs/sim-device.md`, overflows, or does not fit BAR2 fails probe with
//! EINVAL and a dmesg line naming the check (see [`Layout::check`]). It maps
//! the control part of BAR2 (below `hbm_offset`) uncached, marks HBM
//! write-combined for user mappings, resets every queue, and takes one
//! MSI-X vector per queue, whose threaded handler consumes that queue's
//! completions.
//!
//! Unbind runs the core's sequence (`TdrvDevice::unbind`): the engine
//! refuses new work and resets every queue (the device drops what was
//! pending), bus mastering goes off, the queues' ops and pending jobs fail
//! with ENODEV, user mappings of HBM are zapped and buffers give their HBM
//! back. The interrupts are freed after that, then the mappings.

mod engine;
mod hbm;
mod queue;
mod regs;

/// Range of the watchdog's timeout (`sim_timeout_ms`, and debugfs
/// `inject` `watchdog_ms`): below 100 ms a healthy queue behind a few
/// 16 MiB descriptors would be reset.
pub(crate) const MIN_TIMEOUT_MS: u32 = 100;
/// Ten minutes: longer is no watchdog.
pub(crate) const MAX_TIMEOUT_MS: u32 = 600_000;

use kernel::{
    bindings,
    device::Core,
    devres::Devres,
    dma::{
        Device as _,
        DmaMask, //
    },
    io::{
        Io,
        Mmio,
        MmioRaw, //
    },
    page::{
        PAGE_SHIFT,
        PAGE_SIZE, //
    },
    pci,
    prelude::*,
    sync::{
        aref::ARef,
        Arc, //
    }, //
};

use self::{
    engine::{
        SimBackend,
        SimEngine, //
    },
    hbm::{
        Hbm,
        HbmRange, //
    },
    queue::{
        Hw,
        Queue, //
    },
    regs::*,
};
use crate::{
    buffer::{DeviceMemory, P2pRange},
    device::{
        DeviceIndex,
        TdrvDevice, //
    },
    engine::Engine,
    glue,
    node::DeviceNode,
    stats::DeviceDebugfs,
    uapi::DEVICE_SIM, //
};

type Bar0 = pci::Bar<'static, BAR0_SIZE>;

/// The control part of BAR2 (header and queue blocks), mapped uncached,
/// with the write-combining reservation of HBM. Unmapped and released
/// when unbind revokes it.
struct CtrlMap {
    raw: MmioRaw<HEADER_SIZE>,
    pdev: ARef<pci::Device>,
    /// Physical range of HBM reserved write-combined.
    wc: (u64, u64),
    /// HBM mapped write-combined (`wc.1` bytes), for zeroing small ranges
    /// with the CPU; null until mapped.
    hbm: *mut core::ffi::c_void,
}

// SAFETY: The mapping is plain MMIO, usable from any thread; `pdev` is
// reference counted.
unsafe impl Send for CtrlMap {}
// SAFETY: As above; MMIO accessors take `&self`.
unsafe impl Sync for CtrlMap {}

fn raw_pci<Ctx: kernel::device::DeviceContext>(pdev: &pci::Device<Ctx>) -> *mut bindings::pci_dev {
    // `pci::Device` is a `#[repr(transparent)]` wrapper of `struct pci_dev`.
    core::ptr::from_ref(pdev).cast::<bindings::pci_dev>().cast_mut()
}

impl CtrlMap {
    /// Requests BAR2 and maps its first `len` bytes.
    fn new(pdev: &pci::Device<Core<'_>>, len: usize) -> Result<Self> {
        let raw = raw_pci(pdev);
        // SAFETY: `raw` is a valid, enabled PCI device being probed.
        let r = unsafe { bindings::pci_request_region(raw, 2, c"tdrv-sim".as_char_ptr()) };
        if r != 0 {
            return Err(EBUSY);
        }
        // SAFETY: As above; BAR2 was requested.
        let addr = unsafe { bindings::pci_iomap_range(raw, 2, 0, len) };
        if addr.is_null() {
            // SAFETY: Requested above.
            unsafe { bindings::pci_release_region(raw, 2) };
            return Err(ENOMEM);
        }
        let map = Self {
            raw: MmioRaw::new(addr as usize, len).inspect_err(|_| {
                // SAFETY: Mapped and requested above.
                unsafe {
                    bindings::pci_iounmap(raw, addr);
                    bindings::pci_release_region(raw, 2);
                }
            })?,
            pdev: pdev.into(),
            wc: (0, 0),
            hbm: core::ptr::null_mut(),
        };
        Ok(map)
    }

    fn io(&self) -> &Mmio<HEADER_SIZE> {
        // SAFETY: `raw` describes a live mapping of at least `HEADER_SIZE`
        // bytes (checked by `MmioRaw::new`) until drop.
        unsafe { Mmio::from_raw(&self.raw) }
    }
}

impl Drop for CtrlMap {
    fn drop(&mut self) {
        let raw = raw_pci(&self.pdev);
        if !self.hbm.is_null() {
            // SAFETY: Mapped by `ioremap_wc` in probe; revocation waited for
            // every user of the guard that reached it.
            unsafe { bindings::iounmap(self.hbm) };
        }
        if self.wc.1 != 0 {
            // SAFETY: Reserved in probe; user mappings of HBM were zapped
            // by unbind before the revocation that drops us.
            unsafe { glue::io_free_wc(self.wc.0, self.wc.1) };
        }
        // SAFETY: Mapped and requested in `new`; nothing uses the mapping
        // any more (revoked).
        unsafe {
            bindings::pci_iounmap(raw, self.raw.addr() as *mut core::ffi::c_void);
            bindings::pci_release_region(raw, 2);
        }
    }
}

/// The device as the queues reach it.
pub(crate) struct SimHw {
    ctrl: Devres<CtrlMap>,
    bar0: Devres<Bar0>,
    peer: u32,
    /// Physical address of HBM (BAR2 + `hbm_offset`).
    pub(crate) hbm_phys: u64,
    /// BAR2's peer-to-peer DMA provider (`glue::p2p_provider`), 0 if none.
    pub(crate) p2p: usize,
}

impl Hw for SimHw {
    fn with_ctrl<R>(&self, f: impl FnOnce(&Mmio<HEADER_SIZE>) -> R) -> Option<R> {
        self.ctrl.try_access().map(|c| f(c.io()))
    }

    fn ring(&self, q: u32) {
        let _ = self
            .bar0
            .try_access_with(|bar| bar.write32((self.peer << 16) | q, BAR0_DOORBELL));
    }
}

impl SimHw {
    /// Zeroes `len` bytes of HBM at device address `dev_addr` with CPU
    /// stores through the BAR: for small ranges, much cheaper than a round
    /// trip to the device. ENODEV once unbind revoked the mapping.
    ///
    /// The range must belong to a buffer nobody can reach yet: no device
    /// op names it and no user mapping shows it.
    pub(crate) fn zero_by_cpu(&self, dev_addr: u64, len: usize) -> Result {
        let ctrl = self.ctrl.try_access().ok_or(ENODEV)?;
        let end = dev_addr.checked_add(len as u64).ok_or(EINVAL)?;
        if ctrl.hbm.is_null() || end > ctrl.wc.1 {
            return Err(EINVAL);
        }
        // SAFETY: `[dev_addr, end)` lies in the `wc.1`-byte mapping at
        // `hbm` (checked above), which the guard keeps mapped until it is
        // dropped (revocation waits for it). Nothing else writes the range:
        // the buffer it belongs to is still being allocated (see above).
        unsafe { glue::zero_io_wc(ctrl.hbm.wrapping_byte_add(dev_addr as usize), len) };
        Ok(())
    }
}

/// A buffer's HBM: its range, and where the BAR shows it.
pub(crate) struct SimMemory {
    range: HbmRange,
    hbm_phys: u64,
    p2p: usize,
}

impl SimMemory {
    pub(crate) fn new(range: HbmRange, hw: &SimHw) -> Self {
        Self {
            range,
            hbm_phys: hw.hbm_phys,
            p2p: hw.p2p,
        }
    }
}

impl DeviceMemory for SimMemory {
    fn dev_addr(&self) -> u64 {
        self.range.dev_addr()
    }

    fn pfn(&self, dev_addr: u64) -> usize {
        ((self.hbm_phys + dev_addr) >> PAGE_SHIFT) as usize
    }

    fn p2p(&self) -> P2pRange {
        P2pRange {
            provider: self.p2p as *mut core::ffi::c_void,
            phys: self.hbm_phys + self.range.dev_addr(),
        }
    }
}

/// The layout read from the header.
struct Layout {
    queues: u32,
    entries: u32,
    channels: u32,
    channel_size: u64,
    hbm_offset: u64,
    queue_offset: u64,
    queue_stride: u64,
    peer: u32,
}

/// Reads the header: `None` unless it is a ready sim device of our
/// version (any other ivshmem device). The layout it reports is not
/// checked yet (see [`Layout::check`]).
fn read_layout(io: &Mmio<HEADER_SIZE>) -> Option<Layout> {
    if io.read(HDR_MAGIC).value().get() != MAGIC
        || io.read(HDR_VERSION).value().get() != VERSION
        || io.read(HDR_READY).ready().get() != 1
    {
        return None;
    }
    Some(Layout {
        queues: io.read(HDR_NUM_QUEUES).value().get(),
        entries: io.read(HDR_RING_ENTRIES).value().get(),
        channels: io.read(HDR_NUM_CHANNELS).value().get(),
        channel_size: io.read(HDR_CHANNEL_SIZE).value().get(),
        hbm_offset: io.read(HDR_HBM_OFFSET).value().get(),
        queue_offset: io.read(HDR_QUEUE_OFFSET).value().get(),
        queue_stride: io.read(HDR_QUEUE_STRIDE).value().get(),
        peer: io.read(HDR_SIM_PEER_ID).value().get(),
    })
}

impl Layout {
    /// Checks every field the device reported (all untrusted) against the
    /// limits of `docs/sim-device.md` and a BAR2 of `bar_len` bytes, with
    /// checked arithmetic: the queue blocks lie between the header page
    /// and HBM, 8-byte aligned (the rings are accessed in 64-bit words),
    /// each big enough for its rings; HBM is page aligned and ends inside
    /// BAR2. On failure, which check failed.
    fn check(&self, bar_len: u64) -> core::result::Result<(), &'static str> {
        if !(1..=MAX_QUEUES).contains(&self.queues) {
            return Err("num_queues outside 1..=8");
        }
        if !self.entries.is_power_of_two() || !(16..=512).contains(&self.entries) {
            return Err("ring_entries not a power of two in 16..=512");
        }
        if !(1..=MAX_CHANNELS).contains(&self.channels) {
            return Err("num_channels outside 1..=16");
        }
        if self.channel_size == 0 || self.channel_size % (2 << 20) != 0 {
            return Err("channel_size not a non-zero multiple of 2 MiB");
        }
        let hbm_len = u64::from(self.channels)
            .checked_mul(self.channel_size)
            .ok_or("num_channels * channel_size overflows")?;
        if self.queue_offset < HEADER_SIZE as u64 {
            return Err("queue_offset inside the header page");
        }
        if self.queue_offset % 8 != 0 || self.queue_stride % 8 != 0 {
            return Err("queue_offset or queue_stride not a multiple of 8");
        }
        if (qr_end(self.entries) as u64) > self.queue_stride {
            return Err("queue_stride smaller than a queue block");
        }
        let queues_end = u64::from(self.queues)
            .checked_mul(self.queue_stride)
            .and_then(|len| len.checked_add(self.queue_offset))
            .ok_or("queue_offset + num_queues * queue_stride overflows")?;
        if queues_end > self.hbm_offset {
            return Err("queue blocks end past hbm_offset");
        }
        if self.hbm_offset % (1 << PAGE_SHIFT) != 0 {
            return Err("hbm_offset not page aligned");
        }
        let hbm_end = self
            .hbm_offset
            .checked_add(hbm_len)
            .ok_or("hbm_offset + HBM size overflows")?;
        if hbm_end > bar_len {
            return Err("HBM ends past BAR2");
        }
        if self.peer > 0xffff {
            return Err("sim_peer_id above 0xffff");
        }
        Ok(())
    }
}

/// Bytes of a queue block with `entries`-entry rings.
const fn qr_end(entries: u32) -> usize {
    regs::queue::CPL_RING + entries as usize * CPL_SIZE
}

/// The registered interrupt of one queue; freed on drop.
struct QueueIrq {
    irq: u32,
    ctx: KBox<IrqCtx>,
}

/// What the handlers of a queue's interrupt get.
struct IrqCtx {
    engine: Arc<SimEngine>,
    queue: u32,
}

/// Hard interrupt handler of a queue's vector: counts, wakes the thread.
///
/// # Safety
///
/// Called by the IRQ core only, with the cookie registered in
/// [`QueueIrq::request`].
unsafe extern "C" fn irq_hard(_irq: core::ffi::c_int, ctx: *mut core::ffi::c_void) -> bindings::irqreturn_t {
    // SAFETY: `ctx` is the `IrqCtx` registered with this handler, alive
    // until `free_irq` returned.
    let ctx = unsafe { &*ctx.cast::<IrqCtx>() };
    ctx.engine.count_irq(ctx.queue);
    bindings::irqreturn_IRQ_WAKE_THREAD
}

/// Threaded handler of a queue's vector: consumes its completions.
///
/// # Safety
///
/// As for [`irq_hard`].
unsafe extern "C" fn irq_thread(_irq: core::ffi::c_int, ctx: *mut core::ffi::c_void) -> bindings::irqreturn_t {
    // SAFETY: As in `irq_hard`.
    let ctx = unsafe { &*ctx.cast::<IrqCtx>() };
    ctx.engine.on_irq(ctx.queue);
    bindings::irqreturn_IRQ_HANDLED
}

impl QueueIrq {
    /// Requests MSI-X vector `queue` (allocated) for `engine`'s queue.
    fn request(pdev: &pci::Device<Core<'_>>, engine: &Arc<SimEngine>, queue: u32) -> Result<Self> {
        // SAFETY: The vectors were allocated; `pci_irq_vector` checks the
        // index.
        let irq = unsafe { bindings::pci_irq_vector(raw_pci(pdev), queue) };
        if irq < 0 {
            return Err(Error::from_errno(irq));
        }
        let ctx = KBox::new(
            IrqCtx {
                engine: engine.clone(),
                queue,
            },
            GFP_KERNEL,
        )?;
        let cookie = core::ptr::from_ref::<IrqCtx>(&ctx).cast_mut().cast();
        // SAFETY: The handlers are valid for the module's lifetime (the
        // registration is freed in drop, before the module can go), and
        // `cookie` points at `ctx`, which this object keeps until then.
        let r = unsafe {
            bindings::request_threaded_irq(
                irq as u32,
                Some(irq_hard),
                Some(irq_thread),
                0,
                c"tdrv-sim".as_char_ptr(),
                cookie,
            )
        };
        kernel::error::to_result(r)?;
        Ok(Self {
            irq: irq as u32,
            ctx,
        })
    }
}

impl Drop for QueueIrq {
    fn drop(&mut self) {
        let cookie = core::ptr::from_ref::<IrqCtx>(&self.ctx).cast_mut().cast();
        // SAFETY: Registered in `request` with this cookie; `free_irq`
        // waits for running handlers, after which `ctx` may go.
        unsafe { bindings::free_irq(self.irq, cookie) };
    }
}

/// PCI driver data of one bound sim device.
#[pin_data]
pub(crate) struct SimDevice {
    // Freed first: no handler runs once they are gone.
    irqs: KVec<QueueIrq>,
    #[pin]
    node: DeviceNode,
    _debugfs: DeviceDebugfs,
    engine: Arc<SimEngine>,
}

pub(crate) struct SimDriver;

kernel::pci_device_table!(
    SIM_PCI_TABLE,
    MODULE_SIM_PCI_TABLE,
    <SimDriver as pci::Driver>::IdInfo,
    [(pci::DeviceId::from_id(pci::Vendor::REDHAT_QUMRANET, 0x1110), ())]
);

impl pci::Driver for SimDriver {
    type IdInfo = ();
    type Data<'bound> = SimDevice;
    const ID_TABLE: pci::IdTable<Self::IdInfo> = &SIM_PCI_TABLE;

    fn probe<'bound>(
        pdev: &'bound pci::Device<Core<'_>>,
        _info: &'bound Self::IdInfo,
    ) -> impl PinInit<Self::Data<'bound>, Error> + 'bound {
        pin_init::pin_init_scope(move || {
            let params = crate::params()?;
            pdev.enable_device_mem()?;
            let bar_len = pdev.resource_len(2)?;
            // The header first, to learn the layout (and whether this is
            // ours at all).
            let layout = {
                let head = CtrlMap::new(pdev, HEADER_SIZE)?;
                read_layout(head.io()).ok_or(ENODEV)?
            };
            if let Err(why) = layout.check(bar_len) {
                let l = &layout;
                dev_err!(
                    pdev.as_ref(),
                    "sim device reports an unusable layout, not binding: {why} (num_queues {} ring_entries {} num_channels {} channel_size {:#x} hbm_offset {:#x} queue_offset {:#x} queue_stride {:#x} sim_peer_id {} BAR2 {:#x} bytes)\n",
                    l.queues,
                    l.entries,
                    l.channels,
                    l.channel_size,
                    l.hbm_offset,
                    l.queue_offset,
                    l.queue_stride,
                    l.peer,
                    bar_len
                );
                return Err(EINVAL);
            }
            let mut ctrl = CtrlMap::new(pdev, layout.hbm_offset as usize)?;
            let hbm_phys = pdev.resource_start(2)? + layout.hbm_offset;
            let hbm_len = u64::from(layout.channels) * layout.channel_size;
            glue::io_reserve_wc(hbm_phys, hbm_len)?;
            ctrl.wc = (hbm_phys, hbm_len);
            // SAFETY: `[hbm_phys, hbm_phys + hbm_len)` is in BAR2, which
            // `ctrl` holds requested, and reserved write-combined above.
            ctrl.hbm = unsafe { bindings::ioremap_wc(hbm_phys, hbm_len as usize) };
            if ctrl.hbm.is_null() {
                return Err(ENOMEM);
            }
            pdev.set_master();
            // SAFETY: No DMA mapping exists for this device yet.
            unsafe { pdev.dma_set_mask_and_coherent(DmaMask::new::<64>())? };
            let bar0 = pdev.iomap_region_sized::<BAR0_SIZE>(0, c"tdrv-sim")?;
            let hw = SimHw {
                ctrl: Devres::new(pdev.as_ref(), ctrl)?,
                bar0: bar0.into_devres()?,
                peer: layout.peer,
                hbm_phys,
                // Where the PCI topology allows, other devices (an edu
                // device below the same bridge) map buffers in HBM
                // peer-to-peer (see docs/sharing.md).
                p2p: glue::p2p_provider(pdev, 2),
            };
            // A previous binding may have stopped the device's DMA (an
            // unbind with a queue that ignored its reset): let it run.
            hw.with_ctrl(|io| io.try_write32(0, HDR_DMA_STOP))
                .ok_or(ENODEV)??;
            let mut queues = KVec::with_capacity(layout.queues as usize, GFP_KERNEL)?;
            for q in 0..layout.queues {
                let base = (layout.queue_offset + u64::from(q) * layout.queue_stride) as usize;
                let queue = KBox::pin_init(Queue::new(q, base, layout.entries), GFP_KERNEL)?;
                // Whatever a previous driver left in the rings goes.
                queue.reset(&hw)?;
                queues.push(queue, GFP_KERNEL)?;
            }
            let hbm = Hbm::new(layout.channels, layout.channel_size)?;
            let engine = SimEngine::new(hw, queues, hbm, params.sim_timeout_ms)?;
            let mut p = params;
            p.channels = layout.channels;
            // Every channel offers its size less one page (see `hbm.rs`).
            p.channel_limit = (layout.channel_size - PAGE_SIZE as u64).min(params.channel_limit);
            let backend: KBox<dyn Engine> = KBox::new(SimBackend(engine.clone()), GFP_KERNEL)?;
            let device = TdrvDevice::new(pdev.as_ref(), DEVICE_SIM, DeviceIndex::take()?, &p, backend)?;
            let debugfs = DeviceDebugfs::new(&device)?;
            pdev.alloc_irq_vectors(
                layout.queues,
                layout.queues,
                pci::IrqTypes::default().with(pci::IrqType::MsiX),
            )?;
            let mut irqs = KVec::with_capacity(layout.queues as usize, GFP_KERNEL)?;
            for q in 0..layout.queues {
                irqs.push(QueueIrq::request(pdev, &engine, q)?, GFP_KERNEL)?;
            }
            if let Err((ch, e)) = engine.zero_hbm(&device) {
                dev_warn!(
                    pdev.as_ref(),
                    "HBM channel {ch} not zeroed at probe ({e:?}): its buffers are zeroed one by one\n"
                );
            }
            dev_info!(
                pdev.as_ref(),
                "sim device bound as /dev/{}: {} queues of {} entries, {} x {} MiB HBM\n",
                device.name().to_str().unwrap_or("?"),
                layout.queues,
                layout.entries,
                layout.channels,
                layout.channel_size >> 20
            );
            Ok(try_pin_init!(SimDevice {
                irqs,
                node <- DeviceNode::new(device),
                _debugfs: debugfs,
                engine,
            }))
        })
    }

    fn unbind<'bound>(pdev: &'bound pci::Device<Core<'_>>, this: Pin<&Self::Data<'bound>>) {
        this.node.device.unbind(|| {
            // SAFETY: The device is bound (we are in its unbind), so its
            // bus-master bit may be cleared.
            unsafe { bindings::pci_clear_master(raw_pci(pdev)) };
        });
        // An ioctl racing with unbind may have queued a work item after
        // the engine's shutdown flushed them; none can be queued now that
        // the sections are drained. None may run after the module is gone.
        this.engine.flush();
    }
}

