// SPDX-License-Identifier: GPL-2.0

//! One DMA queue of the sim device: its descriptor and completion rings in
//! BAR2, the operations it runs, and its reset.
//!
//! An [`Op`] is a list of descriptors that ends as a whole: a job, or one
//! chunk of a synchronous transfer (COPY_IN, COPY_OUT, MEMSET, COPY,
//! zeroing at ALLOC). A queue runs its ops in FIFO order and posts their
//! descriptors as ring space allows: at most `ring_entries` descriptors are
//! outstanding (`sq_tail - cq_head`), so the completion ring never
//! overflows. The device executes them in order and writes one completion
//! per descriptor, in order, so the completion at `cq_head` always belongs
//! to the oldest op with descriptors outstanding. An op ends when all its
//! descriptors are posted and completed, or when it failed (a descriptor
//! completed with an error, its job was cancelled) and its posted
//! descriptors completed: the rest is never posted.
//!
//! A job's descriptors are posted at most [`JOB_AHEAD`] bytes ahead of
//! its completions, however much ring space there is: descriptors in the
//! ring run whatever happens to their job (only a reset removes them, and
//! it would take other files' work along), so this bounds what a job moves
//! after its file closed (the uapi's "chunk in flight"). Later ops of the
//! queue wait behind it, as they would in the ring.
//!
//! Interrupts: the last descriptor of every op and of every posting batch
//! asks for one (`DESC_IRQ`), so each batch wakes the driver when it is
//! done, to finish ops or post more. The watchdog (`engine.rs`) reaps the
//! ring too, which covers a lost interrupt, and resets a queue that made
//! no progress for the timeout.
//!
//! A reset the device does not acknowledge leaves the queue dead: its ops
//! fail (a job's outcome is reported, a transfer's waiter returns), but
//! the ones with descriptors in the ring become orphans that keep what
//! those descriptors name (a job's buffers, a transfer's pinned pages,
//! DMA mappings and bounce buffers) until the device acknowledges after
//! all, since until then it may still write there. The watchdog keeps
//! looking. Unbind stops the device's DMA as a whole (`HDR_DMA_STOP`,
//! which even a hung queue obeys, as a PCI device obeys bus mastering off)
//! and then releases the orphans (see `SimBackend::shutdown`).
//!
//! All ring state is under the queue lock: the interrupt thread, the
//! watchdog and submitters serialise on it.

use core::any::Any;

use kernel::{
    io::{
        Io,
        Mmio, //
    },
    list::{
        impl_list_arc_safe,
        impl_list_item,
        List,
        ListArc,
        ListLinks, //
    },
    new_mutex,
    new_spinlock,
    prelude::*,
    sync::{
        atomic::{
            Acquire,
            Atomic,
            Relaxed,
            Release, //
        },
        Arc,
        Completion,
        Mutex,
        SetOnce,
        SpinLock, //
    },
    time::{
        delay::fsleep,
        Delta,
        Instant,
        Monotonic, //
    }, //
};

use super::regs::{
    queue as qr,
    CPL_OK,
    CPL_SIZE,
    DESC_IRQ,
    DESC_SIZE,
    HEADER_SIZE, //
};
use super::engine::BufSet;
use crate::job::Job;

/// Most bytes of one job posted to the device and not yet completed (at
/// least one descriptor is always posted): what the device may still move
/// for a job after its file closed. Four descriptors of the largest size
/// keep the engine busy while the driver refills the ring.
pub(crate) const JOB_AHEAD: u64 = 64 << 20;

/// One descriptor before it is posted (the id is the ring index).
#[derive(Clone, Copy)]
pub(crate) struct Desc {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) len: u32,
    pub(crate) flags: u32,
}

/// What an op is for: how it ends.
pub(crate) enum OpKind {
    /// A job: ends through `Job::complete`. Built at SUBMIT (see
    /// `SimBackend::prepare`) with the buffers the job touches, and given
    /// the job when the engine takes it.
    Job { job: SetOnce<Arc<Job>>, set: BufSet },
    /// A synchronous transfer: ends by completing `Op::done`, which the
    /// ioctl waits for.
    Sync,
}

