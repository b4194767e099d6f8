//! Awaited job handles on the fake device with completion events
//! (`FakeDevice::hold_jobs` keeps jobs running until the test ends them):
//! the reactor owns a device's event stream, asks again for an event when
//! a woken task finds its job pending, lets go of what nobody waits for,
//! and works in a child after `fork`. Every wait is bounded (60 s) only
//! to turn a hang into a failure.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use tdrv_uapi as uapi;

use crate::fakedev::FakeDevice;
use crate::job::{Job, JobHandle};
use crate::ops::TensorOps;
use crate::sys::{Device, JobEvent, SysError};
use crate::Tensor;

const BOUND: Duration = Duration::from_secs(60);

/// A waker that counts wake-ups and signals a condition variable.
#[derive(Default)]
struct Signal {
    woken: Mutex<u64>,
    cond: Condvar,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        *self.woken.lock().unwrap() += 1;
        self.cond.notify_all();
    }
}

/// After [`poll_once`] (which returned `seen`), waits for a wake-up and
/// polls every future again, until all are ready or `BOUND` passes
/// (then `Err` with how many are still pending). Only a wake-up makes
/// it poll: a future whose wake-up was lost stays pending.
fn block_on_all<F: Future + Unpin>(
    futs: &mut [F],
    signal: &Arc<Signal>,
    mut seen: u64,
) -> Result<Vec<F::Output>, String> {
    let waker = Waker::from(signal.clone());
    let mut cx = Context::from_waker(&waker);
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    let start = Instant::now();
    loop {
        let pending = out.iter().filter(|o| o.is_none()).count();
        if pending == 0 {
            return Ok(out.into_iter().map(Option::unwrap).collect());
        }
        {
            let mut woken = signal.woken.lock().unwrap();
            while *woken == seen {
                let left = BOUND.saturating_sub(start.elapsed());
                if left.is_zero() {
                    return Err(format!(
                        "{pending} of {} awaited jobs still pending after {BOUND:?}",
                        futs.len()
                    ));
                }
                woken = signal.cond.wait_timeout(woken, left).unwrap().0;
            }
            seen = *woken;
        }
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                if let Poll::Ready(r) = Pin::new(f).poll(&mut cx) {
                    *o = Some(r);
                }
            }
        }
    }
}

/// Polls each future once, which must be pending: registers it with the
/// reactor (or its thread). Returns the count of wake-ups before it, for
/// [`block_on_all`].
fn poll_once<F: Future + Unpin>(futs: &mut [F], signal: &Arc<Signal>) -> u64 {
    let seen = *signal.woken.lock().unwrap();
    let waker = Waker::from(signal.clone());
    let mut cx = Context::from_waker(&waker);
    for f in futs.iter_mut() {
        assert!(
            Pin::new(f).poll(&mut cx).is_pending(),
            "a held job was ready"
        );
    }
    seen
}

/// A fake soft device with completion events.
fn device() -> (Arc<Device>, Arc<FakeDevice>) {
    Device::fake_with(FakeDevice::FEATURES | uapi::TDRV_FEAT_EVENTS as u64)
}

/// `n` held jobs, each writing its own destination (a job writing a
/// buffer a held job writes would wait for it at SUBMIT).
fn held_jobs(dev: &Arc<Device>, fake: &FakeDevice, n: usize) -> Vec<JobHandle> {
    fake.hold_jobs(true);
    let src = Tensor::allocate_on(dev, 0, 64, None).unwrap();
    (0..n)
        .map(|_| {
            let dst = Tensor::allocate_on(dev, 0, 64, None).unwrap();
            Job::new().copy_all(&src, &dst).unwrap().submit().unwrap()
        })
        .collect()
}

