// SPDX-License-Identifier: GPL-2.0

//! Completion events of a file's jobs (`TDRV_IOC_JOB_NOTIFY`,
//! `TDRV_SUBMIT_NOTIFY`, `read(2)`, `poll(2)`): how a process waits for many
//! jobs with one fd, on every kernel (no `sync_file` needed).
//!
//! Ready events wait in a ring of plain [`uapi::Event`] values, oldest
//! first, which `read(2)` copies out. Room in the ring is taken when an
//! event is asked for ([`EventRoom::take`], in the caller's context, with
//! no lock held), so that the job's end only writes the event into room
//! already there: the completion path allocates nothing and takes no lock
//! but the file's job tracker lock it already holds (a dma-fence
//! signalling path, see `docs/fence-fds.md`). An event asked for in SUBMIT
//! is carried by its job until it ends: nothing is allocated per event.
//! One asked for with JOB_NOTIFY for a job still running is allocated (a
//! [`JobEvent`]) and parked at its job's slot (`id % EVENT_SLOTS`) until
//! the job ends. The ring starts empty and doubles when full, in the
//! caller's context; the table of slots (8 bytes per slot) is allocated at
//! the file's first JOB_NOTIFY: files that never ask pay nothing.
//!
//! Events are kernel memory a caller can ask for without doing any work
//! (any number of JOB_NOTIFYs of one ended job), and a memory cgroup
//! bounds them only where `memory.max` is set. So they are bounded twice:
//! per file (`file_max_events`, by default `TDRV_JOB_WINDOW`: an event for
//! each job whose status a file can still ask for) and per device
//! (`device_max_events`, an [`EventBudget`] shared by its files), so that
//! many files cannot add up to more than the device's budget.
//!
//! [`EventRoom`] counts a file's events (lock-free); [`EventQueue`] is the
//! ring and the parked events, kept under the tracker lock by `job.rs`; it
//! never sleeps or allocates except in [`EventQueue::new_table`],
//! [`EventRing::new`] and [`JobEvent::new`], which callers run before
//! taking the lock.

use kernel::{
    list::{
        impl_list_arc_safe,
        impl_list_item,
        List,
        ListArc,
        ListLinks, //
    },
    prelude::*,
    sync::{
        atomic::{
            Acquire,
            Atomic,
            Relaxed,
            Release, //
        },
        Arc,
    },
};

use crate::uapi::{
    self,
    EVENT_JOB_DONE, //
};

/// Slots of a file's table of parked events: a parked event waits in
/// slot `job_id % EVENT_SLOTS`, whose list the job's end scans.
pub(crate) const EVENT_SLOTS: u64 = 256;

/// Entries of a file's first ring of ready events.
const FIRST_RING: u32 = 64;

/// The events all files of one device may have queued and not yet read
/// (`device_max_events`).
pub(crate) struct EventBudget {
    used: Atomic<u32>,
    max: u32,
}

impl EventBudget {
    /// A budget of `max` events.
    pub(crate) fn new(max: u32) -> Result<Arc<Self>> {
        Ok(Arc::new(
            EventBudget {
                used: Atomic::new(0),
                max,
            },
            GFP_KERNEL,
        )?)
    }

    /// Takes one event from the budget: ENOSPC if none is left.
    fn take(&self) -> Result {
        let mut n = self.used.load(Relaxed);
        loop {
            if n >= self.max {
                return Err(ENOSPC);
            }
            match self.used.cmpxchg(n, n + 1, Relaxed) {
                Ok(_) => return Ok(()),
                Err(now) => n = now,
            }
        }
    }

    /// Gives back `n` events taken with [`EventBudget::take`].
    fn give_back(&self, n: u32) {
        if n > 0 {
            self.used.fetch_sub(n, Relaxed);
        }
    }

    /// Events taken and not given back (for KUnit tests).
    #[cfg(CONFIG_KUNIT)]
    pub(crate) fn used(&self) -> u32 {
        self.used.load(Relaxed)
    }
}

/// What one file's events may take: counted without a lock, so that a
/// request takes its room before the tracker lock (and grows the ring
/// there if it must).
///
/// # Invariants
///
/// `count` events (asked for and not yet read, or read and not yet
/// given back) are taken from `budget`, `count <= max`, and `count` is at
/// most the size of the file's ring ([`EventRoom::ring_size`]), which only
/// grows: an event that becomes ready always finds room in the ring.
pub(crate) struct EventRoom {
    count: Atomic<u32>,
    /// Entries of the file's ring, set under the tracker lock when a larger
    /// ring is installed.
    ring_size: Atomic<u32>,
    max: u32,
    budget: Arc<EventBudget>,
}

