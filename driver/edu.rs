// SPDX-License-Identifier: GPL-2.0

//! QEMU edu backend: a PCI driver for 1234:11e8 whose DMA engine runs
//! tdrv jobs, with completions signalled by MSI.
//!
//! How a job flows through the hardware:
//! 1. [`EduEngine::submit`] queues the job; if the engine is idle it
//!    programs the first chunk: at most `DMA_CHUNK` bytes of the source into
//!    the device's internal buffer (`DMA_SRC`/`DMA_DST`/`DMA_COUNT`, then
//!    `DMA_CMD` = run | raise_irq).
//! 2. The device finishes the transfer (QEMU delays it by ~100 ms of
//!    virtual time) and raises `IRQ_DMA` by MSI. The hard handler
//!    ([`EduEngine::handle`]) reads and acknowledges `IRQ_STATUS`, counts
//!    the interrupt, and wakes the threaded handler.
//! 3. The threaded handler ([`EduEngine::advance`]) programs the next
//!    step: the same chunk from the device buffer back to the destination
//!    buffer, then the next chunk, the next descriptor, the next job.
//! 4. When the last chunk of a job lands, the job ends through
//!    [`Job::complete`], the same completion path the software engine
//!    uses: fence counters drop, completion counts rise, waiters wake.
//!
//! A watchdog (delayed work) fails a job whose chunk the device does not
//! finish in time; the job's buffers stay referenced until the device is
//! done with them. Unbind fails every queued job with ENODEV, waits for
//! the device to stop DMA, and wakes all waiters with ENODEV.

use kernel::{
    bindings,
    device::{
        self,
        Bound,
        Core, //
    },
    devres::Devres,
    dma::{
        Device as _,
        DmaMask, //
    },
    io::Io,
    irq::{
        self,
        IrqReturn,
        ThreadedIrqReturn, //
    },
    new_mutex,
    pci,
    prelude::*,
    sync::{
        atomic::{
            Atomic,
            Relaxed, //
        },
        Arc,
        Mutex, //
    },
    time::{
        delay::fsleep,
        msecs_to_jiffies,
        Delta,
        Instant,
        Monotonic, //
    },
    workqueue::{
        impl_has_delayed_work,
        new_delayed_work,
        DelayedWork,
        WorkItem, //
    }, //
};

use crate::{
    device::{
        DeviceIndex,
        DeviceNode,
        TdrvDevice, //
    },
    edu_regs::*,
    engine::Engine,
    job::Job,
    stats::DeviceDebugfs,
    uapi::DEVICE_EDU, //
};

type Bar0 = pci::Bar<'static, BAR0_SIZE>;

/// The step of a job the device is working on.
struct Cursor {
    job: Arc<Job>,
    /// Index of the current transfer (descriptor) in the job.
    transfer: usize,
    /// Bytes of that transfer already copied to the destination.
    offset: usize,
    /// Length of the chunk in flight.
    len: usize,
    /// False while the chunk goes RAM -> device buffer, true on its way
    /// back to RAM.
    to_ram: bool,
}

struct EduState {
    /// Jobs waiting for the engine, oldest first.
    queue: KVec<Arc<Job>>,
    current: Option<Cursor>,
    /// A job failed by the watchdog while its DMA may still run: its
    /// buffers stay referenced until the device reports completion.
    orphan: Option<Arc<Job>>,
    /// When the chunk in flight was started.
    started: Option<Instant<Monotonic>>,
    stopped: bool,
}

/// The edu DMA engine and its interrupt handler state.
#[pin_data]
pub(crate) struct EduEngine {
    bar: Devres<Bar0>,
    #[pin]
    state: Mutex<EduState>,
    #[pin]
    watchdog: DelayedWork<EduEngine>,
    /// How long one chunk may take before the watchdog fails its job.
    timeout: Delta,
    pub(crate) irqs: Atomic<u64>,
    pub(crate) spurious_irqs: Atomic<u64>,
    pub(crate) watchdog_timeouts: Atomic<u64>,
}

impl_has_delayed_work! {
    impl HasDelayedWork<Self> for EduEngine { self.watchdog }
}

/// Jobs that ended while the engine lock was held, completed after it is
/// dropped: `Job::complete` takes the submitting file's tracker lock, which
/// `submit` holds while taking the engine lock.
type Finished = Option<(Arc<Job>, Result)>;

