//! One queue's DMA engine: the ring protocol of docs/sim-device.md, fault
//! injection and reset. The engine runs on its own thread
//! ([`run`](crate::queue::run)), concurrently with the guest and with the
//! other queues.

use crate::dma::Desc;
use crate::dma::Memory;
use crate::layout::hdr;
use crate::layout::inject;
use crate::layout::qb;
use crate::layout::qstatus;
use crate::layout::Layout;
use crate::layout::Status;
use crate::layout::FLAG_IRQ;
use crate::log::Log;
use crate::probe::MemcpyProbe;
use crate::probe::PROBES_KEPT;
use crate::probe::PROBE_BYTES;
use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Acquire;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::Ordering::Release;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

/// Raises a queue's interrupt (MSI-X vector `q` of the guest).
pub trait Irq: Send + Sync {
    /// Raises vector `q`.
    fn raise(&self, q: u32);
}

/// What wakes a queue thread.
pub trait Doorbell: Send + Sync {
    /// Waits up to `timeout` for the doorbell; true if it rang (consuming
    /// every ring since the last wait), false on timeout.
    fn wait(&self, timeout: Duration) -> bool;
    /// Rings it from the simulator itself (to stop the thread).
    fn ring(&self);
}

/// Counters of one queue, readable while it runs.
#[derive(Default, Debug)]
pub struct QueueStats {
    /// Descriptors executed (completions written).
    pub descs: AtomicU64,
    /// Completions with status OK.
    pub ok: AtomicU64,
    /// Completions with BAD_ADDR.
    pub bad_addr: AtomicU64,
    /// Completions with BAD_DESC.
    pub bad_desc: AtomicU64,
    /// Completions with FAULT (injected FAIL_NEXT taken).
    pub fault: AtomicU64,
    /// Bytes copied.
    pub bytes: AtomicU64,
    /// Interrupts raised.
    pub irqs: AtomicU64,
    /// Interrupts dropped by LOSE_IRQ.
    pub lost_irqs: AtomicU64,
    /// Fault commands taken from inject[q] (any command).
    pub injected: AtomicU64,
    /// Times the queue stalled (STALL, or sq_tail beyond the ring).
    pub stalls: AtomicU64,
    /// Resets done.
    pub resets: AtomicU64,
    /// Doorbells seen (wakes by the doorbell).
    pub doorbells: AtomicU64,
    /// Descriptors of at least [`BIG_DESC`] bytes: the ones the time
    /// split below is kept for (`make bench`, figure 9).
    pub big_descs: AtomicU64,
    /// Bytes those descriptors copied.
    pub big_bytes: AtomicU64,
    /// Host nanoseconds they spent being read from the ring (descriptor
    /// fetch).
    pub big_fetch_ns: AtomicU64,
    /// Host nanoseconds they spent being checked and copied.
    pub big_copy_ns: AtomicU64,
    /// Host nanoseconds they spent being completed (the completion entry,
    /// the indices and the interrupt).
    pub big_complete_ns: AtomicU64,
    /// Of those descriptors, the ones copied while no other queue copied
    /// one ([`Overlap`](crate::dma::Overlap)): their bytes and copy time,
    /// the host's own copy rate.
    pub solo_descs: AtomicU64,
    /// Bytes the descriptors copied alone copied.
    pub solo_bytes: AtomicU64,
    /// Host nanoseconds they spent being checked and copied.
    pub solo_copy_ns: AtomicU64,
    /// Host memcpy probes (`inject::MEMCPY_PROBE`): the nanoseconds of
    /// each of the first [`PROBES_KEPT`], in order.
    pub probe_ns: Mutex<Vec<u64>>,
    /// Probes run in all, kept or not.
    pub probes: AtomicU64,
}

/// Descriptors from this size on get the time split of [`QueueStats`].
pub const BIG_DESC: u32 = 1 << 20;

impl QueueStats {
    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }

    fn add_probe(&self, ns: u64) {
        Self::add(&self.probes, 1);
        let mut kept = self.probe_ns.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() < PROBES_KEPT {
            kept.push(ns);
        }
    }

    /// The memcpy probes as `bytes=B probes=N ns=T1,T2,...` (the kept
    /// ones, in order), or None if there were none.
    pub fn probe_line(&self) -> Option<String> {
        let kept = self.probe_ns.lock().unwrap_or_else(|e| e.into_inner());
        if kept.is_empty() {
            return None;
        }
        let ns: Vec<String> = kept.iter().map(u64::to_string).collect();
        Some(format!(
            "bytes={PROBE_BYTES} probes={} ns={}",
            self.probes.load(Relaxed),
            ns.join(",")
        ))
    }
}

impl fmt::Display for QueueStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = |c: &AtomicU64| c.load(Relaxed);
        write!(
            f,
            "descs={} ok={} bad_addr={} bad_desc={} fault={} bytes={} irqs={} lost_irqs={} \
             injected={} stalls={} resets={} doorbells={} big_descs={} big_bytes={} \
             big_fetch_ns={} big_copy_ns={} big_complete_ns={} solo_descs={} solo_bytes={} \
             solo_copy_ns={}",
            g(&self.descs),
            g(&self.ok),
            g(&self.bad_addr),
            g(&self.bad_desc),
            g(&self.fault),
            g(&self.bytes),
            g(&self.irqs),
            g(&self.lost_irqs),
            g(&self.injected),
            g(&self.stalls),
            g(&self.resets),
            g(&self.doorbells),
            g(&self.big_descs),
            g(&self.big_bytes),
            g(&self.big_fetch_ns),
            g(&self.big_copy_ns),
            g(&self.big_complete_ns),
            g(&self.solo_descs),
            g(&self.solo_bytes),
            g(&self.solo_copy_ns)
        )
    }
}

/// The engine of queue `q`: owns sq_head and cq_tail (written through to
/// BAR2) and the armed faults.
pub struct Engine {
    q: u32,
    layout: Layout,
    mem: Arc<Memory>,
    stats: Arc<QueueStats>,
    block: usize,
    sq_head: u32,
    cq_tail: u32,
    fail_next: bool,
    lose_irq: bool,
    stalled: bool,
    /// HANG: stalled, and deaf to resets, until RESUME.
    hung: bool,
    /// RESUME: executing what was pending before answering a reset.
    draining: bool,
    /// The header's `DMA_STOP` was set when the queue last looked: it
    /// executes nothing.
    dma_off: bool,
    /// Bytes per second the engine copies at most (None: as fast as the
    /// host copies).
    rate: Option<u64>,
    /// Where the guest-triggered complaints go (rate-limited).
    log: Arc<Log>,
    /// The buffers of `inject::MEMCPY_PROBE`.
    probe: MemcpyProbe,
}