/// Why [`EventRoom::take`] found no room.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NoRoom {
    /// The file's or the device's limit: ENOSPC.
    Full,
    /// The ring has this many entries and all are taken: grow it
    /// ([`EventRing::new`] of [`EventRoom::next_ring_size`]) and try again.
    Grow(u32),
}

impl EventRoom {
    /// Room for at most `max` events of one file, from `budget`.
    pub(crate) fn new(max: u32, budget: Arc<EventBudget>) -> Self {
        Self {
            count: Atomic::new(0),
            ring_size: Atomic::new(0),
            max,
            budget,
        }
    }

    /// Takes room for one event.
    pub(crate) fn take(&self) -> core::result::Result<(), NoRoom> {
        let mut n = self.count.load(Relaxed);
        loop {
            if n >= self.max {
                return Err(NoRoom::Full);
            }
            let size = self.ring_size.load(Acquire);
            if n >= size {
                return Err(NoRoom::Grow(size));
            }
            match self.count.cmpxchg(n, n + 1, Relaxed) {
                Ok(_) => break,
                Err(now) => n = now,
            }
        }
        if self.budget.take().is_err() {
            self.count.fetch_sub(1, Relaxed);
            return Err(NoRoom::Full);
        }
        Ok(())
    }

    /// Gives back room for `n` events.
    pub(crate) fn give_back(&self, n: u32) {
        if n > 0 {
            self.count.fetch_sub(n, Relaxed);
            self.budget.give_back(n);
        }
    }

    /// The size of the ring to grow a ring of `size` entries to.
    pub(crate) fn next_ring_size(&self, size: u32) -> u32 {
        size.saturating_mul(2).max(FIRST_RING).min(self.max)
    }

    /// Events counted (for KUnit tests).
    #[cfg(CONFIG_KUNIT)]
    pub(crate) fn count(&self) -> u32 {
        self.count.load(Relaxed)
    }
}

impl Drop for EventRoom {
    fn drop(&mut self) {
        // The file's unread and unended events go with it.
        self.budget.give_back(self.count.load(Relaxed));
    }
}

/// A ring of ready events, allocated before the tracker lock and
/// installed under it ([`EventQueue::install_ring`]).
pub(crate) struct EventRing(KVVec<uapi::Event>);

impl EventRing {
    /// A ring of `size` entries. Allocates.
    pub(crate) fn new(size: u32) -> Result<Self> {
        let mut v = KVVec::with_capacity(size as usize, GFP_KERNEL_ACCOUNT)?;
        v.resize(size as usize, uapi::Event::default(), GFP_KERNEL_ACCOUNT)?;
        Ok(Self(v))
    }

    fn size(&self) -> usize {
        self.0.len()
    }
}

/// An event asked for with JOB_NOTIFY for a job that has not ended.
#[pin_data]
pub(crate) struct JobEvent {
    job_id: u64,
    user_data: u64,
    #[pin]
    links: ListLinks,
}

impl_list_arc_safe! {
    impl ListArcSafe<0> for JobEvent { untracked; }
}
impl_list_item! {
    impl ListItem<0> for JobEvent { using ListLinks { self.links }; }
}

impl JobEvent {
    /// An event for job `job_id`, not yet queued. Allocates.
    pub(crate) fn new(job_id: u64, user_data: u64) -> Result<ListArc<Self>> {
        ListArc::pin_init(
            try_pin_init!(JobEvent {
                job_id,
                user_data,
                links <- ListLinks::new(),
            }? Error),
            GFP_KERNEL_ACCOUNT,
        )
    }
}

/// What `read(2)` returns for job `job_id` that ended with `status`.
fn event(job_id: u64, status: i32, user_data: u64) -> uapi::Event {
    uapi::Event {
        kind: EVENT_JOB_DONE,
        status,
        job_id,
        user_data,
    }
}

/// The parked events, by job slot.
pub(crate) type EventTable = KVVec<List<JobEvent>>;

