// SPDX-License-Identifier: GPL-2.0

//! Completion events of a file's jobs (`TDRV_IOC_JOB_NOTIFY`, `read(2)`,
//! `poll(2)`): how a process waits for many jobs with one fd, on every
//! kernel (no `sync_file` needed).
//!
//! A JOB_NOTIFY allocates its event (in the caller's context, charged to
//! its memory cgroup) and parks it at its job's slot (`id % EVENT_SLOTS`);
//! the job's end moves it to the ready list, from which `read(2)` takes
//! it. The move is the only thing the completion path does: it allocates
//! nothing and takes no lock but the file's job tracker lock it already
//! holds (a dma-fence signalling path, see `docs/fence-fds.md`). The
//! table of slots (8 bytes per slot) is allocated at the file's first
//! JOB_NOTIFY, so files that never ask pay nothing.
//!
//! Events are kernel memory a caller can ask for without doing any work
//! (any number of JOB_NOTIFYs of one ended job), and a memory cgroup
//! bounds them only where `memory.max` is set. So they are bounded twice:
//! per file (`file_max_events`, by default `TDRV_JOB_WINDOW`: an event for
//! each job whose status a file can still ask for) and per device
//! (`device_max_events`, an [`EventBudget`] shared by its files), so that
//! many files cannot add up to more than the device's budget.
//!
//! [`EventQueue`] is the bookkeeping, kept under the tracker lock by
//! `job.rs`; it never sleeps or allocates except in
//! [`EventQueue::new_table`] and [`JobEvent::new`], which callers run
//! before taking the lock.

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
            Atomic,
            Relaxed, //
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

/// One requested completion event.
#[pin_data]
pub(crate) struct JobEvent {
    /// Set once, before the event is queued (SUBMIT learns the id under
    /// the lock that queues it).
    job_id: Atomic<u64>,
    user_data: u64,
    /// The job's status (0 or a negative errno), set when it ended.
    status: Atomic<i32>,
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
                job_id: Atomic::new(job_id),
                user_data,
                status: Atomic::new(0),
                links <- ListLinks::new(),
            }? Error),
            GFP_KERNEL_ACCOUNT,
        )
    }

    fn job_id(&self) -> u64 {
        self.job_id.load(Relaxed)
    }

    /// What `read(2)` returns for it.
    pub(crate) fn to_uapi(&self) -> uapi::Event {
        uapi::Event {
            kind: EVENT_JOB_DONE,
            status: self.status.load(Relaxed),
            job_id: self.job_id(),
            user_data: self.user_data,
        }
    }
}

/// The parked events, by job slot.
pub(crate) type EventTable = KVVec<List<JobEvent>>;

/// A file's requested and ready events.
///
/// # Invariants
///
/// `count` is the number of events in `ready` and in `table`, at most
/// `max`, and taken from `budget` (within one hold of the tracker lock,
/// also the room [`EventQueue::reserve`] took for an event not yet
/// parked); every event in `table[i]` has a job id `i` modulo
/// `EVENT_SLOTS` whose job has not ended.
pub(crate) struct EventQueue {
    table: Option<EventTable>,
    ready: List<JobEvent>,
    count: u32,
    max: u32,
    budget: Arc<EventBudget>,
    /// A reader took events and copies them out: other readers wait until
    /// it puts back what it could not copy, so that no one reads a later
    /// event before those (oldest first).
    reading: bool,
}