#[test]
#[cfg_attr(miri, ignore = "poll(2) and threads on real fds")]
fn a_second_reader_of_an_awaited_device_gets_busy_and_every_await_completes() {
    let (dev, fake) = device();
    let mut handles = held_jobs(&dev, &fake, 8);
    let signal = Arc::new(Signal::default());
    let seen_handles = poll_once(&mut handles, &signal);
    // A loop reading the same device file's events while they are
    // awaited; the jobs end just before its first read.
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (dev, fake, stop) = (dev.clone(), fake.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut busy, mut stolen) = (0, Vec::new());
            // The events are queued before the file polls readable, so
            // this reader's first read comes before the reactor's.
            fake.quiet_events(true);
            fake.finish_jobs();
            let mut first = true;
            while !stop.load(Ordering::Relaxed) {
                let mut evs = Vec::new();
                match dev.read_events(&mut evs) {
                    Err(crate::Error::Sys(SysError::EventsBusy { .. })) => busy += 1,
                    Err(e) => panic!("read_events: {e}"),
                    Ok(_) => stolen.extend(evs),
                }
                if std::mem::take(&mut first) {
                    fake.quiet_events(false);
                    fake.poke();
                }
                std::thread::yield_now();
            }
            (busy, stolen)
        })
    };
    let results = block_on_all(&mut handles, &signal, seen_handles);
    stop.store(true, Ordering::Relaxed);
    let (busy, stolen): (usize, Vec<JobEvent>) = reader.join().unwrap();
    assert_eq!(
        stolen,
        vec![],
        "the manual reader took the reactor's events"
    );
    assert!(busy > 0, "the manual reader never ran");
    for r in results.unwrap() {
        r.unwrap();
    }
    // Asking for an event of the reactor's stream is refused too.
    assert!(matches!(
        dev.job_notify(handles[0].id(), 7),
        Err(crate::Error::Sys(SysError::EventsBusy { .. }))
    ));
    assert_eq!(
        dev.claim_events().unwrap_err().raw_os_error(),
        Some(libc::EBUSY)
    );
}

#[test]
#[cfg_attr(miri, ignore = "poll(2) and threads on real fds")]
fn awaits_on_a_device_whose_events_the_caller_reads_complete_without_them() {
    let (dev, fake) = device();
    let mut handles = held_jobs(&dev, &fake, 4);
    // The caller reads this device's events itself, first.
    dev.job_notify(handles[0].id(), 0xfeed).unwrap();
    let mut evs = Vec::new();
    assert_eq!(dev.read_events(&mut evs).unwrap(), 0);
    let signal = Arc::new(Signal::default());
    let seen_handles = poll_once(&mut handles, &signal);
    fake.finish_jobs();
    for r in block_on_all(&mut handles, &signal, seen_handles).unwrap() {
        r.unwrap();
    }
    // The caller's event is still there, for the caller alone.
    let deadline = Instant::now() + BOUND;
    while evs.is_empty() && Instant::now() < deadline {
        dev.read_events(&mut evs).unwrap();
        std::thread::yield_now();
    }
    assert_eq!(evs.len(), 1, "{evs:?}");
    assert_eq!((evs[0].job_id, evs[0].user_data), (handles[0].id(), 0xfeed));
}

#[test]
#[cfg_attr(miri, ignore = "poll(2) and threads on real fds")]
fn tasks_woken_by_a_failed_read_with_their_jobs_pending_still_complete() {
    let (dev, fake) = device();
    let mut handles = held_jobs(&dev, &fake, 3);
    let signal = Arc::new(Signal::default());
    poll_once(&mut handles, &signal);
    // The device file reads as ready, and the read fails: the reactor
    // wakes every task waiting on it, whose jobs are still running.
    let before = *signal.woken.lock().unwrap();
    fake.fail_next_read(libc::EIO);
    fake.poke();
    let start = Instant::now();
    while *signal.woken.lock().unwrap() == before {
        assert!(start.elapsed() < BOUND, "the failed read woke nobody");
        std::thread::yield_now();
    }
    // Woken with their jobs pending, the tasks register anew (and ask for
    // their events again); then the jobs end.
    let seen_handles = poll_once(&mut handles, &signal);
    fake.finish_jobs();
    for r in block_on_all(&mut handles, &signal, seen_handles).unwrap() {
        r.unwrap();
    }
}