/// A file's ready and parked events.
///
/// # Invariants
///
/// The ready events are `ring[(head + i) % ring.len()]` for `i < ready`,
/// oldest first; `ready` plus the events in `table` is at most the
/// file's [`EventRoom`] count, so at most `ring.len()`. Every event in
/// `table[i]` has a job id `i` modulo `EVENT_SLOTS` whose job has not
/// ended.
pub(crate) struct EventQueue {
    table: Option<EventTable>,
    ring: KVVec<uapi::Event>,
    head: usize,
    ready: usize,
    /// A reader copies the oldest events out: other readers wait until it
    /// consumed what it copied ([`EventQueue::end_read`]), so that no one
    /// reads a later event before those (oldest first).
    reading: bool,
}

impl EventQueue {
    /// An empty queue; allocates nothing.
    pub(crate) fn new() -> Self {
        Self {
            table: None,
            ring: KVVec::new(),
            head: 0,
            ready: 0,
            reading: false,
        }
    }

    /// Whether [`EventQueue::install_table`] is still to be called.
    pub(crate) fn needs_table(&self) -> bool {
        self.table.is_none()
    }

    /// The table of slots. Allocates (call without the tracker lock).
    pub(crate) fn new_table() -> Result<EventTable> {
        let mut t = KVVec::with_capacity(EVENT_SLOTS as usize, GFP_KERNEL_ACCOUNT)?;
        for _ in 0..EVENT_SLOTS {
            t.push(List::new(), GFP_KERNEL_ACCOUNT)?;
        }
        Ok(t)
    }

    /// Installs `table` unless one is there already (another caller won
    /// the race); returns the one not used, to be freed outside the lock.
    pub(crate) fn install_table(&mut self, table: Option<EventTable>) -> Option<EventTable> {
        if self.table.is_none() {
            self.table = table;
            None
        } else {
            table
        }
    }

    /// Moves the ready events into `ring` if it is larger than the ring
    /// in use, and sets `room`'s ring size; returns the ring not used (the
    /// old one, or `ring`), to be freed outside the lock.
    pub(crate) fn install_ring(&mut self, ring: EventRing, room: &EventRoom) -> EventRing {
        if ring.size() <= self.ring.len() {
            return ring;
        }
        let mut new = ring.0;
        for i in 0..self.ready {
            new[i] = self.ring[self.slot(i)];
        }
        self.head = 0;
        core::mem::swap(&mut self.ring, &mut new);
        // INVARIANT: the ring only grows; room taken against the old size
        // fits the new one.
        room.ring_size.store(self.ring.len() as u32, Release);
        EventRing(new)
    }

    /// Appends a ready event. Its room was taken ([`EventRoom::take`]), so
    /// the ring has an entry for it. Never allocates.
    fn push(&mut self, ev: uapi::Event) {
        if self.ready >= self.ring.len() {
            // Unreachable by the invariants; dropping the event beats
            // overwriting the oldest.
            return;
        }
        let at = self.slot(self.ready);
        self.ring[at] = ev;
        self.ready += 1;
    }

    /// Job `id` ended with `status`, and its event was asked for in
    /// SUBMIT with `user_data`: the event is ready. Never allocates.
    pub(crate) fn ready_now(&mut self, id: u64, status: i32, user_data: u64) {
        self.push(event(id, status, user_data));
    }

    /// Queues a JOB_NOTIFY event for job `id` whose room was taken: ready
    /// at once with the job's `status` if it ended (`Some`; `ev` is then
    /// returned, to be freed outside the lock), else parked until
    /// [`EventQueue::deliver`]. EINVAL without a table for a parked event
    /// (a caller bug; the event is returned).
    pub(crate) fn queue(
        &mut self,
        id: u64,
        ev: ListArc<JobEvent>,
        status: Option<i32>,
    ) -> core::result::Result<Option<ListArc<JobEvent>>, ListArc<JobEvent>> {
        match status {
            Some(s) => {
                self.push(event(id, s, ev.user_data));
                Ok(Some(ev))
            }
            None => match self.table.as_mut() {
                Some(table) => {
                    table[(id % EVENT_SLOTS) as usize].push_back(ev);
                    Ok(None)
                }
                None => Err(ev),
            },
        }
    }

    /// Job `id` ended with `status`: its parked events become ready, and
    /// move to `spent`, to be freed outside the lock. Returns whether
    /// there were any. Never allocates.
    pub(crate) fn deliver(&mut self, id: u64, status: i32, spent: &mut List<JobEvent>) -> bool {
        let Some(table) = self.table.as_mut() else {
            return false;
        };
        let list = &mut table[(id % EVENT_SLOTS) as usize];
        let mut found = List::<JobEvent>::new();
        let mut cursor = list.cursor_front();
        while let Some(next) = cursor.peek_next() {
            if next.job_id == id {
                found.push_back(next.remove());
            } else {
                cursor.move_next();
            }
        }
        let moved = !found.is_empty();
        while let Some(ev) = found.pop_front() {
            self.push(event(id, status, ev.user_data));
            spent.push_back(ev);
        }
        moved
    }