/// Descriptors that end together (see the module docs).
#[pin_data]
pub(crate) struct Op {
    #[pin]
    links: ListLinks,
    pub(crate) kind: OpKind,
    descs: KVec<Desc>,
    // The counters below change only under the lock of the queue running
    // the op; atomics keep them shareable without `unsafe`.
    /// Descriptors posted so far.
    next: Atomic<usize>,
    /// Posted descriptors whose completion has not been consumed.
    outstanding: Atomic<u32>,
    /// Bytes of those descriptors.
    ahead: Atomic<u64>,
    /// 0, or the negative errno the op failed with (the first one wins).
    status: Atomic<i32>,
    /// Failed by a reset the device did not acknowledge: what its
    /// descriptors name must outlive the device's interest.
    orphaned: Atomic<bool>,
    /// What a transfer's descriptors name (pinned pages, mappings, bounce
    /// buffers), handed over by its waiter if the op was orphaned.
    #[pin]
    keep: SpinLock<Option<KBox<dyn Any + Send + Sync>>>,
    #[pin]
    done: Completion,
}

impl_list_arc_safe! {
    impl ListArcSafe<0> for Op { untracked; }
}
impl_list_item! {
    impl ListItem<0> for Op { using ListLinks { self.links }; }
}

impl Op {
    pub(crate) fn new(kind: OpKind, descs: KVec<Desc>) -> Result<ListArc<Self>> {
        ListArc::pin_init(
            try_pin_init!(Self {
                links <- ListLinks::new(),
                kind,
                descs,
                next: Atomic::new(0),
                outstanding: Atomic::new(0),
                ahead: Atomic::new(0),
                status: Atomic::new(0),
                orphaned: Atomic::new(false),
                keep <- new_spinlock!(None, "SimOp::keep"),
                done <- Completion::new(),
            }),
            GFP_KERNEL,
        )
    }

    /// The job of a job's op, once the engine took it.
    pub(crate) fn job(&self) -> Option<&Arc<Job>> {
        match &self.kind {
            OpKind::Job { job, .. } => job.as_ref(),
            OpKind::Sync => None,
        }
    }

    /// The buffers a job's op touches.
    pub(crate) fn set(&self) -> Option<&BufSet> {
        match &self.kind {
            OpKind::Job { set, .. } => Some(set),
            OpKind::Sync => None,
        }
    }

    /// Fails the op with `err` unless it already failed.
    pub(crate) fn fail(&self, err: Error) {
        let _ = self.status.cmpxchg(0, err.to_errno(), Relaxed);
    }

    /// The op's outcome once it ended.
    pub(crate) fn result(&self) -> Result {
        match self.status.load(Relaxed) {
            0 => Ok(()),
            e => Err(Error::from_errno(e)),
        }
    }

    /// Nothing more of the op will be posted.
    fn emitted(&self) -> bool {
        self.next.load(Relaxed) == self.descs.len() || self.status.load(Relaxed) != 0
    }

    fn finished(&self) -> bool {
        self.emitted() && self.outstanding.load(Relaxed) == 0
    }

    /// A synchronous op ended: wake its waiter.
    pub(crate) fn signal(&self) {
        self.done.complete_all();
    }

    /// Whether a reset the device did not acknowledge failed the op (see
    /// the module docs). Set before its waiter is woken.
    pub(crate) fn orphaned(&self) -> bool {
        self.orphaned.load(Acquire)
    }

    /// Keeps `what` (memory the op's descriptors name) until the op is
    /// dropped: by the queue once the device acknowledged, or at once if it
    /// already did.
    pub(crate) fn keep(&self, what: KBox<dyn Any + Send + Sync>) {
        *self.keep.lock() = Some(what);
    }

    /// Waits (uninterruptibly: the device may still write the caller's
    /// pages until then) until a synchronous op ended. Bounded by the
    /// watchdog, which fails the op of a stuck queue, and by unbind.
    pub(crate) fn wait(&self) {
        self.done.wait_for_completion();
    }
}

/// How the queue reaches the device: the control part of BAR2 and the
/// doorbell.
pub(crate) trait Hw: Send + Sync {
    /// Runs `f` on the control registers; `None` once unbind revoked them.
    fn with_ctrl<R>(&self, f: impl FnOnce(&Mmio<HEADER_SIZE>) -> R) -> Option<R>;

    /// Rings the doorbell of queue `q`.
    fn ring(&self, q: u32);
}