impl Engine {
    /// The engine of queue `q` of a device with layout `layout` over `mem`.
    pub fn new(q: u32, layout: Layout, mem: Arc<Memory>, stats: Arc<QueueStats>) -> Engine {
        assert!(q < layout.config.queues);
        let block = layout.queue_block(q);
        let bar = &mem.bar;
        let e = Engine {
            q,
            layout,
            stats,
            block,
            sq_head: bar.u32(block + qb::SQ_HEAD).load(Acquire),
            cq_tail: bar.u32(block + qb::CQ_TAIL).load(Acquire),
            mem,
            fail_next: false,
            lose_irq: false,
            stalled: false,
            hung: false,
            draining: false,
            dma_off: false,
            rate: None,
            log: crate::log::stderr(),
            probe: MemcpyProbe::default(),
        };
        e.set_status(qstatus::IDLE);
        e
    }

    fn field(&self, off: usize) -> &std::sync::atomic::AtomicU32 {
        self.mem.bar.u32(self.block + off)
    }

    fn set_status(&self, s: u32) {
        self.field(qb::STATUS).store(s, Release);
    }

    /// Limits the engine to `rate` bytes per second (None or 0: no limit):
    /// a descriptor's completion is written no earlier than len / rate
    /// after it started, like a DMA engine of that bandwidth.
    pub fn set_rate(&mut self, rate: Option<u64>) {
        self.rate = rate.filter(|&r| r > 0);
    }

    /// Logs to `log` instead of the process's stderr log.
    pub fn set_log(&mut self, log: Arc<Log>) {
        self.log = log;
    }

    /// Whether the queue is stalled.
    pub fn stalled(&self) -> bool {
        self.stalled
    }

    /// Whether the queue resumed from a hang and still executes what was
    /// pending then (see `inject::RESUME`).
    pub fn draining(&self) -> bool {
        self.draining
    }

    /// Handles a requested reset and takes a fault command; called on
    /// every wake and before each descriptor.
    pub fn poll_control(&mut self) {
        // The bus side of the engine: it obeys a DMA stop in every state,
        // also hung, as a PCI device obeys bus mastering off.
        let stop = self.mem.bar.u32(hdr::DMA_STOP).load(Acquire) != 0;
        if stop != self.dma_off {
            if stop {
                // What is pending names memory the driver is about to
                // free: it never runs, and no completion says otherwise.
                self.sq_head = self.field(qb::SQ_TAIL).load(Acquire);
                self.field(qb::SQ_HEAD).store(self.sq_head, Release);
            }
            self.dma_off = stop;
            // Release: after the discarded descriptors' head.
            self.field(qb::DMA_OFF).store(u32::from(stop), Release);
        }
        // A hung queue, and one still executing what it had when it
        // resumed, leaves a reset request pending.
        if !self.hung && !self.draining && self.field(qb::RESET).load(Acquire) != 0 {
            self.reset();
        }
        let cmd = self
            .mem
            .bar
            .u32(self.layout.inject(self.q))
            .swap(0, Acquire);
        if cmd != 0 {
            QueueStats::add(&self.stats.injected, 1);
            match cmd {
                inject::FAIL_NEXT => self.fail_next = true,
                inject::LOSE_IRQ => self.lose_irq = true,
                inject::STALL => self.stall(),
                inject::HANG => {
                    self.hung = true;
                    self.stall();
                }
                inject::RESUME if self.hung => {
                    self.hung = false;
                    self.stalled = false;
                    self.draining = true;
                    self.set_status(qstatus::BUSY);
                }
                inject::RESUME => {}
                inject::MEMCPY_PROBE => {
                    let ns = self.probe.run();
                    self.stats.add_probe(ns);
                }
                _ => self.log.line(format_args!(
                    "tdrv-sim: queue {}: unknown fault command {cmd} ignored",
                    self.q
                )),
            }
        }
    }

    fn stall(&mut self) {
        if !self.stalled {
            QueueStats::add(&self.stats.stalls, 1);
        }
        self.stalled = true;
        // A queue that stalls while it drains will not finish draining, so
        // it stops holding back a reset: otherwise a reset requested
        // meanwhile would never be answered, and only a simulator restart
        // would bring the queue back.
        self.draining = false;
        self.set_status(qstatus::STALLED);
    }

    /// Discards pending descriptors, clears a stall and the armed faults,
    /// zeroes the four indices, then acknowledges with reset = 0.
    fn reset(&mut self) {
        self.stalled = false;
        self.hung = false;
        self.draining = false;
        self.fail_next = false;
        self.lose_irq = false;
        self.sq_head = 0;
        self.cq_tail = 0;
        for f in [qb::SQ_TAIL, qb::SQ_HEAD, qb::CQ_TAIL, qb::CQ_HEAD] {
            self.field(f).store(0, Relaxed);
        }
        self.set_status(qstatus::IDLE);
        QueueStats::add(&self.stats.resets, 1);
        // Release: whoever sees reset == 0 sees the zeroed indices.
        self.field(qb::RESET).store(0, Release);
    }

    fn read_desc(&self, idx: u32) -> Desc {
        let o = self.layout.desc(self.q, idx);
        let bar = &self.mem.bar;
        Desc {
            src: bar.read_u64(o),
            dst: bar.read_u64(o + 8),
            id: bar.read_u64(o + 16),
            len: bar.read_u32(o + 24),
            flags: bar.read_u32(o + 28),
        }
    }

    /// Executes pending descriptors in order until the ring is empty or the
    /// queue stalls; returns how many completed. Handles control (reset,
    /// fault commands) before each one.
    pub fn service(&mut self, irq: &dyn Irq) -> u32 {
        self.service_until(irq, &AtomicBool::new(false))
    }