    /// Whether an event is ready.
    pub(crate) fn has_ready(&self) -> bool {
        self.ready > 0
    }

    /// Whether a reader may start now: an event is ready and no other
    /// reader is between [`EventQueue::begin_read`] and
    /// [`EventQueue::end_read`].
    pub(crate) fn readable(&self) -> bool {
        self.has_ready() && !self.reading
    }

    /// A reader starts: the ready events stay until it consumed them, and
    /// no other reader starts until [`EventQueue::end_read`].
    pub(crate) fn begin_read(&mut self) {
        self.reading = true;
    }

    /// Copies the ready events from the `skip`th oldest on into `out`, as
    /// many as fit and are ready; returns how many.
    pub(crate) fn peek(&self, skip: usize, out: &mut [uapi::Event]) -> usize {
        let n = self.ready.saturating_sub(skip).min(out.len());
        for (i, slot) in out[..n].iter_mut().enumerate() {
            *slot = self.ring[self.slot(skip + i)];
        }
        n
    }

    /// The reader is done: its `copied` oldest events reached userspace
    /// and leave the ring (their room is given back by the caller). Other
    /// readers may start again.
    pub(crate) fn end_read(&mut self, copied: usize) {
        let n = copied.min(self.ready);
        if n > 0 {
            self.head = self.slot(n);
            self.ready -= n;
        }
        self.reading = false;
    }

    /// The index in the ring of the `i`th oldest ready event (or, for `i
    /// == ready`, of the next one), `i <= ready <= ring.len()`. (A wrap by
    /// subtraction: `head < ring.len()`, so no division, which could
    /// panic on an empty ring.)
    fn slot(&self, i: usize) -> usize {
        let at = self.head + i;
        if at >= self.ring.len() {
            at - self.ring.len()
        } else {
            at
        }
    }
}

#[kunit_tests(tdrv_event)]
mod tests {
    use super::*;

    /// (job id, status, user data) of every ready event, oldest first.
    fn ready(q: &EventQueue) -> KVec<(u64, i32, u64)> {
        let mut all = KVec::new();
        let mut buf = [uapi::Event::default(); 4];
        loop {
            let n = q.peek(all.len(), &mut buf);
            if n == 0 {
                return all;
            }
            for e in &buf[..n] {
                let _ = all.push((e.job_id, e.status, e.user_data), GFP_KERNEL);
            }
        }
    }

    /// A queue whose ring has `size` entries, and its room.
    fn queue(size: u32, max: u32, budget: &Arc<EventBudget>) -> Result<(EventQueue, EventRoom)> {
        let room = EventRoom::new(max, budget.clone());
        let mut q = EventQueue::new();
        drop(q.install_ring(EventRing::new(size)?, &room));
        Ok((q, room))
    }

    #[test]
    fn an_event_waits_for_its_job_not_for_the_job_sharing_its_slot() -> Result {
        let (mut q, room) = queue(8, 16, &EventBudget::new(16)?)?;
        let _ = q.install_table(Some(EventQueue::new_table()?));
        // Job 1 and job 1 + EVENT_SLOTS share a slot.
        for (id, ud) in [(1, 10), (1 + EVENT_SLOTS, 11), (1, 12)] {
            assert!(room.take().is_ok());
            assert!(matches!(q.queue(id, JobEvent::new(id, ud)?, None), Ok(None)));
        }
        assert!(!q.has_ready());
        let mut spent = List::new();
        assert!(q.deliver(1 + EVENT_SLOTS, -5, &mut spent));
        assert!(!q.deliver(2, 0, &mut spent));
        assert!(q.deliver(1, 0, &mut spent));
        assert!(!q.deliver(1, 0, &mut spent));
        assert_eq!(spent.iter().count(), 3);
        assert_eq!(
            &ready(&q)[..],
            &[(1 + EVENT_SLOTS, -5, 11), (1, 0, 10), (1, 0, 12)]
        );
        Ok(())
    }

