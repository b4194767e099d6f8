// SPDX-License-Identifier: GPL-2.0

//! Completion events of a file's jobs (`TDRV_IOC_JOB_NOTIFY`, `read(2)`,
//! `poll(2)`): how a process waits for many jobs with one fd, on every
//! kernel (no `sync_file` needed).
//!
//! A JOB_NOTIFY allocates its event (in the caller's context, charged to
//! its memory cgroup) and parks it at its job's slot (`id % JOB_WINDOW`);
//! the job's end moves it to the ready list, from which `read(2)` takes
//! it. The move is the only thing the completion path does: it allocates
//! nothing and takes no lock but the file's job tracker lock it already
//! holds (a dma-fence signalling path, see `docs/fence-fds.md`). The
//! table of slots (8 bytes per slot) is allocated at the file's first
//! JOB_NOTIFY, so files that never ask pay nothing.
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
    sync::atomic::{
        Atomic,
        Relaxed, //
    },
};

use crate::uapi::{
    self,
    EVENT_JOB_DONE,
    JOB_WINDOW,
    MAX_EVENTS, //
};

/// One requested completion event.
#[pin_data]
pub(crate) struct JobEvent {
    job_id: u64,
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
                job_id,
                user_data,
                status: Atomic::new(0),
                links <- ListLinks::new(),
            }? Error),
            GFP_KERNEL_ACCOUNT,
        )
    }

    /// What `read(2)` returns for it.
    pub(crate) fn to_uapi(&self) -> uapi::Event {
        uapi::Event {
            kind: EVENT_JOB_DONE,
            status: self.status.load(Relaxed),
            job_id: self.job_id,
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
/// `MAX_EVENTS`; every event in `table[i]` has a job id `i` modulo
/// `JOB_WINDOW` whose job has not ended.
pub(crate) struct EventQueue {
    table: Option<EventTable>,
    ready: List<JobEvent>,
    count: u32,
}

impl EventQueue {
    /// An empty queue; allocates nothing.
    pub(crate) fn new() -> Self {
        Self {
            table: None,
            ready: List::new(),
            count: 0,
        }
    }

    /// Whether [`EventQueue::install_table`] is still to be called.
    pub(crate) fn needs_table(&self) -> bool {
        self.table.is_none()
    }

    /// The table of slots. Allocates (call without the tracker lock).
    pub(crate) fn new_table() -> Result<EventTable> {
        let mut t = KVVec::with_capacity(JOB_WINDOW as usize, GFP_KERNEL_ACCOUNT)?;
        for _ in 0..JOB_WINDOW {
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
    /// `MAX_EVENTS` are queued; EINVAL without a table for a parked event
    /// (a caller bug). The event is dropped on error.
    pub(crate) fn queue(&mut self, ev: ListArc<JobEvent>, status: Option<i32>) -> Result {
        if self.count >= MAX_EVENTS {
            return Err(ENOSPC);
        }
        match status {
            Some(s) => {
                ev.status.store(s, Relaxed);
                self.ready.push_back(ev);
            }
            None => {
                let slot = (ev.job_id % JOB_WINDOW) as usize;
                let table = self.table.as_mut().ok_or(EINVAL)?;
                table[slot].push_back(ev);
            }
        }
        self.count += 1;
        Ok(())
    }

    /// Job `id` ended with `status`: its parked events become ready.
    /// Returns whether there were any. Never allocates.
    pub(crate) fn deliver(&mut self, id: u64, status: i32) -> bool {
        let Some(table) = self.table.as_mut() else {
            return false;
        };
        let list = &mut table[(id % JOB_WINDOW) as usize];
        let mut moved = false;
        let mut cursor = list.cursor_front();
        while let Some(next) = cursor.peek_next() {
            if next.job_id == id {
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

    /// Takes up to `max` ready events, oldest first. They still count
    /// until [`EventQueue::consumed`] or [`EventQueue::put_back`].
    pub(crate) fn take(&mut self, max: usize) -> List<JobEvent> {
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
        self.count = self.count.saturating_sub(n);
    }

    /// Returns taken events that did not reach userspace to the front of
    /// the ready list, in their order.
    pub(crate) fn put_back(&mut self, mut taken: List<JobEvent>) {
        while let Some(ev) = taken.pop_back() {
            self.ready.push_front(ev);
        }
    }
}

#[kunit_tests(tdrv_event)]
mod tests {
    use super::*;

    fn ids(list: &mut List<JobEvent>) -> KVec<(u64, i32)> {
        let mut v = KVec::new();
        for ev in list.iter() {
            let _ = v.push((ev.job_id, ev.status.load(Relaxed)), GFP_KERNEL);
        }
        v
    }

    #[test]
    fn an_event_waits_for_its_job_not_for_the_job_sharing_its_slot() -> Result {
        let mut q = EventQueue::new();
        let _ = q.install_table(Some(EventQueue::new_table()?));
        // Job 1 and job 1 + JOB_WINDOW share a slot.
        q.queue(JobEvent::new(1, 10)?, None)?;
        q.queue(JobEvent::new(1 + JOB_WINDOW, 11)?, None)?;
        q.queue(JobEvent::new(1, 12)?, None)?;
        assert!(!q.has_ready());
        assert!(q.deliver(1 + JOB_WINDOW, -5));
        assert!(!q.deliver(2, 0));
        assert!(q.deliver(1, 0));
        assert!(!q.deliver(1, 0));
        let mut all = q.take(8);
        assert_eq!(&ids(&mut all)[..], &[(1 + JOB_WINDOW, -5), (1, 0), (1, 0)]);
        q.put_back(all);
        let mut two = q.take(2);
        assert_eq!(&ids(&mut two)[..], &[(1 + JOB_WINDOW, -5), (1, 0)]);
        q.consumed(2);
        let last = q.take(8);
        assert_eq!(last.iter().map(|e| e.user_data).next(), Some(12));
        q.consumed(1);
        assert_eq!(q.count, 0);
        Ok(())
    }

    #[test]
    fn the_queue_holds_at_most_max_events() -> Result {
        let mut q = EventQueue::new();
        for i in 0..MAX_EVENTS {
            q.queue(JobEvent::new(u64::from(i) + 1, 0)?, Some(0))?;
            if i % 1024 == 0 {
                crate::glue::cond_resched();
            }
        }
        assert_eq!(
            q.queue(JobEvent::new(1, 0)?, Some(0)).err(),
            Some(ENOSPC)
        );
        let taken = q.take(1);
        q.consumed(1);
        drop(taken);
        q.queue(JobEvent::new(1, 0)?, Some(0))?;
        Ok(())
    }
}
