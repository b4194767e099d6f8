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
//! Interrupts: the last descriptor of every op and of every posting batch
//! asks for one (`DESC_IRQ`), so each batch wakes the driver when it is
//! done, to finish ops or post more. The watchdog (`engine.rs`) reaps the
//! ring too, which covers a lost interrupt, and resets a queue that made
//! no progress for the timeout.
//!
//! All ring state is under the queue lock: the interrupt thread, the
//! watchdog and submitters serialise on it.

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
    prelude::*,
    sync::{
        atomic::{
            Atomic,
            Relaxed, //
        },
        Arc,
        Completion,
        Mutex, //
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
use crate::job::Job;

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
    /// A submitted job: ends through `Job::complete`.
    Job(Arc<Job>),
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
    /// 0, or the negative errno the op failed with (the first one wins).
    status: Atomic<i32>,
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
                status: Atomic::new(0),
                done <- Completion::new(),
            }),
            GFP_KERNEL,
        )
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
    /// A reset did not finish: the queue takes no more work.
    broken: bool,
}

/// What the watchdog found.
pub(crate) enum Health {
    /// No descriptor outstanding.
    Idle,
    /// Working.
    Busy,
    /// Stuck, and reset: its ops ended.
    Reset,
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
                if let OpKind::Job(job) = &op.kind {
                    if job.cancelled() && !op.emitted() {
                        op.fail(crate::uapi::ecanceled());
                    }
                }
                while free > 0 && !op.emitted() {
                    let i = op.next.load(Relaxed);
                    let d = op.descs[i];
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
                    tail = tail.wrapping_add(1);
                    free -= 1;
                }
                if !op.emitted() {
                    // Ring full: later ops wait their turn.
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
        if st.dead || st.broken {
            return Health::Idle;
        }
        let n = self.reap_locked(hw, &mut st, done);
        polled.add(u64::from(n), Relaxed);
        if st.sq_tail == st.cq_head && st.ops.is_empty() {
            return Health::Idle;
        }
        if st.progress.elapsed() < timeout {
            return Health::Busy;
        }
        let mut first = true;
        while let Some(op) = st.ops.pop_front() {
            op.fail(if first { ETIMEDOUT } else { EIO });
            first = false;
            self.load.fetch_sub(1, Relaxed);
            done.push_back(op);
        }
        if !self.reset_locked(hw, &mut st) {
            st.broken = true;
        }
        Health::Reset
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
    /// ops move to `out` (the caller fails them once DMA is off).
    pub(crate) fn stop(&self, hw: &impl Hw, out: &mut List<Op>) {
        let mut st = self.st.lock();
        if !st.dead && !st.broken && !self.reset_locked(hw, &mut st) {
            pr_warn!("tdrv-sim: queue {} did not acknowledge its reset\n", self.index);
        }
        st.dead = true;
        while let Some(op) = st.ops.pop_front() {
            self.load.fetch_sub(1, Relaxed);
            out.push_back(op);
        }
    }

    /// One debugfs line: outstanding descriptors, ops, interrupts, and
    /// the device's view (consumed descriptors, status).
    pub(crate) fn describe(&self, hw: &impl Hw, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let (outstanding, ops) = {
            let st = self.st.lock();
            (st.sq_tail.wrapping_sub(st.cq_head), self.load.load(Relaxed))
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
            "queue{}: outstanding {} ops {} irqs {} sq_head {} {}",
            self.index,
            outstanding,
            ops,
            self.irqs.load(Relaxed),
            sq_head,
            state
        )
    }
}