    #[test]
    fn a_reader_consumes_what_it_copied_and_leaves_the_rest_in_order() -> Result {
        let (mut q, room) = queue(4, 16, &EventBudget::new(16)?)?;
        for id in 1..=3 {
            assert!(room.take().is_ok());
            q.ready_now(id, 0, id * 10);
        }
        q.begin_read();
        assert!(!q.readable());
        let mut two = [uapi::Event::default(); 2];
        assert_eq!(q.peek(0, &mut two), 2);
        assert_eq!((two[0].job_id, two[1].job_id), (1, 2));
        // Delivered during the read: after the others.
        assert!(room.take().is_ok());
        q.ready_now(4, -5, 40);
        // Only the first reached userspace.
        q.end_read(1);
        room.give_back(1);
        assert!(q.readable());
        assert_eq!(
            &ready(&q)[..],
            &[(2, 0, 20), (3, 0, 30), (4, -5, 40)]
        );
        assert_eq!(room.count(), 3);
        Ok(())
    }

    #[test]
    fn a_full_ring_asks_to_grow_and_a_larger_one_keeps_the_order_across_the_wrap() -> Result {
        let budget = EventBudget::new(100)?;
        let room = EventRoom::new(100, budget.clone());
        let mut q = EventQueue::new();
        // No ring yet: the first request grows it.
        assert_eq!(room.take(), Err(NoRoom::Grow(0)));
        drop(q.install_ring(EventRing::new(4)?, &room));
        for id in 1..=4 {
            assert!(room.take().is_ok());
            q.ready_now(id, 0, 0);
        }
        assert_eq!(room.take(), Err(NoRoom::Grow(4)));
        // Read two, so that the next two wrap around the end.
        q.begin_read();
        q.end_read(2);
        room.give_back(2);
        for id in 5..=6 {
            assert!(room.take().is_ok());
            q.ready_now(id, 0, 0);
        }
        assert_eq!(room.take(), Err(NoRoom::Grow(4)));
        assert_eq!(room.next_ring_size(4), 64);
        // A ring no larger than the one in use is handed back unused.
        let spare = q.install_ring(EventRing::new(4)?, &room);
        assert_eq!(spare.size(), 4);
        drop(q.install_ring(EventRing::new(8)?, &room));
        assert!(room.take().is_ok());
        q.ready_now(7, 0, 0);
        let ids: KVec<u64> = {
            let mut v = KVec::new();
            for (id, _, _) in ready(&q).iter() {
                let _ = v.push(*id, GFP_KERNEL);
            }
            v
        };
        assert_eq!(&ids[..], &[3, 4, 5, 6, 7]);
        assert_eq!(budget.used(), 5);
        Ok(())
    }

    #[test]
    fn a_file_holds_at_most_its_max_events() -> Result {
        let budget = EventBudget::new(100)?;
        let (mut q, room) = queue(8, 8, &budget)?;
        for i in 0..8 {
            assert!(room.take().is_ok());
            q.ready_now(i + 1, 0, 0);
        }
        assert_eq!(room.take(), Err(NoRoom::Full));
        assert_eq!(room.next_ring_size(8), 8);
        assert_eq!(budget.used(), 8);
        q.begin_read();
        q.end_read(1);
        room.give_back(1);
        assert_eq!(budget.used(), 7);
        assert!(room.take().is_ok());
        Ok(())
    }

    #[test]
    fn the_files_of_a_device_share_its_budget_and_give_it_back() -> Result {
        let budget = EventBudget::new(3)?;
        let (mut a, ra) = queue(8, 8, &budget)?;
        let (mut b, rb) = queue(8, 8, &budget)?;
        let _ = b.install_table(Some(EventQueue::new_table()?));
        for id in 1..=2 {
            assert!(ra.take().is_ok());
            a.ready_now(id, 0, 0);
        }
        // Parked events count as well.
        assert!(rb.take().is_ok());
        assert!(matches!(b.queue(1, JobEvent::new(1, 0)?, None), Ok(None)));
        // A refused event takes nothing from the budget, nor from the file.
        assert_eq!(rb.take(), Err(NoRoom::Full));
        assert_eq!((budget.used(), rb.count()), (3, 1));
        // A read gives back what reached userspace.
        a.begin_read();
        a.end_read(1);
        ra.give_back(1);
        assert_eq!(budget.used(), 2);
        // A closed file gives back its unread and parked events.
        drop(b);
        drop(rb);
        assert_eq!(budget.used(), 1);
        drop(a);
        drop(ra);
        assert_eq!(budget.used(), 0);
        Ok(())
    }
}