struct QueueState {
    /// Ops in FIFO order; ended ones are removed.
    ops: List<Op>,
    /// Descriptors posted (our copy of `sq_tail`).
    sq_tail: u32,
    /// Completions consumed (our copy of `cq_head`).
    cq_head: u32,
    /// When the queue last made progress, or got work while idle.
    progress: Instant<Monotonic>,
    /// Unbind stopped the queue.
    dead: bool,
    /// A reset was not acknowledged: the queue takes no more work, and
    /// the device may still run what was in the ring.
    broken: bool,
    /// Ops failed by that reset whose descriptors were in the ring.
    orphans: List<Op>,
    /// Of those, how many [`Queue::take_orphans`] lent out to be reported
    /// (they are orphans still, only not in the list meanwhile).
    lent: usize,
}

/// What the watchdog found.
pub(crate) enum Health {
    /// No descriptor outstanding.
    Idle,
    /// Working.
    Busy,
    /// Stuck, and reset: its ops ended.
    Reset,
    /// Stuck, and its reset was not acknowledged: its ops failed, and the
    /// orphans among them stay with the queue (see the module docs).
    Dead,
    /// Dead, and waiting for the device to acknowledge.
    StillDead,
    /// Dead until the device acknowledged its reset now: usable again, its
    /// orphans ended.
    Revived,
}

/// One DMA queue.
#[pin_data]
pub(crate) struct Queue {
    pub(crate) index: u32,
    /// BAR2 offset of the queue block.
    base: usize,
    entries: u32,
    #[pin]
    st: Mutex<QueueState>,
    pub(crate) irqs: Atomic<u64>,
    /// Ops the queue holds (for picking the least loaded queue).
    pub(crate) load: Atomic<u32>,
    /// Held from reaping finished ops until they are ended, by whoever
    /// reaps them (the interrupt thread or the watchdog), so that a
    /// queue's ops end in the order the device finished them.
    #[pin]
    pub(crate) ending: Mutex<()>,
}

impl Queue {
    pub(crate) fn new(index: u32, base: usize, entries: u32) -> impl PinInit<Self> {
        pin_init!(Self {
            index,
            base,
            entries,
            st <- new_mutex!(
                QueueState {
                    ops: List::new(),
                    sq_tail: 0,
                    cq_head: 0,
                    progress: Instant::now(),
                    dead: false,
                    broken: false,
                    orphans: List::new(),
                    lent: 0,
                },
                "SimQueue::st"
            ),
            irqs: Atomic::new(0),
            load: Atomic::new(0),
            ending <- new_mutex!((), "SimQueue::ending"),
        })
    }

    pub(crate) fn usable(&self) -> bool {
        let st = self.st.lock();
        !st.dead && !st.broken
    }

    /// Queues `op` and posts what fits. A dead or broken queue hands the
    /// op back, failed (ENODEV or EIO), for the caller to end.
    pub(crate) fn push(&self, hw: &impl Hw, op: ListArc<Op>) -> core::result::Result<(), ListArc<Op>> {
        let mut st = self.st.lock();
        if st.dead || st.broken {
            op.fail(if st.dead { ENODEV } else { EIO });
            return Err(op);
        }
        if st.sq_tail == st.cq_head {
            st.progress = Instant::now();
        }
        st.ops.push_back(op);
        self.load.add(1, Relaxed);
        self.post(hw, &mut st);
        Ok(())
    }