impl EduEngine {
    fn new(bar: Devres<Bar0>, timeout_ms: u32) -> Result<Arc<Self>> {
        Arc::pin_init(
            pin_init!(Self {
                bar,
                state <- new_mutex!(
                    EduState {
                        queue: KVec::new(),
                        current: None,
                        orphan: None,
                        started: None,
                        stopped: false,
                    },
                    "EduEngine::state"
                ),
                watchdog <- new_delayed_work!("EduEngine::watchdog"),
                timeout: Delta::from_millis(timeout_ms.into()),
                irqs: Atomic::new(0),
                spurious_irqs: Atomic::new(0),
                watchdog_timeouts: Atomic::new(0),
            }),
            GFP_KERNEL,
        )
    }

    pub(crate) fn submit(self: &Arc<Self>, job: Arc<Job>) -> Result {
        let mut st = self.state.lock();
        if st.stopped {
            return Err(ENODEV);
        }
        st.queue.push(job, GFP_KERNEL)?;
        if st.current.is_none() && st.orphan.is_none() {
            self.start_next(&mut st);
        }
        Ok(())
    }

    /// Starts the oldest queued job, if any.
    fn start_next(self: &Arc<Self>, st: &mut EduState) {
        if st.queue.is_empty() {
            return;
        }
        let job = st.queue.remove(0).ok();
        if let Some(job) = job {
            let len = job.transfers[0].src_range.len.min(DMA_CHUNK);
            st.current = Some(Cursor {
                job,
                transfer: 0,
                offset: 0,
                len,
                to_ram: false,
            });
            self.program(st);
        }
    }

    /// Programs the device for the step `st.current` describes and arms
    /// the watchdog.
    fn program(self: &Arc<Self>, st: &mut EduState) {
        let Some(cur) = st.current.as_ref() else {
            return;
        };
        let t = &cur.job.transfers[cur.transfer];
        let ram_src = t.src.dma_addr() + (t.src_range.start + cur.offset) as u64;
        let ram_dst = t.dst.dma_addr() + (t.dst_offset + cur.offset) as u64;
        let (src, dst) = if cur.to_ram {
            (DMA_BUFFER_ADDR, ram_dst)
        } else {
            (ram_src, DMA_BUFFER_ADDR)
        };
        let cmd = DMA_CMD::zeroed()
            .with_const_run::<1>()
            .with_const_raise_irq::<1>()
            .with_to_ram(cur.to_ram);
        let programmed = self.bar.try_access_with(|bar| {
            bar.write_reg(DMA_SRC::zeroed().with_addr(src));
            bar.write_reg(DMA_DST::zeroed().with_addr(dst));
            bar.write_reg(DMA_COUNT::zeroed().with_bytes(cur.len as u64));
            bar.write_reg(cmd);
        });
        // If the BAR is already revoked, unbind is under way and will fail
        // the job; the watchdog is not needed.
        if programmed.is_some() {
            st.started = Some(Instant::now());
            let delay = msecs_to_jiffies(self.timeout.as_millis() as u32);
            let _ = crate::engine::queue().enqueue_delayed(self.clone(), delay);
        }
    }

    /// Moves the engine one step on after a DMA completion. Returns the job
    /// that finished, if any.
    fn step(self: &Arc<Self>, st: &mut EduState) -> Finished {
        if st.orphan.take().is_some() {
            // The timed-out transfer is finally over: its buffers may go.
            self.start_next(st);
            return None;
        }
        let mut cur = st.current.take()?;
        st.started = None;
        if !cur.to_ram {
            cur.to_ram = true;
            st.current = Some(cur);
            self.program(st);
            return None;
        }
        cur.offset += cur.len;
        if cur.offset == cur.job.transfers[cur.transfer].src_range.len {
            cur.transfer += 1;
            cur.offset = 0;
        }
        if cur.transfer == cur.job.transfers.len() {
            self.start_next(st);
            return Some((cur.job, Ok(())));
        }
        let t = &cur.job.transfers[cur.transfer];
        cur.len = (t.src_range.len - cur.offset).min(DMA_CHUNK);
        cur.to_ram = false;
        st.current = Some(cur);
        self.program(st);
        None
    }

    /// Threaded interrupt work: advance the engine after a DMA completion.
    fn advance(self: &Arc<Self>) {
        let finished = {
            let mut st = self.state.lock();
            if st.stopped || (st.current.is_none() && st.orphan.is_none()) {
                // Nothing was in flight: the interrupt was not ours.
                self.spurious_irqs.add(1, Relaxed);
                return;
            }
            self.step(&mut st)
        };
        if let Some((job, result)) = finished {
            job.complete(result);
        }
    }

    /// True while the device runs a DMA transfer (or cannot be reached).
    fn dma_running(&self) -> bool {
        self.bar
            .try_access_with(|bar| bar.read(DMA_CMD).run().get() != 0)
            .unwrap_or(false)
    }

