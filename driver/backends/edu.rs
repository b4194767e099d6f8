// SPDX-License-Identifier: GPL-2.0

//! QEMU edu backend: a PCI driver for 1234:11e8 whose DMA engine runs
//! tdrv jobs, with completions signalled by MSI.
//!
//! How a job flows through the hardware:
//! 1. [`EduBackend::submit`] queues the job; if the engine is idle it
//!    programs the first chunk: at most `DMA_CHUNK` bytes of the source,
//!    within one piece of each buffer, into the device's internal buffer
//!    (`DMA_SRC`/`DMA_DST`/`DMA_COUNT`, then `DMA_CMD` = run | raise_irq).
//! 2. The device finishes the transfer (QEMU delays it by ~100 ms of
//!    virtual time), sets `IRQ_DMA` in `IRQ_STATUS` and sends an MSI. The
//!    hard handler only counts it and wakes the threaded handler.
//! 3. The threaded handler ([`EduEngine::advance`]) consumes the status
//!    (reads and acknowledges `IRQ_STATUS` under the engine lock) and
//!    programs the next step: the same chunk from the device buffer back to
//!    the destination, then the next chunk, descriptor, job.
//! 4. When the last chunk of a job lands, the job ends through
//!    [`Job::complete`], the same completion path the software engine
//!    uses: fence counters drop, completion counts rise, waiters wake.
//!
//! A completion is consumed exactly once: only code holding the engine lock
//! acknowledges `IRQ_STATUS`, and it advances the engine by one step per
//! acknowledged completion. So the watchdog, which also looks at the
//! status (an interrupt may be late, or lost), can never advance a chunk
//! a second time; a late MSI finds the status clear and counts as spurious.
//!
//! The watchdog (delayed work) handles a chunk the device does not finish
//! in time: the running job fails with ETIMEDOUT, every queued job with
//! EIO, and the engine refuses jobs (EIO) until the device lets go of the
//! stuck transfer; then it serves jobs again. Until then the timed-out
//! job keeps its buffers and its fence marks (its destination's waiters
//! wait, and no CPU write can be overwritten by the late transfer).
//! Recoveries are counted in debugfs (`resets`).
//!
//! A file that closes takes its queued jobs back (ECANCELED), and its
//! running job stops at the next chunk. Unbind fails every job with
//! ENODEV, waits for the device to stop DMA, and clears bus mastering
//! before any memory is freed.
//!
//! Fault injection for tests (debugfs `inject`): `lose_irq` drops the next
//! completion as if its interrupt were lost; `stall` makes the next chunk
//! look stuck to the driver until the watchdog fires; `foreign_irq` makes
//! the device raise an interrupt that is not a DMA completion; `hold_job`
//! leaves the next job queued, and starts none after it, until `release`
//! (see [`engine::Hold`]).

