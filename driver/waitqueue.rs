// SPDX-License-Identifier: GPL-2.0

//! A condition variable that is woken only when somebody sleeps on it, and
//! after its lock is released.
//!
//! Every completing job changes a few of these (its buffers' fences, its
//! file's job outcomes, the engine's queue), and almost always nobody
//! waits: a bare `CondVar::notify_all` would still take the wait queue's
//! lock with interrupts off each time. When somebody does wait, waking it
//! while the changed state's lock is still held makes it find that lock
//! taken as soon as it runs (on another CPU, at once), so it spins or
//! sleeps again. So the locked state counts its sleepers ([`Sleepers`]),
//! and [`WaitQueue::wake_all`] releases the lock first and then wakes them,
//! if any.
//!
//! No wake-up is lost: a sleeper counts itself and joins the wait queue
//! before it releases the lock (`CondVar` queues the thread first), so a
//! thread that takes the lock after it, changes the state and reads a
//! count of zero knows that nobody can be between checking the state and
//! sleeping. A count read while a woken sleeper has not yet taken the lock
//! back at most causes a spare wake-up.

use kernel::{
    prelude::*,
    sync::{
        CondVar,
        CondVarTimeoutResult,
        MutexGuard, //
    },
    time::Jiffies, //
};

/// State behind a mutex that counts the threads sleeping on its
/// [`WaitQueue`].
pub(crate) trait Sleepers {
    /// The count, which only [`WaitQueue`] changes.
    fn sleepers(&mut self) -> &mut u32;
}

/// A [`CondVar`] whose sleepers are counted in the state they wait on.
#[pin_data]
pub(crate) struct WaitQueue {
    #[pin]
    cv: CondVar,
}

impl WaitQueue {
    /// A wait queue around `cv` (made with `new_condvar!`, which names its
    /// lock class at the caller).
    pub(crate) fn new(cv: impl PinInit<CondVar>) -> impl PinInit<Self> {
        pin_init!(Self { cv <- cv })
    }

    /// Sleeps until woken, with the lock released meanwhile (signals do
    /// not end the sleep).
    pub(crate) fn wait<T: Sleepers + Unpin>(&self, g: &mut MutexGuard<'_, T>) {
        *g.sleepers() += 1;
        self.cv.wait(g);
        *g.sleepers() -= 1;
    }

    /// Sleeps until woken or signalled, with the lock released meanwhile;
    /// true if a signal is pending.
    pub(crate) fn wait_interruptible<T: Sleepers + Unpin>(&self, g: &mut MutexGuard<'_, T>) -> bool {
        *g.sleepers() += 1;
        let signal = self.cv.wait_interruptible(g);
        *g.sleepers() -= 1;
        signal
    }

    /// [`WaitQueue::wait_interruptible`] for at most `left` jiffies.
    pub(crate) fn wait_interruptible_timeout<T: Sleepers + Unpin>(
        &self,
        g: &mut MutexGuard<'_, T>,
        left: Jiffies,
    ) -> CondVarTimeoutResult {
        *g.sleepers() += 1;
        let r = self.cv.wait_interruptible_timeout(g, left);
        *g.sleepers() -= 1;
        r
    }

    /// Releases the lock, then wakes every sleeper, if there are any.
    pub(crate) fn wake_all<T: Sleepers + Unpin>(&self, mut g: MutexGuard<'_, T>) {
        let sleeping = *g.sleepers() > 0;
        drop(g);
        if sleeping {
            self.cv.notify_all();
        }
    }
}

#[kunit_tests(tdrv_waitqueue)]
mod tests {
    use super::*;
    use kernel::{
        new_condvar,
        new_mutex,
        sync::{
            Arc,
            Mutex, //
        },
        workqueue, //
    };

    struct State {
        value: u32,
        sleepers: u32,
    }

    impl Sleepers for State {
        fn sleepers(&mut self) -> &mut u32 {
            &mut self.sleepers
        }
    }

    #[pin_data]
    struct Shared {
        #[pin]
        state: Mutex<State>,
        #[pin]
        wq: WaitQueue,
    }

    fn shared() -> Result<Arc<Shared>> {
        Arc::pin_init(
            pin_init!(Shared {
                state <- new_mutex!(State { value: 0, sleepers: 0 }, "test::state"),
                wq <- WaitQueue::new(new_condvar!("test::wq")),
            }),
            GFP_KERNEL,
        )
    }

    #[test]
    fn a_sleeper_is_counted_and_woken() -> Result {
        let s = shared()?;
        let waker = s.clone();
        // The other thread sets the value once it sees a sleeper, so the
        // wake-up must reach a thread that counted itself.
        workqueue::system().try_spawn(GFP_KERNEL, move || loop {
            let mut g = waker.state.lock();
            if g.sleepers > 0 {
                g.value = 1;
                waker.wq.wake_all(g);
                return;
            }
            drop(g);
            crate::glue::cond_resched();
        })?;
        let mut g = s.state.lock();
        while g.value == 0 {
            assert!(!s.wq.wait_interruptible(&mut g));
        }
        assert_eq!(g.sleepers, 0);
        Ok(())
    }

    #[test]
    fn a_timed_sleep_ends_and_uncounts() -> Result {
        let s = shared()?;
        let mut g = s.state.lock();
        assert!(matches!(
            s.wq.wait_interruptible_timeout(&mut g, 1),
            CondVarTimeoutResult::Timeout
        ));
        assert_eq!(g.sleepers, 0);
        // Nobody sleeps: waking releases the lock and wakes nobody.
        s.wq.wake_all(g);
        assert_eq!(s.state.lock().sleepers, 0);
        Ok(())
    }
}