    /// True while a DMA completion interrupt is raised but not handled.
    fn dma_irq_pending(&self) -> bool {
        self.bar
            .try_access_with(|bar| bar.read(IRQ_STATUS).value().get() & IRQ_DMA != 0)
            .unwrap_or(false)
    }

    /// Watchdog: runs while a chunk is in flight.
    fn check_deadline(self: &Arc<Self>) {
        let finished = {
            let mut st = self.state.lock();
            if st.stopped {
                return;
            }
            let Some(started) = st.started else {
                return;
            };
            if started.elapsed() < self.timeout {
                // Not due yet: look again when it would be.
                let left = self.timeout - started.elapsed();
                let delay = msecs_to_jiffies(left.as_millis().max(1) as u32);
                let _ = crate::engine::queue().enqueue_delayed(self.clone(), delay);
                return;
            }
            if self.dma_irq_pending() {
                // The transfer just finished and its interrupt is on its
                // way: let the interrupt handler advance the engine.
                let _ = crate::engine::queue().enqueue_delayed(self.clone(), 1);
                None
            } else if !self.dma_running() {
                // The transfer finished but its interrupt was lost: treat
                // this as the completion.
                self.spurious_irqs.add(1, Relaxed);
                self.step(&mut st)
            } else if let Some(cur) = st.current.take() {
                // The device is stuck on this job: fail it, but keep its
                // buffers alive until the device lets go of them.
                self.watchdog_timeouts.add(1, Relaxed);
                pr_warn!("edu: job timed out after {} ms\n", self.timeout.as_millis());
                st.orphan = Some(cur.job.clone());
                st.started = Some(Instant::now());
                let delay = msecs_to_jiffies(self.timeout.as_millis() as u32);
                let _ = crate::engine::queue().enqueue_delayed(self.clone(), delay);
                Some((cur.job, Err(ETIMEDOUT)))
            } else {
                None
            }
        };
        if let Some((job, result)) = finished {
            job.complete(result);
        }
    }

    /// Stops the engine for unbind: no new jobs, every queued or running
    /// job fails with ENODEV, and the device's DMA has stopped on return.
    pub(crate) fn shutdown(&self) {
        let (current, orphan, queue) = {
            let mut st = self.state.lock();
            st.stopped = true;
            st.started = None;
            (
                st.current.take(),
                st.orphan.take(),
                core::mem::take(&mut st.queue),
            )
        };
        // Flush rather than cancel: a cancelled work item would never give
        // back the `Arc` it holds. Flushing runs a pending check at once; it
        // sees `stopped`, does nothing and does not queue itself again.
        //
        // SAFETY: `raw_as_work` points at the `work` member of the
        // initialised, pinned `struct delayed_work` in `self.watchdog`, its
        // first member, so the cast yields the `delayed_work` itself, which
        // lives as long as `self`.
        unsafe {
            bindings::flush_delayed_work(
                DelayedWork::raw_as_work(&raw const self.watchdog).cast::<bindings::delayed_work>(),
            )
        };
        // A transfer in flight may still write to its destination: wait
        // for the device (a chunk takes ~100 ms) before buffers may go.
        for _ in 0..50 {
            if !self.dma_running() {
                break;
            }
            fsleep(Delta::from_millis(20));
        }
        if let Some(cur) = current {
            cur.job.complete(Err(ENODEV));
        }
        drop(orphan);
        for job in queue {
            job.complete(Err(ENODEV));
        }
    }
}

impl WorkItem for EduEngine {
    type Pointer = Arc<EduEngine>;

    fn run(this: Arc<EduEngine>) {
        this.check_deadline();
    }
}

impl EduEngine {
    /// Hard interrupt: acknowledge, count, and hand DMA completions to the
    /// threaded handler.
    fn handle(&self, dev: &device::Device<Bound>) -> ThreadedIrqReturn {
        let Ok(bar) = self.bar.access(dev) else {
            return ThreadedIrqReturn::None;
        };
        let status = bar.read(IRQ_STATUS).value().get();
        if status == 0 {
            self.spurious_irqs.add(1, Relaxed);
            return ThreadedIrqReturn::None;
        }
        bar.write_reg(IRQ_ACK::zeroed().with_value(status));
        self.irqs.add(1, Relaxed);
        if status & IRQ_DMA == 0 {
            // Raised by someone else (IRQ_RAISE, factorial): not ours.
            self.spurious_irqs.add(1, Relaxed);
            return ThreadedIrqReturn::Handled;
        }
        ThreadedIrqReturn::WakeThread
    }
}

/// The registered interrupt handler. It wraps the engine's `Arc` because
/// advancing the engine re-arms the watchdog, which needs a reference.
pub(crate) struct EduIrq(Arc<EduEngine>);