use kernel::{
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
    list::{
        List,
        ListArc, //
    },
    new_mutex,
    pci,
    prelude::*,
    sync::{
        aref::ARef,
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

use super::edu_regs::*;
use crate::{
    uapi::ecanceled,
    device::{
        DeviceIndex,
        TdrvDevice, //
    },
    engine::{
        self,
        fail_all,
        take_jobs_of,
        take_one,
        Engine,
        EngineCounters,
        Hold, //
    },
    fence_fd::Signalling,
    job::{
        Job,
        JobTracker, //
    },
    node::DeviceNode,
    stats::DeviceDebugfs,
    uapi::DEVICE_EDU, //
};

/// The interrupt source `foreign_irq` raises (not `IRQ_DMA`).
const FOREIGN_IRQ: u32 = 0x2;

/// Shortest accepted `edu_timeout_ms`: a chunk takes about 100 ms of
/// (virtual) time, so anything shorter would fail healthy jobs.
pub(crate) const MIN_TIMEOUT_MS: u32 = 200;

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
    queue: List<Job>,
    current: Option<Cursor>,
    /// A job failed by the watchdog while its DMA may still run: its
    /// buffers stay referenced, and new jobs are refused, until the device
    /// reports the transfer over.
    orphan: Option<Arc<Job>>,
    /// When the chunk in flight was started.
    started: Option<Instant<Monotonic>>,
    /// Injected: the chunk in flight looks stuck until the watchdog fires.
    stalled: bool,
    stopped: bool,
    /// `hold_job`: the held job stays at the front of `queue`.
    hold: Hold,
}

/// The edu DMA engine and its interrupt handler state.
#[pin_data]
pub(crate) struct EduEngine {
    /// The PCI device, for log messages.
    dev: ARef<device::Device>,
    bar: Devres<Bar0>,
    #[pin]
    state: Mutex<EduState>,
    #[pin]
    watchdog: DelayedWork<EduEngine>,
    /// How long one chunk may take before the watchdog fails its job.
    timeout: Delta,
    irqs: Atomic<u64>,
    spurious_irqs: Atomic<u64>,
    watchdog_timeouts: Atomic<u64>,
    resets: Atomic<u64>,
    /// Injected faults still to apply (see the module docs).
    inject_lose_irq: Atomic<u32>,
    inject_stall: Atomic<u32>,
}

impl_has_delayed_work! {
    impl HasDelayedWork<Self> for EduEngine { self.watchdog }
}

/// Jobs that ended while the engine lock was held, completed after it is
/// dropped: `Job::complete` takes the submitting file's tracker lock, which
/// `submit` holds while taking the engine lock.
struct Finished {
    job: Option<(Arc<Job>, Result)>,
    /// A job failed by the watchdog: its outcome is reported now, its
    /// fences only when the device lets go of its buffers (`released`).
    timed_out: Option<Arc<Job>>,
    /// The timed-out job whose transfer is finally over: its fences go.
    released: Option<Arc<Job>>,
    /// Queued jobs failed by a recovery (EIO).
    failed: List<Job>,
    /// Queued jobs of closed files, found when starting the next job.
    cancelled: List<Job>,
    /// Jobs on a revoked import, never started (ENODEV).
    revoked: List<Job>,
    /// The same, found by `submit`, which refuses it.
    refused: Option<ListArc<Job>>,
}

impl Finished {
    fn new() -> Self {
        Self {
            job: None,
            timed_out: None,
            released: None,
            failed: List::new(),
            cancelled: List::new(),
            revoked: List::new(),
            refused: None,
        }
    }

    fn complete(self) {
        if let Some((job, result)) = self.job {
            job.complete(result);
        }
        if let Some(job) = self.timed_out {
            job.report(Err(ETIMEDOUT));
        }
        if let Some(job) = self.released {
            // Dropped here, after the engine lock: may free buffers.
            job.release_fences(Err(ETIMEDOUT));
        }
        fail_all(self.failed, EIO);
        fail_all(self.cancelled, ecanceled());
        fail_all(self.revoked, ENODEV);
    }
}

/// What the device says about the chunk in flight.
enum ChunkState {
    /// A completion was pending and has been consumed.
    Done,
    /// Still running.
    Running,
    /// Not running, and no completion pending: its interrupt was lost.
    Lost,
}

impl EduEngine {
    fn new(dev: &device::Device, bar: Devres<Bar0>, timeout_ms: u32) -> Result<Arc<Self>> {
        Arc::pin_init(
            pin_init!(Self {
                dev: dev.into(),
                bar,
                state <- new_mutex!(
                    EduState {
                        queue: List::new(),
                        current: None,
                        orphan: None,
                        started: None,
                        stalled: false,
                        stopped: false,
                        hold: Hold::default(),
                    },
                    "EduEngine::state"
                ),
                watchdog <- new_delayed_work!("EduEngine::watchdog"),
                timeout: Delta::from_millis(timeout_ms.into()),
                irqs: Atomic::new(0),
                spurious_irqs: Atomic::new(0),
                watchdog_timeouts: Atomic::new(0),
                resets: Atomic::new(0),
                inject_lose_irq: Atomic::new(0),
                inject_stall: Atomic::new(0),
            }),
            GFP_KERNEL,
        )
    }

    fn arm_watchdog(self: &Arc<Self>, delay_ms: u64) {
        let delay = msecs_to_jiffies(delay_ms.clamp(1, u64::from(u32::MAX)) as u32);
        let _ = engine::queue().enqueue_delayed(self.clone(), delay);
    }

    /// Starts the oldest queued job, if any. Jobs of closed files are
    /// skipped (completed with ECANCELED through `fin`) unless called from
    /// `submit`: that runs under the submitting file's tracker lock, and
    /// completing another file's job there would nest two tracker locks.
    /// Such a job then runs one chunk and is cancelled by `step`.
    fn start_next(self: &Arc<Self>, st: &mut EduState, fin: &mut Finished) {
        self.start_next_from(st, fin, true)
    }

    fn start_next_from(self: &Arc<Self>, st: &mut EduState, fin: &mut Finished, skip: bool) {
        while let Some(job) = st.queue.pop_front() {
            if skip && job.cancelled() {
                fin.cancelled.push_back(job);
                continue;
            }
            if !st.stopped && st.hold.holds(&job) {
                // `release`, or its file's `cancel`, starts the engine.
                st.queue.push_front(job);
                return;
            }
            job.start();
            if job.begin_access().is_err() {
                // An imported buffer was revoked by its exporter: ended
                // with ENODEV, never run. From `submit` (under the
                // submitting file's tracker lock, which completing it
                // takes) this is the job just submitted, as the engine
                // was idle: `submit` refuses it.
                if skip {
                    fin.revoked.push_back(job);
                    continue;
                }
                fin.refused = Some(job);
                return;
            }
            st.current = Some(Cursor {
                job: job.into_arc(),
                transfer: 0,
                offset: 0,
                len: 0,
                to_ram: false,
            });
            self.program(st);
            return;
        }
    }

    /// Starts the next job if the engine is idle (after a hold ended).
    /// Not under a tracker lock: it may skip jobs of closed files.
    fn start_idle(self: &Arc<Self>, st: &mut EduState, fin: &mut Finished) {
        if st.current.is_none() && st.orphan.is_none() && !st.stopped {
            self.start_next(st, fin);
        }
    }

    /// Programs the device for the step `st.current` describes (computing
    /// the chunk length when it starts a chunk) and arms the watchdog.
    fn program(self: &Arc<Self>, st: &mut EduState) {
        let Some(cur) = st.current.as_mut() else {
            return;
        };
        let t = &cur.job.transfers[cur.transfer];
        let (ram_src, src_left) = t.src.dma_span(t.src_range.start + cur.offset);
        let (ram_dst, dst_left) = t.dst.dma_span(t.dst_offset + cur.offset);
        if !cur.to_ram {
            // A chunk stays within one piece of each buffer.
            cur.len = (t.src_range.len - cur.offset)
                .min(DMA_CHUNK)
                .min(src_left)
                .min(dst_left);
        }
        let (src, dst) = if cur.to_ram {
            (DMA_BUFFER_ADDR, ram_dst)
        } else {
            (ram_src, DMA_BUFFER_ADDR)
        };
        let cmd = DMA_CMD::zeroed()
            .with_const_run::<1>()
            .with_const_raise_irq::<1>()
            .with_to_ram(cur.to_ram);
        let len = cur.len;
        let programmed = self.bar.try_access_with(|bar| {
            bar.write_reg(DMA_SRC::zeroed().with_addr(src));
            bar.write_reg(DMA_DST::zeroed().with_addr(dst));
            bar.write_reg(DMA_COUNT::zeroed().with_bytes(len as u64));
            bar.write_reg(cmd);
        });
        // If the BAR is already revoked, unbind is under way and will fail
        // the job; the watchdog is not needed.
        if programmed.is_some() {
            st.started = Some(Instant::now());
            if take_one(&self.inject_stall) {
                st.stalled = true;
            }
            self.arm_watchdog(self.timeout.as_millis() as u64);
        }
    }

    /// Moves the engine one step on after the chunk in flight completed.
    fn step(self: &Arc<Self>, st: &mut EduState) -> Finished {
        let mut fin = Finished::new();
        st.started = None;
        if let Some(orphan) = st.orphan.take() {
            // The timed-out transfer is finally over: its buffers may go,
            // and the engine serves jobs again.
            fin.released = Some(orphan);
            self.start_next(st, &mut fin);
            return fin;
        }
        let Some(mut cur) = st.current.take() else {
            return fin;
        };
        if !cur.to_ram {
            cur.to_ram = true;
            st.current = Some(cur);
            self.program(st);
            return fin;
        }
        cur.offset += cur.len;
        if cur.offset == cur.job.transfers[cur.transfer].src_range.len {
            cur.transfer += 1;
            cur.offset = 0;
        }
        if cur.transfer == cur.job.transfers.len() {
            self.start_next(st, &mut fin);
            fin.job = Some((cur.job, Ok(())));
            return fin;
        }
        if cur.job.cancelled() {
            // Its file closed: the chunk in flight was the last one.
            self.start_next(st, &mut fin);
            fin.job = Some((cur.job, Err(ecanceled())));
            return fin;
        }
        if cur.job.revoked() {
            // An imported buffer's exporter revoked it and waits for this
            // job to let go: no further chunk.
            self.start_next(st, &mut fin);
            fin.job = Some((cur.job, Err(ENODEV)));
            return fin;
        }
        cur.to_ram = false;
        st.current = Some(cur);
        self.program(st);
        fin
    }

    /// Reads the device's view of the chunk in flight, consuming a pending
    /// completion. Call with the engine lock held: this is the only place
    /// completions are acknowledged.
    fn chunk_state(&self, st: &mut EduState) -> ChunkState {
        let seen = self.bar.try_access_with(|bar| {
            let status = bar.read(IRQ_STATUS).value().get();
            if status != 0 {
                bar.write_reg(IRQ_ACK::zeroed().with_value(status));
            }
            (status, bar.read(DMA_CMD).run().get() != 0)
        });
        let Some((status, running)) = seen else {
            // Unbind revoked the BAR: it fails the jobs itself.
            return ChunkState::Running;
        };
        if st.stalled {
            // Injected: the device looks busy, whatever it did.
            return ChunkState::Running;
        }
        if status & IRQ_DMA != 0 {
            if take_one(&self.inject_lose_irq) {
                return ChunkState::Lost;
            }
            ChunkState::Done
        } else if running {
            ChunkState::Running
        } else {
            ChunkState::Lost
        }
    }

    /// Threaded interrupt work: advance the engine after a DMA completion.
    fn advance(self: &Arc<Self>) {
        let _signalling = Signalling::begin();
        let fin = {
            let mut st = self.state.lock();
            let busy = st.current.is_some() || st.orphan.is_some();
            match self.chunk_state(&mut st) {
                ChunkState::Done if busy && !st.stopped => self.step(&mut st),
                _ => {
                    // Nothing was in flight, or the completion was already
                    // consumed (by the watchdog): not ours to act on.
                    self.spurious_irqs.add(1, Relaxed);
                    return;
                }
            }
        };
        fin.complete();
    }

    /// Watchdog: runs while a chunk is in flight.
    fn check_deadline(self: &Arc<Self>) {
        let _signalling = Signalling::begin();
        let fin = {
            let mut st = self.state.lock();
            if st.stopped {
                return;
            }
            let Some(started) = st.started else {
                return;
            };
            let elapsed = started.elapsed();
            if elapsed < self.timeout {
                // Not due yet: look again when it would be.
                self.arm_watchdog((self.timeout - elapsed).as_millis().max(1) as u64);
                return;
            }
            match self.chunk_state(&mut st) {
                // Finished, with its interrupt late or lost: advance here;
                // the interrupt, if it comes, finds nothing to consume.
                ChunkState::Done | ChunkState::Lost => {
                    self.spurious_irqs.add(1, Relaxed);
                    self.step(&mut st)
                }
                ChunkState::Running => self.recover(&mut st),
            }
        };
        fin.complete();
    }

    /// The chunk in flight is stuck: fail its job (ETIMEDOUT) and every
    /// queued job (EIO), keep the job's buffers until the device lets go,
    /// and refuse new jobs until then.
    fn recover(self: &Arc<Self>, st: &mut EduState) -> Finished {
        let mut fin = Finished::new();
        // An injected stall ends here: the device is observed as it is
        // from now on, so the engine recovers once it is idle.
        st.stalled = false;
        if let Some(cur) = st.current.take() {
            self.watchdog_timeouts.add(1, Relaxed);
            self.resets.add(1, Relaxed);
            dev_warn!(
                self.dev,
                "DMA chunk timed out after {} ms; failing queued jobs\n",
                self.timeout.as_millis()
            );
            st.orphan = Some(cur.job.clone());
            // Its outcome now; its fences (and the destination's error
            // latch) once the device lets go of the buffers, so that no
            // CPU write can be overwritten by the late transfer.
            fin.timed_out = Some(cur.job);
            fin.failed = core::mem::take(&mut st.queue);
        }
        // Look again after another period: the orphan goes once the device
        // stops (or its completion arrives).
        st.started = Some(Instant::now());
        self.arm_watchdog(self.timeout.as_millis() as u64);
        fin
    }

    /// Applies a fault-injection command from debugfs.
    fn inject(&self, cmd: &[u8]) -> Result {
        match cmd {
            b"lose_irq" => self.inject_lose_irq.add(1, Relaxed),
            b"stall" => self.inject_stall.add(1, Relaxed),
            // An interrupt that is not a DMA completion (IRQ_RAISE with a
            // source bit tdrv never uses), as another agent could raise.
            b"foreign_irq" => self
                .bar
                .try_access_with(|bar| bar.write_reg(IRQ_RAISE::zeroed().with_value(FOREIGN_IRQ)))
                .ok_or(ENODEV)?,
            _ => return Err(EINVAL),
        }
        Ok(())
    }
}

/// The edu engine as the core sees it.
struct EduBackend(Arc<EduEngine>);

impl Engine for EduBackend {
    fn submit(&self, job: ListArc<Job>) -> Result {
        let e = &self.0;
        let fin = {
            let mut st = e.state.lock();
            if st.stopped {
                return Err(ENODEV);
            }
            if st.orphan.is_some() {
                // Recovering from a stuck transfer.
                return Err(EIO);
            }
            st.queue.push_back(job);
            let mut fin = Finished::new();
            if st.current.is_none() {
                e.start_next_from(&mut st, &mut fin, false);
            }
            fin
        };
        // Nothing to complete: `start_next_from` skipped no job.
        debug_assert!(fin.job.is_none() && fin.cancelled.is_empty() && fin.revoked.is_empty());
        if fin.refused.is_some() {
            // Never queued: the core undoes it (ENODEV for SUBMIT).
            return Err(ENODEV);
        }
        drop(fin);
        Ok(())
    }

    fn cancel(&self, tracker: &JobTracker) {
        let mut fin = Finished::new();
        let taken = {
            let mut st = self.0.state.lock();
            let taken = take_jobs_of(&mut st.queue, tracker);
            if st.hold.taken(&taken) {
                // The engine idled behind the held job: the next one goes.
                self.0.start_idle(&mut st, &mut fin);
            }
            taken
        };
        fail_all(taken, ecanceled());
        fin.complete();
    }

    fn shutdown(&self, stopped: &mut dyn FnMut()) {
        let e = &self.0;
        let (current, orphan, queue) = {
            let mut st = e.state.lock();
            st.stopped = true;
            st.started = None;
            st.hold.release();
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
        // initialised, pinned `struct delayed_work` in `watchdog`, its first
        // member, so the cast yields the `delayed_work` itself, which lives
        // as long as the engine.
        unsafe {
            kernel::bindings::flush_delayed_work(
                DelayedWork::raw_as_work(&raw const e.watchdog)
                    .cast::<kernel::bindings::delayed_work>(),
            )
        };
        // A transfer in flight may still write to its destination: wait
        // for the device (a chunk takes ~100 ms) before buffers may go.
        for _ in 0..50 {
            let running = e
                .bar
                .try_access_with(|bar| bar.read(DMA_CMD).run().get() != 0)
                .unwrap_or(false);
            if !running {
                break;
            }
            fsleep(Delta::from_millis(20));
        }
        // Bus mastering off (PCI) before any job drops a buffer: a stuck
        // transfer can no longer reach memory that is about to be freed.
        stopped();
        if let Some(cur) = current {
            cur.job.complete(Err(ENODEV));
        }
        if let Some(orphan) = orphan {
            orphan.release_fences(Err(ETIMEDOUT));
        }
        fail_all(queue, ENODEV);
    }

    fn does_dma(&self) -> bool {
        true
    }

    // A job begins its accesses when it starts (`start_next_from`) and
    // stops at the next chunk once an import is revoked (`step`); a chunk
    // is bounded by the watchdog, and a job the watchdog failed keeps its
    // accesses (its fences) until the device lets go of its buffers, which
    // a revocation then waits for (bounded too: see `dmabuf.c`).
    fn revocable_imports(&self) -> bool {
        true
    }

    fn counters(&self) -> EngineCounters {
        let e = &self.0;
        EngineCounters {
            irqs: e.irqs.load(Relaxed),
            spurious_irqs: e.spurious_irqs.load(Relaxed),
            watchdog_timeouts: e.watchdog_timeouts.load(Relaxed),
            resets: e.resets.load(Relaxed),
            polled: 0,
        }
    }

    fn inject(&self, cmd: &[u8]) -> Result {
        let e = &self.0;
        match cmd {
            b"hold_job" => e.state.lock().hold.arm(),
            b"release" => {
                let mut fin = Finished::new();
                {
                    let mut st = e.state.lock();
                    if st.hold.release() {
                        e.start_idle(&mut st, &mut fin);
                    }
                }
                fin.complete();
                Ok(())
            }
            _ => e.inject(cmd),
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
    /// Hard interrupt: count it and hand it to the threaded handler, which
    /// reads the status under the engine lock. With MSI nothing needs to
    /// be acknowledged here.
    fn handle(&self) -> ThreadedIrqReturn {
        self.irqs.add(1, Relaxed);
        ThreadedIrqReturn::WakeThread
    }
}

/// The registered interrupt handler. It wraps the engine's `Arc` because
/// advancing the engine re-arms the watchdog, which needs a reference.
pub(crate) struct EduIrq(Arc<EduEngine>);

impl irq::ThreadedHandler for EduIrq {
    fn handle(&self, _dev: &device::Device<Bound>) -> ThreadedIrqReturn {
        self.0.handle()
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
            let engine = EduEngine::new(pdev.as_ref(), bar.into_devres()?, params.edu_timeout_ms)?;
            let backend: KBox<dyn Engine> = KBox::new(EduBackend(engine.clone()), GFP_KERNEL)?;
            let device =
                TdrvDevice::new(pdev.as_ref(), DEVICE_EDU, DeviceIndex::take()?, &params, backend)?;
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
                _debugfs: debugfs,
            }))
        })
    }

    fn unbind<'bound>(pdev: &'bound pci::Device<Core<'_>>, this: Pin<&Self::Data<'bound>>) {
        // Refuse new work, fail the jobs, wait for the DMA to stop, wake
        // every waiter, then (after bus mastering is off, so that nothing
        // the device still had queued can reach memory) free every buffer.
        this.node.device.unbind(|| {
            let raw = core::ptr::from_ref(pdev).cast::<kernel::bindings::pci_dev>().cast_mut();
            // SAFETY: `pci::Device` is a `#[repr(transparent)]` wrapper of
            // `struct pci_dev`, and the device is bound (we are in its
            // unbind), so clearing its bus-master bit is allowed.
            unsafe { kernel::bindings::pci_clear_master(raw) };
        });
    }
}