    /// Posts descriptors of the queue's ops while the ring has room, then
    /// publishes `sq_tail` and rings the doorbell.
    fn post(&self, hw: &impl Hw, st: &mut QueueState) {
        if st.dead || st.broken {
            return;
        }
        let mut free = self.entries - st.sq_tail.wrapping_sub(st.cq_head);
        // The descriptor written last is held back so that it can be
        // written with DESC_IRQ once the batch is known to end there.
        let mut held: Option<(u32, Desc)> = None;
        let mut tail = st.sq_tail;
        let mut ok = true;
        let entries = self.entries;
        let base = self.base;
        let write = |io: &Mmio<HEADER_SIZE>, idx: u32, d: Desc, irq: bool| -> Result {
            let slot = base + qr::DESC_RING + (idx & entries.wrapping_sub(1)) as usize * DESC_SIZE;
            io.try_write64(d.src, slot)?;
            io.try_write64(d.dst, slot + 8)?;
            io.try_write64(u64::from(idx), slot + 16)?;
            io.try_write32(d.len, slot + 24)?;
            io.try_write32(d.flags | if irq { DESC_IRQ } else { 0 }, slot + 28)
        };
        let posted = hw.with_ctrl(|io| {
            for op in st.ops.iter() {
                let is_job = matches!(op.kind, OpKind::Job { .. });
                if let Some(job) = op.job() {
                    if job.cancelled() && !op.emitted() {
                        op.fail(crate::uapi::ecanceled());
                    }
                }
                while free > 0 && !op.emitted() {
                    let i = op.next.load(Relaxed);
                    let d = op.descs[i];
                    let ahead = op.ahead.load(Relaxed);
                    if is_job && ahead > 0 && ahead + u64::from(d.len) > JOB_AHEAD {
                        // The rest when these complete (the batch's last
                        // descriptor interrupts).
                        break;
                    }
                    if let Some((idx, h)) = held.take() {
                        ok &= write(io, idx, h, false).is_ok();
                    }
                    let last_of_op = i + 1 == op.descs.len();
                    if last_of_op {
                        ok &= write(io, tail, d, true).is_ok();
                    } else {
                        held = Some((tail, d));
                    }
                    op.next.store(i + 1, Relaxed);
                    op.outstanding.add(1, Relaxed);
                    op.ahead.add(u64::from(d.len), Relaxed);
                    tail = tail.wrapping_add(1);
                    free -= 1;
                }
                if !op.emitted() {
                    // Ring full, or the job is `JOB_AHEAD` ahead: later
                    // ops wait their turn (completions must come in the
                    // order of the ops).
                    break;
                }
            }
            if let Some((idx, h)) = held.take() {
                ok &= write(io, idx, h, true).is_ok();
            }
            if tail != st.sq_tail {
                // The descriptors are in place before the tail that
                // publishes them: MMIO writes to the same device are not
                // reordered (and `try_write32` is `writel`, which orders
                // after earlier stores).
                ok &= io.try_write32(tail, base + qr::SQ_TAIL).is_ok();
                true
            } else {
                false
            }
        });
        st.sq_tail = tail;
        match posted {
            Some(true) if ok => hw.ring(self.index),
            Some(false) => {}
            // Revoked (unbind is stopping us) or a bad offset: the
            // watchdog or unbind ends the ops.
            _ => {}
        }
    }

    /// Consumes the completions the device wrote: failed descriptors fail
    /// their op, ended ops move to `done`, and freed ring space is used.
    /// Returns how many completions were consumed.
    pub(crate) fn reap(&self, hw: &impl Hw, done: &mut List<Op>) -> u32 {
        let mut st = self.st.lock();
        self.reap_locked(hw, &mut st, done)
    }

    fn reap_locked(&self, hw: &impl Hw, st: &mut QueueState, done: &mut List<Op>) -> u32 {
        if st.dead || st.broken {
            return 0;
        }
        let entries = self.entries;
        let base = self.base;
        let mut head = st.cq_head;
        let sq_tail = st.sq_tail;
        let mut bad = false;
        let seen = hw.with_ctrl(|io| {
            let Ok(cq_tail) = io.try_read32(base + qr::CQ_TAIL) else {
                return;
            };
            // Never trust the device beyond what was posted.
            let avail = cq_tail.wrapping_sub(head).min(sq_tail.wrapping_sub(head));
            for _ in 0..avail {
                let slot = base + qr::CPL_RING + (head & entries.wrapping_sub(1)) as usize * CPL_SIZE;
                let id = io.try_read64(slot).unwrap_or(u64::MAX);
                let status = io.try_read32(slot + 8).unwrap_or(u32::MAX);
                // The oldest op with descriptors outstanding owns it.
                let Some(op) = st.ops.iter().find(|op| op.outstanding.load(Relaxed) > 0) else {
                    bad = true;
                    break;
                };
                // Its oldest posted descriptor: descriptors complete in
                // the order they were posted.
                let oldest = op.next.load(Relaxed) - op.outstanding.load(Relaxed) as usize;
                op.ahead.fetch_sub(u64::from(op.descs[oldest].len), Relaxed);
                op.outstanding.fetch_sub(1, Relaxed);
                if status != CPL_OK || id != u64::from(head) {
                    op.fail(EIO);
                }
                head = head.wrapping_add(1);
            }
            let _ = io.try_write32(head, base + qr::CQ_HEAD);
        });
        if seen.is_none() || bad {
            return 0;
        }
        let consumed = head.wrapping_sub(st.cq_head);
        st.cq_head = head;
        if consumed > 0 {
            st.progress = Instant::now();
        }
        self.take_finished(st, done);
        self.post(hw, st);
        consumed
    }