#[test]
#[cfg_attr(miri, ignore = "poll(2) and threads on real fds")]
fn dropping_the_last_awaited_handle_lets_go_of_its_device_at_once() {
    let (dev, fake) = device();
    let mut handles = held_jobs(&dev, &fake, 1);
    let signal = Arc::new(Signal::default());
    poll_once(&mut handles, &signal);
    // A round of the reactor that began after the registration: its
    // poll includes the device file.
    let (rx, tx) = super::pipe().unwrap();
    let key = super::new_key();
    super::get()
        .unwrap()
        .register(key, Arc::new(rx), &Waker::from(signal.clone()));
    let before = *signal.woken.lock().unwrap();
    // SAFETY: one byte from a local into our pipe.
    unsafe {
        libc::write(
            std::os::fd::AsRawFd::as_raw_fd(&tx),
            [1u8].as_ptr().cast(),
            1,
        )
    };
    let start = Instant::now();
    while *signal.woken.lock().unwrap() == before {
        assert!(start.elapsed() < BOUND, "the reactor never woke");
        std::thread::yield_now();
    }
    let weak = Arc::downgrade(&dev);
    drop(handles);
    drop(dev);
    // Nothing else wakes the reactor: only the deregistration may.
    let start = Instant::now();
    while weak.upgrade().is_some() {
        assert!(
            start.elapsed() < BOUND,
            "the reactor still holds the device file {BOUND:?} after its last wait went"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    fake.finish_jobs();
}

/// Forks; the child runs `body` and exits with its result (0: passed);
/// the parent returns the child's exit status, killing it after twice
/// `BOUND`.
fn in_child(body: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child only runs `body`, which uses this test's own
    // objects, a new reactor and new threads, then `_exit`s without
    // unwinding into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = body();
        // SAFETY: ends the child at once, running nothing of the parent's.
        unsafe { libc::_exit(code) };
    }
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waits for our own child without blocking.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            assert!(libc::WIFEXITED(status), "child status {status:#x}");
            return libc::WEXITSTATUS(status);
        }
        if start.elapsed() > 2 * BOUND {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the child hung: killed after {:?}", 2 * BOUND);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
#[cfg_attr(miri, ignore = "fork, poll(2) and threads on real fds")]
fn a_child_after_fork_awaits_jobs_of_inherited_and_new_devices() {
    let (dev, fake) = device();
    // The parent's reactor runs and owns this device's events.
    let mut first = held_jobs(&dev, &fake, 1);
    let signal = Arc::new(Signal::default());
    let seen_first = poll_once(&mut first, &signal);
    fake.finish_jobs();
    block_on_all(&mut first, &signal, seen_first).unwrap()[0]
        .as_ref()
        .unwrap();
    // A handle awaited (its event asked for) before the fork.
    let mut before = held_jobs(&dev, &fake, 1);
    let seen_before = poll_once(&mut before, &signal);
    let code = in_child(|| {
        let signal = Arc::new(Signal::default());
        // 4: the child's copy of the handle awaited before the fork.
        let seen_child = poll_once(&mut before, &signal);
        fake.finish_jobs();
        match block_on_all(&mut before, &signal, seen_child) {
            Ok(r) if r[0].is_ok() => {}
            _ => return 4,
        }
        // 1: a job of the inherited device (the parent's event stream,
        // not the child's to read).
        let mut inherited = held_jobs(&dev, &fake, 1);
        let seen_inherited = poll_once(&mut inherited, &signal);
        fake.finish_jobs();
        match block_on_all(&mut inherited, &signal, seen_inherited) {
            Ok(r) if r[0].is_ok() => {}
            _ => return 1,
        }
        // 2: a device of its own, through the child's reactor.
        let (own, own_fake) = device();
        let mut mine = held_jobs(&own, &own_fake, 2);
        let seen_mine = poll_once(&mut mine, &signal);
        own_fake.finish_jobs();
        match block_on_all(&mut mine, &signal, seen_mine) {
            Ok(r) if r.iter().all(|r| r.is_ok()) => {}
            _ => return 2,
        }
        // 3: the inherited device's events are the parent's.
        let mut evs = Vec::new();
        match dev.read_events(&mut evs) {
            Err(crate::Error::Sys(SysError::EventsBusy { .. })) => 0,
            _ => 3,
        }
    });
    assert_eq!(
        code, 0,
        "child: 1 = a job of the inherited device, 2 = of its own device, \
         4 = a handle awaited before the fork, never completed; 3 = it \
         could read the parent's events"
    );
    // The parent's own copy of the handle awaited before the fork.
    fake.finish_jobs();
    block_on_all(&mut before, &signal, seen_before).unwrap()[0]
        .as_ref()
        .unwrap();
    // The parent's reactor still serves it.
    let mut again = held_jobs(&dev, &fake, 2);
    let seen_again = poll_once(&mut again, &signal);
    fake.finish_jobs();
    for r in block_on_all(&mut again, &signal, seen_again).unwrap() {
        r.unwrap();
    }
}

/// `wait_async` in a tokio runtime built without `enable_io` neither
/// panics (which `panic = "abort"` would make an abort) nor hangs.
#[cfg(feature = "tokio")]
#[test]
#[cfg_attr(miri, ignore = "poll(2) and threads on real fds")]
fn wait_async_in_a_runtime_without_io_does_not_panic() {
    use std::cell::Cell;
    use std::sync::Once;
    thread_local!(static PANICS: Cell<usize> = const { Cell::new(0) });
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.with(|p| p.set(p.get() + 1));
            previous(info);
        }));
    });
    let (dev, fake) = Device::fake_with(
        FakeDevice::FEATURES | (uapi::TDRV_FEAT_EVENTS | uapi::TDRV_FEAT_FENCE_FD) as u64,
    );
    fake.hold_jobs(true);
    let src = Tensor::allocate_on(&dev, 0, 64, None).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    for io in [false, true] {
        let dst = Tensor::allocate_on(&dev, 0, 64, None).unwrap();
        let mut h = Job::new()
            .copy_all(&src, &dst)
            .unwrap()
            .with_out_fence()
            .submit()
            .unwrap();
        assert!(h.fence_fd().is_some());
        let (fake, tx) = (fake.clone(), tx.clone());
        std::thread::spawn(move || {
            let mut b = tokio::runtime::Builder::new_current_thread();
            if io {
                b.enable_io();
            }
            let rt = b.build().unwrap();
            let r = rt.block_on(async {
                let mut fut = std::pin::pin!(h.wait_async());
                let first = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
                assert!(first.is_pending(), "a held job was ready");
                fake.finish_jobs();
                fut.await
            });
            tx.send((io, r, PANICS.with(Cell::get))).unwrap();
        });
        let (io, r, panics) = rx.recv_timeout(BOUND).expect("wait_async hung");
        r.unwrap();
        assert_eq!(panics, 0, "wait_async panicked (enable_io: {io})");
    }
}