    /// [`service`](Self::service), but returns as soon as `stop` is set:
    /// before the next descriptor, and during the wait of a rate-limited
    /// one (whose completion is then not written). So a hang-up waits for
    /// at most the copy in flight (16 MiB), not for a full ring.
    pub fn service_until(&mut self, irq: &dyn Irq, stop: &AtomicBool) -> u32 {
        let mut done = 0;
        loop {
            if stop.load(Acquire) {
                return done;
            }
            self.poll_control();
            if self.stalled || self.dma_off {
                return done;
            }
            // Acquire: the descriptors up to sq_tail were written before it.
            let tail = self.field(qb::SQ_TAIL).load(Acquire);
            let pending = tail.wrapping_sub(self.sq_head);
            if pending == 0 {
                if self.draining {
                    // Resumed and done: now the reset, if one waits.
                    self.draining = false;
                    continue;
                }
                self.set_status(qstatus::IDLE);
                return done;
            }
            if pending > self.layout.config.ring_entries {
                self.log.line(format_args!(
                    "tdrv-sim: queue {}: sq_tail {tail} is {pending} past sq_head {} (ring of {}): \
                     stalled until reset",
                    self.q, self.sq_head, self.layout.config.ring_entries
                ));
                self.stall();
                return done;
            }
            self.set_status(qstatus::BUSY);
            let fetch = std::time::Instant::now();
            let d = self.read_desc(self.sq_head);
            let big = (d.len >= BIG_DESC).then(|| self.mem.big_copies.begin());
            let started = std::time::Instant::now();
            let (status, len_done) = if self.fail_next {
                self.fail_next = false;
                (Status::Fault, 0)
            } else {
                self.mem.execute(&d, &self.log)
            };
            let copy_end = std::time::Instant::now();
            let alone = big.is_some_and(|c| self.mem.big_copies.end(c));
            if let Some(rate) = self.rate {
                let due = Duration::from_secs_f64(f64::from(len_done) / rate as f64);
                // In slices, so that a stop is seen within one.
                while let Some(rest) = due.checked_sub(started.elapsed()) {
                    if stop.load(Acquire) {
                        return done;
                    }
                    std::thread::sleep(rest.min(STOP_SLICE));
                }
            }
            let copied = std::time::Instant::now();
            self.complete(&d, status, len_done, irq);
            if d.len >= BIG_DESC {
                let s = &self.stats;
                let ns = |a: std::time::Instant, b: std::time::Instant| (b - a).as_nanos() as u64;
                QueueStats::add(&s.big_descs, 1);
                QueueStats::add(&s.big_bytes, u64::from(len_done));
                QueueStats::add(&s.big_fetch_ns, ns(fetch, started));
                QueueStats::add(&s.big_copy_ns, ns(started, copied));
                QueueStats::add(&s.big_complete_ns, ns(copied, std::time::Instant::now()));
                if alone {
                    QueueStats::add(&s.solo_descs, 1);
                    QueueStats::add(&s.solo_bytes, u64::from(len_done));
                    QueueStats::add(&s.solo_copy_ns, ns(started, copy_end));
                }
            }
            done += 1;
        }
    }

    fn complete(&mut self, d: &Desc, status: Status, len_done: u32, irq: &dyn Irq) {
        let o = self.layout.cpl(self.q, self.cq_tail);
        let bar = &self.mem.bar;
        bar.write_u64(o, d.id);
        bar.write_u32(o + 8, status as u32);
        bar.write_u32(o + 12, len_done);
        self.cq_tail = self.cq_tail.wrapping_add(1);
        self.sq_head = self.sq_head.wrapping_add(1);
        // Release: the completion is written before cq_tail says so.
        self.field(qb::CQ_TAIL).store(self.cq_tail, Release);
        self.field(qb::SQ_HEAD).store(self.sq_head, Release);
        let s = &self.stats;
        QueueStats::add(&s.descs, 1);
        QueueStats::add(&s.bytes, u64::from(len_done));
        QueueStats::add(
            match status {
                Status::Ok => &s.ok,
                Status::BadAddr => &s.bad_addr,
                Status::BadDesc => &s.bad_desc,
                Status::Fault => &s.fault,
            },
            1,
        );
        if d.flags & FLAG_IRQ != 0 {
            if self.lose_irq {
                self.lose_irq = false;
                QueueStats::add(&s.lost_irqs, 1);
            } else {
                irq.raise(self.q);
                QueueStats::add(&s.irqs, 1);
            }
        }
    }
}

/// How long a rate-limited engine sleeps at most before it looks at the
/// stop flag again.
const STOP_SLICE: Duration = Duration::from_millis(10);

/// Writes the header of a device with layout `l` into BAR2, `ready` last.
pub fn write_header(bar: &crate::shm::Region, l: &Layout) {
    let c = &l.config;
    bar.write_u64(hdr::MAGIC, crate::layout::MAGIC);
    bar.u32(hdr::VERSION).store(crate::layout::VERSION, Relaxed);
    bar.u32(hdr::NUM_QUEUES).store(c.queues, Relaxed);
    bar.u32(hdr::RING_ENTRIES).store(c.ring_entries, Relaxed);
    bar.u32(hdr::NUM_CHANNELS).store(c.channels, Relaxed);
    bar.write_u64(hdr::CHANNEL_SIZE, c.channel_size);
    bar.write_u64(hdr::HBM_OFFSET, l.hbm_offset);
    bar.write_u64(hdr::QUEUE_OFFSET, l.queue_offset);
    bar.write_u64(hdr::QUEUE_STRIDE, l.queue_stride);
    bar.u32(hdr::SIM_PEER_ID).store(c.sim_peer_id, Relaxed);
    bar.u32(hdr::READY).store(1, Release);
}