impl EventQueue {
    /// An empty queue of at most `max` events, taken from `budget`;
    /// allocates nothing.
    pub(crate) fn new(max: u32, budget: Arc<EventBudget>) -> Self {
        Self {
            table: None,
            ready: List::new(),
            count: 0,
            max,
            budget,
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

    /// Queues `ev`: ready at once with the job's `status` if it ended
    /// (`Some`), else parked until [`EventQueue::deliver`]. ENOSPC when
    /// the file has `max` queued or the device's budget is used up;
    /// EINVAL without a table for a parked event (a caller bug). The event
    /// is dropped on error.
    pub(crate) fn queue(&mut self, ev: ListArc<JobEvent>, status: Option<i32>) -> Result {
        if self.count >= self.max {
            return Err(ENOSPC);
        }
        if status.is_none() && self.table.is_none() {
            return Err(EINVAL);
        }
        self.budget.take()?;
        match status {
            Some(s) => {
                ev.status.store(s, Relaxed);
                self.ready.push_back(ev);
            }
            None => {
                let slot = (ev.job_id() % EVENT_SLOTS) as usize;
                let table = self.table.as_mut().ok_or(EINVAL)?;
                table[slot].push_back(ev);
            }
        }
        self.count += 1;
        Ok(())
    }

    /// Takes room for the event of a job that has no id yet (SUBMIT with
    /// `TDRV_SUBMIT_NOTIFY`): ENOSPC as [`EventQueue::queue`], EINVAL
    /// without a table (a caller bug). Under the same hold of the tracker
    /// lock, [`EventQueue::park_reserved`] then uses the room, or
    /// [`EventQueue::unreserve`] gives it back.
    pub(crate) fn reserve(&mut self) -> Result {
        if self.count >= self.max {
            return Err(ENOSPC);
        }
        if self.table.is_none() {
            return Err(EINVAL);
        }
        self.budget.take()?;
        self.count += 1;
        Ok(())
    }

    /// Gives back the room [`EventQueue::reserve`] took.
    pub(crate) fn unreserve(&mut self) {
        self.count = self.count.saturating_sub(1);
        self.budget.give_back(1);
    }

    /// Parks `ev` for job `id` (not ended: its end, which takes the
    /// tracker lock, comes after this) in the room [`EventQueue::reserve`]
    /// took. Never allocates.
    pub(crate) fn park_reserved(&mut self, id: u64, ev: ListArc<JobEvent>) {
        ev.job_id.store(id, Relaxed);
        match self.table.as_mut() {
            Some(table) => table[(id % EVENT_SLOTS) as usize].push_back(ev),
            // `reserve` refused a queue without a table, and a table is
            // never removed.
            None => self.unreserve(),
        }
    }

    /// Job `id` ended with `status`: its parked events become ready.
    /// Returns whether there were any. Never allocates.
    pub(crate) fn deliver(&mut self, id: u64, status: i32) -> bool {
        let Some(table) = self.table.as_mut() else {
            return false;
        };
        let list = &mut table[(id % EVENT_SLOTS) as usize];
        let mut moved = false;
        let mut cursor = list.cursor_front();
        while let Some(next) = cursor.peek_next() {
            if next.job_id() == id {
                let ev = next.remove();
                ev.status.store(status, Relaxed);
                self.ready.push_back(ev);
                moved = true;
            } else {
                cursor.move_next();
            }
        }
        moved
    }

    /// Whether an event is ready.
    pub(crate) fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Whether a reader may take events now: one is ready and no other
    /// reader is between [`EventQueue::take`] and [`EventQueue::end_read`].
    pub(crate) fn readable(&self) -> bool {
        self.has_ready() && !self.reading
    }

    /// Takes up to `max` ready events, oldest first. They still count
    /// until [`EventQueue::consumed`] or [`EventQueue::put_back`], and no
    /// other reader takes any until [`EventQueue::end_read`].
    pub(crate) fn take(&mut self, max: usize) -> List<JobEvent> {
        self.reading = true;
        let mut out = List::new();
        for _ in 0..max {
            let Some(ev) = self.ready.pop_front() else {
                break;
            };
            out.push_back(ev);
        }
        out
    }

    /// `n` taken events reached userspace.
    pub(crate) fn consumed(&mut self, n: u32) {
        let n = n.min(self.count);
        self.count -= n;
        self.budget.give_back(n);
    }

    /// Returns taken events that did not reach userspace to the front of
    /// the ready list, in their order.
    pub(crate) fn put_back(&mut self, mut taken: List<JobEvent>) {
        while let Some(ev) = taken.pop_back() {
            self.ready.push_front(ev);
        }
    }

    /// The reader that took events is done: `copied` of them reached
    /// userspace, `left` go back to the front. Other readers may take
    /// events again.
    pub(crate) fn end_read(&mut self, copied: u32, left: List<JobEvent>) {
        self.consumed(copied);
        self.put_back(left);
        self.reading = false;
    }
}

impl Drop for EventQueue {
    fn drop(&mut self) {
        // The file's unread and unended events go with it.
        self.budget.give_back(self.count);
    }
}

#[kunit_tests(tdrv_event)]
mod tests {
    use super::*;

    fn ids(list: &mut List<JobEvent>) -> KVec<(u64, i32)> {
        let mut v = KVec::new();
        for ev in list.iter() {
            let _ = v.push((ev.job_id(), ev.status.load(Relaxed)), GFP_KERNEL);
        }
        v
    }

    #[test]
    fn an_event_waits_for_its_job_not_for_the_job_sharing_its_slot() -> Result {
        let mut q = EventQueue::new(16, EventBudget::new(16)?);
        let _ = q.install_table(Some(EventQueue::new_table()?));
        // Job 1 and job 1 + EVENT_SLOTS share a slot.
        q.queue(JobEvent::new(1, 10)?, None)?;
        q.queue(JobEvent::new(1 + EVENT_SLOTS, 11)?, None)?;
        q.queue(JobEvent::new(1, 12)?, None)?;
        assert!(!q.has_ready());
        assert!(q.deliver(1 + EVENT_SLOTS, -5));
        assert!(!q.deliver(2, 0));
        assert!(q.deliver(1, 0));
        assert!(!q.deliver(1, 0));
        let mut all = q.take(8);
        assert_eq!(&ids(&mut all)[..], &[(1 + EVENT_SLOTS, -5), (1, 0), (1, 0)]);
        q.put_back(all);
        let mut two = q.take(2);
        assert_eq!(&ids(&mut two)[..], &[(1 + EVENT_SLOTS, -5), (1, 0)]);
        q.consumed(2);
        let last = q.take(8);
        assert_eq!(last.iter().map(|e| e.user_data).next(), Some(12));
        q.consumed(1);
        assert_eq!(q.count, 0);
        Ok(())
    }

    #[test]
    fn a_reserved_event_counts_until_given_back_and_waits_for_its_job() -> Result {
        let budget = EventBudget::new(2)?;
        let mut q = EventQueue::new(8, budget.clone());
        // No table yet: a caller bug, refused without taking anything.
        assert_eq!(q.reserve().err(), Some(EINVAL));
        assert_eq!(budget.used(), 0);
        let _ = q.install_table(Some(EventQueue::new_table()?));
        q.reserve()?;
        q.reserve()?;
        // The device's budget is used up by the two rooms.
        assert_eq!(q.reserve().err(), Some(ENOSPC));
        q.unreserve();
        assert_eq!((q.count, budget.used()), (1, 1));
        q.park_reserved(7, JobEvent::new(0, 70)?);
        assert!(!q.deliver(6, 0));
        assert!(q.deliver(7, -125));
        let mut got = q.take(8);
        assert_eq!(&ids(&mut got)[..], &[(7, -125)]);
        assert_eq!(got.iter().map(|e| e.user_data).next(), Some(70));
        q.end_read(1, List::new());
        assert_eq!((q.count, budget.used()), (0, 0));
        Ok(())
    }

    #[test]
    fn a_file_holds_at_most_its_max_events() -> Result {
        let budget = EventBudget::new(100)?;
        let mut q = EventQueue::new(8, budget.clone());
        for i in 0..8 {
            q.queue(JobEvent::new(i + 1, 0)?, Some(0))?;
        }
        assert_eq!(
            q.queue(JobEvent::new(1, 0)?, Some(0)).err(),
            Some(ENOSPC)
        );
        assert_eq!(budget.used(), 8);
        let taken = q.take(1);
        q.end_read(1, List::new());
        drop(taken);
        assert_eq!(budget.used(), 7);
        q.queue(JobEvent::new(1, 0)?, Some(0))?;
        Ok(())
    }

    #[test]
    fn the_files_of_a_device_share_its_budget_and_give_it_back() -> Result {
        let budget = EventBudget::new(3)?;
        let mut a = EventQueue::new(8, budget.clone());
        let mut b = EventQueue::new(8, budget.clone());
        let _ = b.install_table(Some(EventQueue::new_table()?));
        a.queue(JobEvent::new(1, 0)?, Some(0))?;
        a.queue(JobEvent::new(2, 0)?, Some(0))?;
        // Parked events count as well.
        b.queue(JobEvent::new(1, 0)?, None)?;
        assert_eq!(
            b.queue(JobEvent::new(2, 0)?, Some(0)).err(),
            Some(ENOSPC)
        );
        // A refused event takes nothing from the budget.
        assert_eq!(budget.used(), 3);
        // A read gives back what reached userspace, not what was put back.
        let mut taken = a.take(2);
        let mut left = List::new();
        if let Some(ev) = taken.pop_back() {
            left.push_back(ev);
        }
        a.end_read(1, left);
        drop(taken);
        assert_eq!(budget.used(), 2);
        b.queue(JobEvent::new(3, 0)?, Some(0))?;
        // A closed file gives back its unread and parked events.
        drop(b);
        assert_eq!(budget.used(), 1);
        drop(a);
        assert_eq!(budget.used(), 0);
        Ok(())
    }
}