/// A fake device that takes `TDRV_SUBMIT_NOTIFY`.
fn device_with_submit_notify() -> (Arc<Device>, Arc<FakeDevice>) {
    Device::fake_with(
        FakeDevice::FEATURES | (uapi::TDRV_FEAT_EVENTS | uapi::TDRV_FEAT_SUBMIT_NOTIFY) as u64,
    )
}

/// The event of job `job_id` that succeeded, asked for with `user_data`.
fn done(job_id: u64, user_data: u64) -> JobEvent {
    JobEvent {
        job_id,
        user_data,
        status: crate::sys::JobStatus::Done,
    }
}

/// A 64-byte copy between two new buffers of `dev`.
fn copy_desc(dev: &Arc<Device>) -> uapi::tdrv_copy_desc {
    let src = dev.alloc(64, 0).unwrap();
    let dst = dev.alloc(64, 0).unwrap();
    uapi::tdrv_copy_desc {
        src_handle: src.handle,
        dst_handle: dst.handle,
        size: 64,
        ..Default::default()
    }
}

#[test]
fn submit_notify_queues_the_event_of_a_job_that_ended_in_the_call() {
    let (dev, _fake) = device_with_submit_notify();
    assert!(dev.supports_submit_notify());
    let d = copy_desc(&dev);
    let id = dev.submit_notify(&[d], 0xabc).unwrap();
    let mut evs = Vec::new();
    assert_eq!(dev.read_events(&mut evs).unwrap(), 1);
    assert_eq!(evs[0], done(id, 0xabc));
}