    /// Moves the ended ops at the front to `done`.
    fn take_finished(&self, st: &mut QueueState, done: &mut List<Op>) {
        let mut cursor = st.ops.cursor_front();
        while let Some(next) = cursor.peek_next() {
            if next.arc().finished() {
                done.push_back(next.remove());
                self.load.fetch_sub(1, Relaxed);
            } else {
                cursor.move_next();
            }
        }
    }

    /// Watchdog: reaps (which also recovers a lost interrupt) and resets
    /// the queue if it made no progress for `timeout`. Its running op then
    /// fails with ETIMEDOUT, the ops behind it with EIO. `polled` counts
    /// completions found here rather than by the interrupt.
    pub(crate) fn check(
        &self,
        hw: &impl Hw,
        timeout: Delta,
        done: &mut List<Op>,
        polled: &Atomic<u64>,
    ) -> Health {
        let mut st = self.st.lock();
        if st.dead {
            return Health::Idle;
        }
        if st.broken {
            return self.poll_ack(hw, &mut st, done);
        }
        let n = self.reap_locked(hw, &mut st, done);
        polled.add(u64::from(n), Relaxed);
        if st.sq_tail == st.cq_head && st.ops.is_empty() {
            return Health::Idle;
        }
        if st.progress.elapsed() < timeout {
            return Health::Busy;
        }
        let acked = self.reset_locked(hw, &mut st);
        let mut first = true;
        while let Some(op) = st.ops.pop_front() {
            op.fail(if first { ETIMEDOUT } else { EIO });
            first = false;
            self.load.fetch_sub(1, Relaxed);
            if !acked && op.outstanding.load(Relaxed) > 0 {
                // The device may still run its descriptors.
                op.orphaned.store(true, Release);
                st.orphans.push_back(op);
            } else {
                done.push_back(op);
            }
        }
        if acked {
            return Health::Reset;
        }
        st.broken = true;
        Health::Dead
    }

    /// A dead queue: if the device acknowledged its reset meanwhile, the
    /// queue is usable again and its orphans move to `done`.
    fn poll_ack(&self, hw: &impl Hw, st: &mut QueueState, done: &mut List<Op>) -> Health {
        match hw.with_ctrl(|io| io.try_read32(self.base + qr::RESET)) {
            Some(Ok(0)) => {}
            _ => return Health::StillDead,
        }
        // The device zeroed its indices with the acknowledgement.
        st.sq_tail = 0;
        st.cq_head = 0;
        st.progress = Instant::now();
        st.broken = false;
        while let Some(op) = st.orphans.pop_front() {
            done.push_back(op);
        }
        Health::Revived
    }

    /// Takes the orphans, to report them outside the queue lock (which the
    /// completion path must not hold while it takes a file's tracker lock);
    /// give them back with [`Queue::put_orphans`]. The caller holds
    /// `ending`, as every taker of the orphans does.
    pub(crate) fn take_orphans(&self) -> List<Op> {
        let mut st = self.st.lock();
        let taken = core::mem::take(&mut st.orphans);
        st.lent += taken.iter().count();
        taken
    }

    /// Gives back what [`Queue::take_orphans`] took.
    pub(crate) fn put_orphans(&self, mut orphans: List<Op>) {
        let mut st = self.st.lock();
        while let Some(op) = orphans.pop_front() {
            st.lent = st.lent.saturating_sub(1);
            st.orphans.push_back(op);
        }
    }

    /// The queue's orphans, also those lent out to be reported: a reader
    /// of the count (debugfs) must not see them gone while the watchdog
    /// reports them, since the reports wake the very waiters (a job's
    /// JOB_WAIT) that may read it next.
    fn orphan_count(st: &QueueState) -> usize {
        st.orphans.iter().count() + st.lent
    }

    /// Resets the device's queue: it discards what is pending and zeroes
    /// the indices. Waits up to a second for the device to acknowledge;
    /// false if it did not (the queue must not be used again).
    fn reset_locked(&self, hw: &impl Hw, st: &mut QueueState) -> bool {
        let start = hw.with_ctrl(|io| io.try_write32(1, self.base + qr::RESET).is_ok());
        if start != Some(true) {
            return false;
        }
        for _ in 0..1000 {
            match hw.with_ctrl(|io| io.try_read32(self.base + qr::RESET)) {
                Some(Ok(0)) => {
                    st.sq_tail = 0;
                    st.cq_head = 0;
                    st.progress = Instant::now();
                    return true;
                }
                Some(Ok(_)) => fsleep(Delta::from_millis(1)),
                _ => return false,
            }
        }
        false
    }