/// The loop of a queue thread: services the ring on every doorbell, and
/// polls reset and fault commands every `poll` (so that neither needs a
/// doorbell), until `stop`.
pub fn run(mut e: Engine, bell: &dyn Doorbell, irq: &dyn Irq, stop: &AtomicBool, poll: Duration) {
    // A doorbell rung before the thread started is still in the counter.
    while !stop.load(Acquire) {
        if bell.wait(poll) {
            if stop.load(Acquire) {
                break;
            }
            QueueStats::add(&e.stats.doorbells, 1);
            e.service_until(irq, stop);
        } else {
            e.poll_control();
            if e.draining() {
                // RESUME needs no doorbell either.
                e.service_until(irq, stop);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Config;
    use crate::layout::FLAG_DST_DEV;
    use crate::layout::FLAG_SRC_DEV;
    use crate::shm::Region;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Irqs(Mutex<Vec<u32>>);
    impl Irq for Irqs {
        fn raise(&self, q: u32) {
            self.0.lock().unwrap().push(q);
        }
    }
    impl Irqs {
        fn count(&self) -> usize {
            self.0.lock().unwrap().len()
        }
    }

    /// The driver's side of the protocol, over the same Region API.
    struct Drv {
        l: Layout,
        mem: Arc<Memory>,
        q: u32,
    }

    impl Drv {
        fn new(ring_entries: u32) -> (Drv, Engine, Arc<QueueStats>) {
            let l = Config {
                queues: 2,
                ring_entries,
                channels: 1,
                channel_size: 2 << 20,
                ..Config::default()
            }
            .layout()
            .unwrap();
            let bar = Arc::new(Region::heap(l.bar_size as usize));
            write_header(&bar, &l);
            let ram = Arc::new(Region::heap(64 << 10));
            let mem = Arc::new(Memory::new(bar, &l, Some(ram)));
            let stats = Arc::new(QueueStats::default());
            let e = Engine::new(1, l, mem.clone(), stats.clone());
            (Drv { l, mem, q: 1 }, e, stats)
        }
        fn f(&self, off: usize) -> &std::sync::atomic::AtomicU32 {
            self.mem.bar.u32(self.l.queue_block(self.q) + off)
        }
        fn post(&self, d: Desc) {
            let tail = self.f(qb::SQ_TAIL).load(Relaxed);
            let o = self.l.desc(self.q, tail);
            let b = &self.mem.bar;
            b.write_u64(o, d.src);
            b.write_u64(o + 8, d.dst);
            b.write_u64(o + 16, d.id);
            b.write_u32(o + 24, d.len);
            b.write_u32(o + 28, d.flags);
            self.f(qb::SQ_TAIL).store(tail.wrapping_add(1), Release);
        }
        /// Consumes the completions: (id, status, len_done).
        fn reap(&self) -> Vec<(u64, u32, u32)> {
            let tail = self.f(qb::CQ_TAIL).load(Acquire);
            let mut head = self.f(qb::CQ_HEAD).load(Relaxed);
            let mut v = vec![];
            while head != tail {
                let o = self.l.cpl(self.q, head);
                let b = &self.mem.bar;
                v.push((b.read_u64(o), b.read_u32(o + 8), b.read_u32(o + 12)));
                head = head.wrapping_add(1);
            }
            self.f(qb::CQ_HEAD).store(head, Release);
            v
        }
        fn inject(&self, cmd: u32) {
            self.mem.bar.u32(self.l.inject(self.q)).store(cmd, Release);
        }
        fn status(&self) -> u32 {
            self.f(qb::STATUS).load(Acquire)
        }
        fn set_indices(&self, v: u32) {
            for f in [qb::SQ_TAIL, qb::SQ_HEAD, qb::CQ_TAIL, qb::CQ_HEAD] {
                self.f(f).store(v, Relaxed);
            }
        }
    }

    fn h2d(id: u64, len: u32) -> Desc {
        Desc {
            src: 0,
            dst: 0,
            id,
            len,
            flags: FLAG_DST_DEV | FLAG_IRQ,
        }
    }

    #[test]
    fn post_and_complete_in_order() {
        let (drv, mut e, stats) = Drv::new(16);
        let irqs = Irqs::default();
        assert_eq!(e.service(&irqs), 0);
        drv.mem.ram.as_ref().unwrap().write_bytes(0, b"abcdefgh");
        drv.post(h2d(10, 8));
        drv.post(Desc {
            flags: FLAG_SRC_DEV | FLAG_DST_DEV,
            dst: 100,
            ..h2d(11, 8)
        });
        drv.post(Desc {
            src: 100,
            dst: 200,
            flags: FLAG_SRC_DEV | FLAG_IRQ,
            ..h2d(12, 8)
        });
        assert_eq!(e.service(&irqs), 3);
        assert_eq!(drv.reap(), vec![(10, 0, 8), (11, 0, 8), (12, 0, 8)]);
        assert_eq!(
            drv.mem.ram.as_ref().unwrap().read_bytes(200, 8),
            b"abcdefgh"
        );
        // Only the descriptors with IRQ raised the vector, on queue 1.
        assert_eq!(*irqs.0.lock().unwrap(), vec![1, 1]);
        assert_eq!(drv.f(qb::SQ_HEAD).load(Acquire), 3);
        assert_eq!(drv.status(), qstatus::IDLE);
        assert_eq!(stats.descs.load(Relaxed), 3);
        assert_eq!(stats.bytes.load(Relaxed), 24);
        // The other queue's block is untouched.
        assert_eq!(
            drv.mem
                .bar
                .u32(drv.l.queue_block(0) + qb::CQ_TAIL)
                .load(Acquire),
            0
        );
    }

    #[test]
    fn ring_wraps_around() {
        let (drv, mut e, _) = Drv::new(16);
        let irqs = Irqs::default();
        let mut next = 0u64;
        // 5 rounds of 7 = 35 descriptors through a ring of 16.
        for _ in 0..5 {
            for _ in 0..7 {
                drv.post(h2d(next, 1));
                next += 1;
            }
            assert_eq!(e.service(&irqs), 7);
            let ids: Vec<u64> = drv.reap().into_iter().map(|c| c.0).collect();
            assert_eq!(ids, (next - 7..next).collect::<Vec<_>>());
        }
        // A full ring at once.
        for _ in 0..16 {
            drv.post(h2d(next, 1));
            next += 1;
        }
        assert_eq!(e.service(&irqs), 16);
        assert_eq!(drv.reap().len(), 16);
        assert_eq!(drv.f(qb::CQ_TAIL).load(Acquire), 51);
    }

    #[test]
    fn free_running_indices_wrap_at_u32() {
        let (drv, _, stats) = Drv::new(16);
        // The driver and the sim agree on indices near 2^32.
        let start = u32::MAX - 5;
        drv.set_indices(start);
        let mut e = Engine::new(1, drv.l, drv.mem.clone(), stats);
        let irqs = Irqs::default();
        for i in 0..12 {
            drv.post(h2d(i, 1));
        }
        assert_eq!(drv.f(qb::SQ_TAIL).load(Acquire), start.wrapping_add(12));
        assert_eq!(e.service(&irqs), 12);
        let ids: Vec<u64> = drv.reap().into_iter().map(|c| c.0).collect();
        assert_eq!(ids, (0..12).collect::<Vec<_>>());
        assert_eq!(drv.f(qb::SQ_HEAD).load(Acquire), 6);
        assert_eq!(drv.f(qb::CQ_TAIL).load(Acquire), 6);
    }

    #[test]
    fn sq_tail_beyond_the_ring_stalls_until_reset() {
        let (drv, mut e, stats) = Drv::new(16);
        drv.f(qb::SQ_TAIL).store(17, Release);
        assert_eq!(e.service(&Irqs::default()), 0);
        assert_eq!(drv.status(), qstatus::STALLED);
        assert_eq!(drv.f(qb::CQ_TAIL).load(Acquire), 0);
        assert_eq!(stats.stalls.load(Relaxed), 1);
        drv.f(qb::RESET).store(1, Release);
        e.poll_control();
        assert_eq!(drv.f(qb::RESET).load(Acquire), 0);
        assert_eq!(drv.status(), qstatus::IDLE);
        assert_eq!(drv.f(qb::SQ_TAIL).load(Acquire), 0);
    }

    #[test]
    fn errors_complete_with_their_status() {
        let (drv, mut e, stats) = Drv::new(16);
        let irqs = Irqs::default();
        drv.post(Desc {
            len: 0,
            ..h2d(1, 0)
        });
        drv.post(Desc {
            dst: 2 << 20,
            ..h2d(2, 1)
        });
        drv.post(Desc {
            src: 64 << 10,
            ..h2d(3, 1)
        });
        drv.post(Desc {
            flags: 8,
            ..h2d(4, 1)
        });
        drv.post(h2d(5, 1));
        assert_eq!(e.service(&irqs), 5);
        assert_eq!(
            drv.reap(),
            vec![(1, 2, 0), (2, 1, 0), (3, 1, 0), (4, 2, 0), (5, 0, 1)]
        );
        assert_eq!(stats.bad_desc.load(Relaxed), 2);
        assert_eq!(stats.bad_addr.load(Relaxed), 2);
        assert_eq!(stats.ok.load(Relaxed), 1);
    }

    #[test]
    fn fail_next_fails_one_descriptor_and_copies_nothing() {
        let (drv, mut e, stats) = Drv::new(16);
        let irqs = Irqs::default();
        drv.mem.ram.as_ref().unwrap().write_bytes(0, b"x");
        drv.inject(inject::FAIL_NEXT);
        drv.post(h2d(1, 1));
        drv.post(h2d(2, 1));
        assert_eq!(e.service(&irqs), 2);
        assert_eq!(drv.reap(), vec![(1, 3, 0), (2, 0, 1)]);
        assert_eq!(drv.mem.ram.as_ref().unwrap().read_bytes(0, 1), b"x");
        // The command word was taken (swapped to 0).
        assert_eq!(drv.mem.bar.u32(drv.l.inject(1)).load(Acquire), 0);
        assert_eq!(stats.fault.load(Relaxed), 1);
        assert_eq!(stats.injected.load(Relaxed), 1);
        // Both completions still raised their interrupts.
        assert_eq!(irqs.count(), 2);
    }

    #[test]
    #[cfg_attr(miri, ignore = "a 16 MiB copy takes minutes under Miri")]
    fn a_memcpy_probe_runs_before_the_next_descriptor_and_is_kept_in_order() {
        let (drv, mut e, stats) = Drv::new(16);
        let irqs = Irqs::default();
        assert_eq!(stats.probe_line(), None);
        drv.mem.ram.as_ref().unwrap().write_bytes(0, b"p");
        drv.inject(inject::MEMCPY_PROBE);
        drv.post(h2d(1, 1));
        assert_eq!(e.service(&irqs), 1);
        // The probe is not a fault: the descriptor copied and completed OK.
        assert_eq!(drv.reap(), vec![(1, 0, 1)]);
        assert_eq!(stats.probes.load(Relaxed), 1);
        assert_eq!(stats.fault.load(Relaxed), 0);
        drv.inject(inject::MEMCPY_PROBE);
        e.poll_control();
        let kept = stats.probe_ns.lock().unwrap().clone();
        assert_eq!(kept.len(), 2);
        assert!(kept.iter().all(|&ns| ns > 0), "{kept:?}");
        let line = stats.probe_line().unwrap();
        assert_eq!(
            line,
            format!("bytes={} probes=2 ns={},{}", PROBE_BYTES, kept[0], kept[1])
        );
    }

    #[test]
    fn fail_next_armed_while_idle_hits_the_next_descriptor() {
        let (drv, mut e, _) = Drv::new(16);
        let irqs = Irqs::default();
        drv.inject(inject::FAIL_NEXT);
        e.poll_control();
        drv.post(h2d(7, 1));
        e.service(&irqs);
        assert_eq!(drv.reap(), vec![(7, 3, 0)]);
    }

    #[test]
    fn stall_keeps_descriptors_pending_until_reset() {
        let (drv, mut e, stats) = Drv::new(16);
        let irqs = Irqs::default();
        drv.inject(inject::STALL);
        drv.post(h2d(1, 1));
        drv.post(h2d(2, 1));
        assert_eq!(e.service(&irqs), 0);
        assert_eq!(drv.status(), qstatus::STALLED);
        assert!(e.stalled());
        // More doorbells change nothing.
        assert_eq!(e.service(&irqs), 0);
        assert_eq!(drv.f(qb::SQ_HEAD).load(Acquire), 0);
        assert!(drv.reap().is_empty());
        assert_eq!(irqs.count(), 0);
        // Reset: pending descriptors are discarded without completions.
        drv.f(qb::RESET).store(1, Release);
        e.poll_control();
        assert_eq!(drv.f(qb::RESET).load(Acquire), 0);
        assert_eq!(drv.status(), qstatus::IDLE);
        for f in [qb::SQ_TAIL, qb::SQ_HEAD, qb::CQ_TAIL, qb::CQ_HEAD] {
            assert_eq!(drv.f(f).load(Acquire), 0);
        }
        assert!(drv.reap().is_empty());
        assert_eq!(stats.stalls.load(Relaxed), 1);
        assert_eq!(stats.resets.load(Relaxed), 1);
        // The queue works again from index 0.
        drv.post(h2d(3, 1));
        assert_eq!(e.service(&irqs), 1);
        assert_eq!(drv.reap(), vec![(3, 0, 1)]);
    }

    #[test]
    fn hang_ignores_reset_until_resume_then_executes_then_resets() {
        let (drv, mut e, stats) = Drv::new(16);
        let irqs = Irqs::default();
        drv.inject(inject::HANG);
        drv.post(h2d(1, 1));
        drv.post(h2d(2, 1));
        assert_eq!(e.service(&irqs), 0);
        assert_eq!(drv.status(), qstatus::STALLED);
        // The driver gives up: a reset, not answered.
        drv.f(qb::RESET).store(1, Release);
        e.poll_control();
        assert_eq!(e.service(&irqs), 0);
        assert_eq!(drv.f(qb::RESET).load(Acquire), 1);
        assert!(drv.reap().is_empty());
        // RESUME: what was pending runs (late writes), then the reset.
        drv.inject(inject::RESUME);
        assert_eq!(e.service(&irqs), 2);
        assert_eq!(drv.f(qb::RESET).load(Acquire), 0);
        assert_eq!(drv.status(), qstatus::IDLE);
        assert_eq!(stats.resets.load(Relaxed), 1);
        assert!(!e.stalled() && !e.draining());
        // RESUME of a queue that does not hang does nothing.
        drv.inject(inject::RESUME);
        drv.post(h2d(3, 1));
        assert_eq!(e.service(&irqs), 1);
        assert_eq!(drv.reap(), vec![(3, 0, 1)]);
    }

    fn set_dma_stop(drv: &Drv, on: bool) {
        drv.mem.bar.u32(hdr::DMA_STOP).store(u32::from(on), Release);
    }

    #[test]
    fn dma_stop_discards_what_is_pending_and_moves_nothing_until_cleared() {
        let (drv, mut e, _) = Drv::new(16);
        let irqs = Irqs::default();
        let ram = drv.mem.ram.as_ref().unwrap();
        ram.write_bytes(0, b"x");
        // Device to host: a late write would change RAM byte 100.
        let d2h = |id| Desc {
            src: 0,
            dst: 100,
            id,
            len: 1,
            flags: FLAG_SRC_DEV | FLAG_IRQ,
        };
        drv.mem.bar.write_bytes(drv.l.hbm_offset, b"L");
        drv.post(d2h(1));
        drv.post(d2h(2));
        set_dma_stop(&drv, true);
        assert_eq!(e.service(&irqs), 0);
        assert_eq!(drv.f(qb::DMA_OFF).load(Acquire), 1);
        assert_eq!(drv.f(qb::SQ_HEAD).load(Acquire), 2, "pending discarded");
        assert!(drv.reap().is_empty(), "no completion for discarded work");
        // New work while stopped does not run either.
        drv.post(d2h(3));
        assert_eq!(e.service(&irqs), 0);
        assert_eq!(ram.read_bytes(100, 1), b"\0");
        assert_eq!(irqs.count(), 0);
        // Cleared: the queue says so, and a reset restarts it.
        set_dma_stop(&drv, false);
        assert!(reset_answered(&drv, &mut e, &irqs));
        assert_eq!(drv.f(qb::DMA_OFF).load(Acquire), 0);
        drv.post(d2h(4));
        assert_eq!(e.service(&irqs), 1);
        assert_eq!(drv.reap(), vec![(4, 0, 1)]);
        assert_eq!(ram.read_bytes(100, 1), b"L");
    }

    #[test]
    fn hung_queue_obeys_dma_stop_and_runs_nothing_of_it_after_resume() {
        let (drv, mut e, _) = Drv::new(16);
        let irqs = Irqs::default();
        let ram = drv.mem.ram.as_ref().unwrap();
        drv.mem.bar.write_bytes(drv.l.hbm_offset, b"L");
        drv.inject(inject::HANG);
        drv.post(Desc {
            src: 0,
            dst: 100,
            id: 1,
            len: 1,
            flags: FLAG_SRC_DEV | FLAG_IRQ,
        });
        assert_eq!(e.service(&irqs), 0);
        // The driver gives up on the reset, then stops DMA: a hung queue
        // acknowledges that.
        drv.f(qb::RESET).store(1, Release);
        set_dma_stop(&drv, true);
        e.poll_control();
        assert_eq!(drv.f(qb::DMA_OFF).load(Acquire), 1);
        assert_eq!(drv.f(qb::RESET).load(Acquire), 1, "still deaf to the reset");
        // It wakes up: the discarded descriptor never runs.
        drv.inject(inject::RESUME);
        assert_eq!(e.service(&irqs), 0);
        assert_eq!(ram.read_bytes(100, 1), b"\0");
        // A driver bound again clears the stop and resets the queue.
        set_dma_stop(&drv, false);
        assert!(reset_answered(&drv, &mut e, &irqs));
        assert!(drv.reap().is_empty());
        assert_eq!(ram.read_bytes(100, 1), b"\0");
    }

    /// Requests a reset and services the queue; true if it was answered.
    fn reset_answered(drv: &Drv, e: &mut Engine, irqs: &Irqs) -> bool {
        drv.f(qb::RESET).store(1, Release);
        e.service(irqs);
        drv.f(qb::RESET).load(Acquire) == 0
    }

    #[test]
    fn resumed_queue_with_a_bad_sq_tail_still_answers_a_reset() {
        let (drv, mut e, _) = Drv::new(16);
        let irqs = Irqs::default();
        drv.inject(inject::HANG);
        drv.post(h2d(1, 1));
        assert_eq!(e.service(&irqs), 0);
        // The driver gives up on the hung queue and asks for a reset.
        drv.f(qb::RESET).store(1, Release);
        // A sq_tail far past the ring, then RESUME: the drain stalls.
        drv.f(qb::SQ_TAIL).store(1000, Release);
        drv.inject(inject::RESUME);
        assert_eq!(e.service(&irqs), 0);
        // The pending reset is answered on the next wake.
        e.service(&irqs);
        assert_eq!(drv.f(qb::RESET).load(Acquire), 0);
        assert_eq!(drv.status(), qstatus::IDLE);
        assert!(!e.stalled() && !e.draining());
        drv.post(h2d(2, 1));
        assert_eq!(e.service(&irqs), 1);
        assert_eq!(drv.reap(), vec![(2, 0, 1)]);
    }

    #[test]
    fn stall_while_draining_still_answers_a_reset() {
        let (drv, mut e, _) = Drv::new(16);
        let irqs = Irqs::default();
        drv.inject(inject::HANG);
        drv.post(h2d(1, 1));
        drv.post(h2d(2, 1));
        assert_eq!(e.service(&irqs), 0);
        drv.inject(inject::RESUME);
        e.poll_control();
        assert!(e.draining());
        // STALL while it drains: nothing more runs.
        drv.inject(inject::STALL);
        assert_eq!(e.service(&irqs), 0);
        assert!(e.stalled() && !e.draining());
        assert!(reset_answered(&drv, &mut e, &irqs));
        assert_eq!(drv.status(), qstatus::IDLE);
        drv.post(h2d(3, 1));
        assert_eq!(e.service(&irqs), 1);
        assert_eq!(drv.reap(), vec![(3, 0, 1)]);
    }

    /// Random storms of every fault command, bad sq_tails, posts and
    /// resets: whatever came before, a driver that resumes a hung queue
    /// and then asks for a reset gets it answered, and the queue runs
    /// the next descriptor.
    #[test]
    fn random_storms_always_end_in_an_answered_reset() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for round in 0..500 {
            let (drv, mut e, _) = Drv::new(16);
            let irqs = Irqs::default();
            let mut id = 1;
            for _ in 0..(1 + next(40)) {
                match next(9) {
                    0 => drv.inject(inject::STALL),
                    1 => drv.inject(inject::HANG),
                    2 => drv.inject(inject::RESUME),
                    3 => drv.inject(inject::FAIL_NEXT),
                    4 => drv.inject(inject::LOSE_IRQ),
                    5 => drv
                        .f(qb::SQ_TAIL)
                        .store(next(u64::from(u32::MAX)) as u32, Release),
                    6 => drv.f(qb::RESET).store(1, Release),
                    _ => {
                        let tail = drv.f(qb::SQ_TAIL).load(Relaxed);
                        let head = drv.f(qb::SQ_HEAD).load(Relaxed);
                        if tail.wrapping_sub(head) < 16 {
                            drv.post(h2d(id, 1));
                            id += 1;
                        }
                    }
                }
                if next(2) == 0 {
                    e.service(&irqs);
                }
                drv.reap();
            }
            // The recovery the driver performs: RESUME (a no-op unless
            // hung), then a reset.
            drv.inject(inject::RESUME);
            e.service(&irqs);
            assert!(
                reset_answered(&drv, &mut e, &irqs),
                "round {round}: reset not answered"
            );
            assert_eq!(drv.status(), qstatus::IDLE, "round {round}");
            drv.post(h2d(u64::MAX, 1));
            assert_eq!(e.service(&irqs), 1, "round {round}");
            assert_eq!(drv.reap(), vec![(u64::MAX, 0, 1)], "round {round}");
        }
    }

    #[test]
    fn stall_between_descriptors() {
        let (drv, mut e, _) = Drv::new(16);
        let irqs = Irqs::default();
        drv.post(h2d(1, 1));
        assert_eq!(e.service(&irqs), 1);
        drv.inject(inject::STALL);
        drv.post(h2d(2, 1));
        assert_eq!(e.service(&irqs), 0);
        assert_eq!(drv.reap(), vec![(1, 0, 1)]);
        assert_eq!(drv.status(), qstatus::STALLED);
    }

    #[test]
    fn lose_irq_drops_one_interrupt_but_writes_the_completion() {
        let (drv, mut e, stats) = Drv::new(16);
        let irqs = Irqs::default();
        drv.inject(inject::LOSE_IRQ);
        // A descriptor without IRQ does not use up the lost interrupt.
        drv.post(Desc {
            flags: FLAG_DST_DEV,
            ..h2d(1, 1)
        });
        drv.post(h2d(2, 1));
        drv.post(h2d(3, 1));
        assert_eq!(e.service(&irqs), 3);
        assert_eq!(drv.reap(), vec![(1, 0, 1), (2, 0, 1), (3, 0, 1)]);
        assert_eq!(irqs.count(), 1);
        assert_eq!(stats.lost_irqs.load(Relaxed), 1);
        assert_eq!(stats.irqs.load(Relaxed), 1);
    }

    #[test]
    fn reset_clears_armed_faults() {
        let (drv, mut e, _) = Drv::new(16);
        let irqs = Irqs::default();
        drv.inject(inject::FAIL_NEXT);
        e.poll_control();
        drv.inject(inject::LOSE_IRQ);
        e.poll_control();
        drv.f(qb::RESET).store(1, Release);
        e.poll_control();
        drv.post(h2d(1, 1));
        e.service(&irqs);
        assert_eq!(drv.reap(), vec![(1, 0, 1)]);
        assert_eq!(irqs.count(), 1);
    }

    #[test]
    fn a_rate_limit_paces_the_copies() {
        let (drv, mut e, _) = Drv::new(16);
        // 64 KiB at 1 MiB/s: at least 62.5 ms.
        e.set_rate(Some(1 << 20));
        drv.post(h2d(1, 32 << 10));
        drv.post(h2d(2, 32 << 10));
        let t0 = std::time::Instant::now();
        assert_eq!(e.service(&Irqs::default()), 2);
        assert!(
            t0.elapsed() >= Duration::from_micros(62_500),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!(drv.reap(), vec![(1, 0, 32 << 10), (2, 0, 32 << 10)]);
        // No limit again.
        e.set_rate(Some(0));
        drv.post(h2d(3, 32 << 10));
        assert_eq!(e.service(&Irqs::default()), 1);
    }

    #[test]
    fn unknown_fault_commands_are_ignored() {
        let (drv, mut e, stats) = Drv::new(16);
        drv.inject(99);
        drv.post(h2d(1, 1));
        assert_eq!(e.service(&Irqs::default()), 1);
        assert_eq!(drv.reap(), vec![(1, 0, 1)]);
        assert_eq!(stats.injected.load(Relaxed), 1);
        assert_eq!(drv.mem.bar.u32(drv.l.inject(1)).load(Acquire), 0);
    }

    #[test]
    fn a_flood_of_bad_commands_and_index_stalls_logs_a_bounded_amount() {
        let (drv, mut e, stats) = Drv::new(16);
        let cap = crate::log::Captured::default();
        // A window longer than the test: only the burst may pass.
        e.set_log(Arc::new(Log::new(
            Box::new(cap.clone()),
            Duration::from_secs(3600),
            5,
        )));
        let n = if cfg!(miri) { 50 } else { 20_000 };
        for i in 0..n {
            drv.inject(1000 + i);
            e.poll_control();
            // sq_tail beyond the ring, then reset, over and over.
            drv.f(qb::SQ_TAIL).store(17, Release);
            assert_eq!(e.service(&Irqs::default()), 0);
            drv.f(qb::RESET).store(1, Release);
            e.poll_control();
        }
        assert_eq!(stats.injected.load(Relaxed), u64::from(n));
        assert_eq!(stats.stalls.load(Relaxed), u64::from(n));
        let text = cap.text();
        assert_eq!(text.lines().count(), 5, "{text}");
        assert!(
            text.contains("unknown fault command 1000 ignored"),
            "{text}"
        );
        assert!(text.contains("past sq_head"), "{text}");
        // Everything else was counted, not written.
        assert_eq!(e.log.suppressed_total(), 2 * u64::from(n) - 5);
    }

    /// Sets a stop flag when the first interrupt is raised.
    struct StopOnIrq(Arc<AtomicBool>, Irqs);
    impl Irq for StopOnIrq {
        fn raise(&self, q: u32) {
            self.0.store(true, Release);
            self.1.raise(q);
        }
    }

    #[test]
    fn stop_ends_service_before_the_next_descriptor() {
        let (drv, mut e, stats) = Drv::new(16);
        for i in 0..16 {
            drv.post(h2d(i, 4096));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let irq = StopOnIrq(stop.clone(), Irqs::default());
        // The first completion's interrupt asks to stop: the other 15 stay
        // pending instead of being copied before the thread can go.
        assert_eq!(e.service_until(&irq, &stop), 1);
        assert_eq!(drv.reap(), vec![(0, 0, 4096)]);
        assert_eq!(drv.f(qb::SQ_HEAD).load(Acquire), 1);
        assert_eq!(stats.descs.load(Relaxed), 1);
        // Without a stop, the rest runs.
        assert_eq!(e.service(&Irqs::default()), 15);
    }

    #[test]
    fn stop_interrupts_the_wait_of_a_rate_limited_copy() {
        let (drv, mut e, stats) = Drv::new(16);
        // 4 KiB at 1 byte/s: more than an hour per descriptor.
        e.set_rate(Some(1));
        drv.post(h2d(1, 4096));
        drv.post(h2d(2, 4096));
        let bell = Arc::new(Bell::default());
        bell.ring();
        let t = Thread::start(e, bell);
        while drv.status() != qstatus::BUSY {
            std::thread::yield_now();
        }
        // Returns only once the thread has ended (a hang fails the test
        // through the harness).
        let irqs = t.stop();
        assert_eq!(irqs.count(), 0);
        assert!(drv.reap().is_empty());
        assert_eq!(stats.descs.load(Relaxed), 0);
    }

    /// A doorbell for the threaded tests: a counter under a mutex.
    #[derive(Default)]
    struct Bell {
        rung: Mutex<u32>,
        cv: std::sync::Condvar,
    }
    impl Doorbell for Bell {
        fn wait(&self, timeout: Duration) -> bool {
            let g = self.rung.lock().unwrap();
            let (mut g, _) = self.cv.wait_timeout_while(g, timeout, |n| *n == 0).unwrap();
            let rang = *g > 0;
            *g = 0;
            rang
        }
        fn ring(&self) {
            *self.rung.lock().unwrap() += 1;
            self.cv.notify_all();
        }
    }

    /// An engine thread under test, with its doorbell and interrupt log.
    struct Thread {
        irqs: Arc<Irqs>,
        bell: Arc<Bell>,
        stop: Arc<AtomicBool>,
        t: std::thread::JoinHandle<()>,
    }

    impl Thread {
        /// Starts `run` on `e`, polling every millisecond; `bell` may have
        /// been rung already.
        fn start(e: Engine, bell: Arc<Bell>) -> Self {
            let irqs = Arc::new(Irqs::default());
            let stop = Arc::new(AtomicBool::new(false));
            let t = {
                let (irqs, bell, stop) = (irqs.clone(), bell.clone(), stop.clone());
                std::thread::spawn(move || run(e, &*bell, &*irqs, &stop, Duration::from_millis(1)))
            };
            Self {
                irqs,
                bell,
                stop,
                t,
            }
        }

        /// Stops the thread; returns its interrupt log.
        fn stop(self) -> Arc<Irqs> {
            self.stop.store(true, Release);
            self.bell.ring();
            self.t.join().unwrap();
            self.irqs
        }
    }

    #[test]
    fn engine_thread_runs_concurrently_with_the_driver() {
        let (drv, e, stats) = Drv::new(16);
        let bell = Arc::new(Bell::default());
        let t = Thread::start(e, bell.clone());
        let total = if cfg!(miri) { 40 } else { 2000 };
        let (mut posted, mut seen) = (0u64, 0u64);
        while seen < total {
            // Never more than ring_entries outstanding.
            let outstanding = drv
                .f(qb::SQ_TAIL)
                .load(Relaxed)
                .wrapping_sub(drv.f(qb::CQ_HEAD).load(Relaxed));
            if posted < total && outstanding < 16 {
                drv.post(h2d(posted, 1));
                posted += 1;
                bell.ring();
            }
            for (id, st, _) in drv.reap() {
                assert_eq!((id, st), (seen, 0));
                seen += 1;
            }
            std::thread::yield_now();
        }
        let irqs = t.stop();
        assert_eq!(stats.descs.load(Relaxed), total);
        assert_eq!(irqs.count() as u64, total);
    }

    #[test]
    fn engine_thread_runs_descriptors_only_after_a_doorbell() {
        let (drv, e, stats) = Drv::new(16);
        let bell = Arc::new(Bell::default());
        let t = Thread::start(e, bell.clone());
        drv.post(h2d(1, 1));
        // Several idle polls pass without executing it.
        std::thread::sleep(Duration::from_millis(20));
        assert!(drv.reap().is_empty());
        bell.ring();
        let mut got = vec![];
        while got.is_empty() {
            got = drv.reap();
            std::thread::yield_now();
        }
        assert_eq!(got, vec![(1, 0, 1)]);
        t.stop();
        // The stop ring is not counted as a doorbell.
        assert_eq!(stats.doorbells.load(Relaxed), 1);
    }

    #[test]
    fn engine_thread_takes_reset_without_a_doorbell() {
        let (drv, e, _) = Drv::new(16);
        let bell = Arc::new(Bell::default());
        drv.inject(inject::STALL);
        drv.post(h2d(1, 1));
        bell.ring();
        let t = Thread::start(e, bell);
        while drv.status() != qstatus::STALLED {
            std::thread::yield_now();
        }
        drv.f(qb::RESET).store(1, Release);
        while drv.f(qb::RESET).load(Acquire) != 0 {
            std::thread::yield_now();
        }
        assert_eq!(drv.status(), qstatus::IDLE);
        assert_eq!(drv.f(qb::SQ_TAIL).load(Acquire), 0);
        let irqs = t.stop();
        assert_eq!(irqs.count(), 0);
    }
}