#[test]
fn submit_notify_of_a_running_job_queues_its_event_when_it_ends() {
    let (dev, fake) = device_with_submit_notify();
    let d = copy_desc(&dev);
    fake.hold_jobs(true);
    let id = dev.submit_notify(&[d], 7).unwrap();
    let mut evs = Vec::new();
    assert_eq!(dev.read_events(&mut evs).unwrap(), 0, "{evs:?}");
    fake.finish_jobs();
    assert_eq!(dev.read_events(&mut evs).unwrap(), 1);
    assert_eq!(evs[0], done(id, 7));
}

#[test]
fn submit_notify_needs_a_driver_of_abi_1_6() {
    let (old, _fake) = device();
    let d = copy_desc(&old);
    assert!(!old.supports_submit_notify());
    assert!(matches!(
        old.submit_notify(&[d], 1),
        Err(crate::Error::Sys(SysError::NotSupported {
            op: "SUBMIT_NOTIFY"
        }))
    ));
}

#[test]
#[cfg_attr(miri, ignore = "poll(2) and threads on real fds")]
fn submit_notify_is_refused_while_the_reactor_reads_the_events() {
    // The reactor reads the events of a device with an awaited handle.
    let (dev, fake) = device_with_submit_notify();
    let mut handles = held_jobs(&dev, &fake, 1);
    let signal = Arc::new(Signal::default());
    let seen = poll_once(&mut handles, &signal);
    let d = copy_desc(&dev);
    assert!(matches!(
        dev.submit_notify(&[d], 1),
        Err(crate::Error::Sys(SysError::EventsBusy {
            op: "SUBMIT_NOTIFY",
            ..
        }))
    ));
    fake.finish_jobs();
    for r in block_on_all(&mut handles, &signal, seen).unwrap() {
        r.unwrap();
    }
}

#[test]
fn a_job_with_an_event_asks_for_it_in_its_submit() {
    let (dev, fake) = device_with_submit_notify();
    let src = Tensor::allocate_on(&dev, 0, 64, None).unwrap();
    let dst = Tensor::allocate_on(&dev, 0, 64, None).unwrap();
    src.write(0, &[5; 64]).unwrap();
    fake.hold_jobs(true);
    let mut job = Job::new();
    let h = job
        .copy_all(&src, &dst)
        .unwrap()
        .with_event(0x51)
        .submit()
        .unwrap();
    let mut evs = Vec::new();
    assert_eq!(dev.read_events(&mut evs).unwrap(), 0, "{evs:?}");
    fake.finish_jobs();
    assert_eq!(dev.read_events(&mut evs).unwrap(), 1);
    assert_eq!(evs[0], done(h.id(), 0x51));
    h.wait().unwrap();
    assert_eq!(dst.to_vec().unwrap(), vec![5; 64]);
    // The builder forgets the event with its copies: the next job
    // submitted from it asks for none.
    fake.hold_jobs(false);
    let h2 = job.copy_all(&src, &dst).unwrap().submit().unwrap();
    h2.wait().unwrap();
    evs.clear();
    assert_eq!(dev.read_events(&mut evs).unwrap(), 0, "{evs:?}");
}

#[test]
fn a_job_with_an_event_on_an_older_driver_queues_nothing() {
    let (old, _fake) = device();
    let src = Tensor::allocate_on(&old, 0, 64, None).unwrap();
    let dst = Tensor::allocate_on(&old, 0, 64, None).unwrap();
    let mut job = Job::new();
    job.copy_all(&src, &dst).unwrap().with_event(1);
    assert!(matches!(
        job.submit(),
        Err(crate::Error::Sys(SysError::NotSupported {
            op: "SUBMIT_NOTIFY"
        }))
    ));
    // Nothing was queued, and the builder keeps its copy for a retry.
    assert_eq!(dst.completion().count().unwrap(), 0);
    assert_eq!(job.len(), 1);
}