impl irq::ThreadedHandler for EduIrq {
    fn handle(&self, dev: &device::Device<Bound>) -> ThreadedIrqReturn {
        self.0.handle(dev)
    }

    fn handle_threaded(&self, _dev: &device::Device<Bound>) -> IrqReturn {
        self.0.advance();
        IrqReturn::Handled
    }
}

/// PCI driver data of one bound edu device.
#[pin_data]
pub(crate) struct EduDevice {
    // Freed first: no interrupt handler runs once it is gone.
    #[pin]
    irq: irq::ThreadedRegistration<EduIrq>,
    #[pin]
    node: DeviceNode,
    engine: Arc<EduEngine>,
    _debugfs: DeviceDebugfs,
}

pub(crate) struct EduDriver;

// SAFETY: `pci::Vendor` is a `#[repr(transparent)]` wrapper of the `u16`
// vendor ID, and every `u16` is a valid ID (0x1234: QEMU's virtual
// devices). 7.2 has no named constant for it and no public constructor.
const VENDOR_QEMU: pci::Vendor = unsafe { core::mem::transmute::<u16, pci::Vendor>(0x1234) };

kernel::pci_device_table!(
    PCI_TABLE,
    MODULE_PCI_TABLE,
    <EduDriver as pci::Driver>::IdInfo,
    [(pci::DeviceId::from_id(VENDOR_QEMU, 0x11e8), ())]
);

/// Checks that the device answers like an edu: identification value and
/// the inverting liveness register.
fn check_alive<const SIZE: usize>(bar: &pci::Bar<'_, SIZE>) -> Result {
    let ident = bar.read(IDENT);
    if ident.into_raw() != IDENT_EDU {
        return Err(ENODEV);
    }
    for probe in [0x5a5a_a5a5u32, 0x0123_4567] {
        bar.write_reg(LIVENESS::zeroed().with_value(probe));
        if bar.read(LIVENESS).value().get() != !probe {
            return Err(EIO);
        }
    }
    Ok(())
}

impl pci::Driver for EduDriver {
    type IdInfo = ();
    type Data<'bound> = EduDevice;
    const ID_TABLE: pci::IdTable<Self::IdInfo> = &PCI_TABLE;

    fn probe<'bound>(
        pdev: &'bound pci::Device<Core<'_>>,
        _info: &'bound Self::IdInfo,
    ) -> impl PinInit<Self::Data<'bound>, Error> + 'bound {
        pin_init::pin_init_scope(move || {
            let params = crate::params()?;
            pdev.enable_device_mem()?;
            pdev.set_master();
            // SAFETY: No DMA allocation or mapping exists for this device
            // yet: the mask is set before anything else touches DMA.
            unsafe { pdev.dma_set_mask_and_coherent(DmaMask::try_new(params.edu_dma_bits)?)? };
            let bar = pdev.iomap_region_sized::<BAR0_SIZE>(0, c"tdrv-edu")?;
            check_alive(&bar)?;
            // Clear interrupt sources left over from a previous driver.
            bar.write_reg(IRQ_ACK::zeroed().with_value(u32::MAX));
            let engine = EduEngine::new(bar.into_devres()?, params.edu_timeout_ms)?;
            let device = TdrvDevice::new(
                pdev.as_ref(),
                DEVICE_EDU,
                DeviceIndex::take()?,
                params.channels,
                params.channel_limit,
                Engine::Edu(engine.clone()),
            )?;
            let debugfs = DeviceDebugfs::new(&device)?;
            let vectors =
                pdev.alloc_irq_vectors(1, 1, pci::IrqTypes::default().with(pci::IrqType::Msi))?;
            dev_info!(
                pdev.as_ref(),
                "edu bound as /dev/{} ({}-bit DMA)\n",
                device.name().to_str().unwrap_or("?"),
                params.edu_dma_bits
            );
            Ok(try_pin_init!(EduDevice {
                irq <- pdev.request_threaded_irq(
                    *vectors.start(),
                    irq::Flags::TRIGGER_NONE,
                    c"tdrv-edu",
                    Ok::<_, Error>(EduIrq(engine.clone())),
                ),
                node <- DeviceNode::new(device),
                engine,
                _debugfs: debugfs,
            }))
        })
    }

    fn unbind<'bound>(_pdev: &'bound pci::Device<Core<'_>>, this: Pin<&Self::Data<'bound>>) {
        let device = &this.node.device;
        // New work is refused from here on ...
        device.mark_unbound();
        // ... in-flight jobs fail and the device stops touching memory ...
        this.engine.shutdown();
        // ... every waiter wakes with ENODEV, and the DMA memory is freed
        // (user mappings lose their pages first).
        device.revoke_all();
    }
}