    /// Resets the queue at probe time (state left by a previous driver).
    pub(crate) fn reset(&self, hw: &impl Hw) -> Result {
        let mut st = self.st.lock();
        if self.reset_locked(hw, &mut st) {
            Ok(())
        } else {
            Err(EIO)
        }
    }

    /// Unbind: the queue takes no more work, the device stops it, and its
    /// ops move to `out` (the caller fails them once DMA is off). If the
    /// device does not acknowledge the reset (a dead queue gets one more
    /// try), the ops it may still write for move to `orphans` instead: the
    /// caller stops the device's DMA as a whole before it ends them.
    pub(crate) fn stop(&self, hw: &impl Hw, out: &mut List<Op>, orphans: &mut List<Op>) {
        let mut st = self.st.lock();
        let acked = !st.dead && self.reset_locked(hw, &mut st);
        st.dead = true;
        while let Some(op) = st.ops.pop_front() {
            self.load.fetch_sub(1, Relaxed);
            if !acked && op.outstanding.load(Relaxed) > 0 {
                op.orphaned.store(true, Release);
                st.orphans.push_back(op);
            } else {
                out.push_back(op);
            }
        }
        while let Some(op) = st.orphans.pop_front() {
            if acked {
                out.push_back(op);
            } else {
                op.fail(ENODEV);
                orphans.push_back(op);
            }
        }
    }

    /// Whether the device acknowledged a DMA stop on this queue (see
    /// `HDR_DMA_STOP`): it moves none of the queue's bytes any more.
    pub(crate) fn dma_off(&self, hw: &impl Hw) -> bool {
        matches!(
            hw.with_ctrl(|io| io.try_read32(self.base + qr::DMA_OFF)),
            Some(Ok(1))
        )
    }

    /// One debugfs line: outstanding descriptors, ops, interrupts, and
    /// the device's view (consumed descriptors, status).
    pub(crate) fn describe(&self, hw: &impl Hw, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let (outstanding, ops, dead, orphans) = {
            let st = self.st.lock();
            (
                st.sq_tail.wrapping_sub(st.cq_head),
                self.load.load(Relaxed),
                st.broken,
                Self::orphan_count(&st),
            )
        };
        let (sq_head, status) = hw
            .with_ctrl(|io| {
                (
                    io.try_read32(self.base + qr::SQ_HEAD).unwrap_or(0),
                    io.try_read32(self.base + qr::STATUS).unwrap_or(u32::MAX),
                )
            })
            .unwrap_or((0, u32::MAX));
        let state = match status {
            0 => "idle",
            1 => "busy",
            qr::STATUS_STALLED => "stalled",
            _ => "gone",
        };
        writeln!(
            f,
            "queue{}: outstanding {} ops {} irqs {} sq_head {} {}{} orphans {}",
            self.index,
            outstanding,
            ops,
            self.irqs.load(Relaxed),
            sq_head,
            state,
            if dead { " dead" } else { "" },
            orphans
        )
    }
}

#[kunit_tests(tdrv_sim_queue)]
mod tests {
    use super::*;

    #[test]
    fn orphans_lent_out_for_their_report_still_count() -> Result {
        let q = KBox::pin_init(Queue::new(0, 0, 16), GFP_KERNEL)?;
        let mut descs = KVec::new();
        descs.push(
            Desc {
                src: 0,
                dst: 0,
                len: 4096,
                flags: 0,
            },
            GFP_KERNEL,
        )?;
        // (Allocated before the lock: the completion path takes it.)
        let op = Op::new(OpKind::Sync, descs)?;
        q.st.lock().orphans.push_back(op);
        assert_eq!(Queue::orphan_count(&q.st.lock()), 1);
        // The watchdog reports them with the queue's lock dropped.
        let taken = q.take_orphans();
        assert_eq!(Queue::orphan_count(&q.st.lock()), 1);
        q.put_orphans(taken);
        let st = q.st.lock();
        assert_eq!((Queue::orphan_count(&st), st.lent), (1, 0));
        Ok(())
    }
}
