//! Thread safety, host-side fences and the completion plane of host
//! tensors.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use tdrv::compat::TensorCompat;
use tdrv::ops::TensorOps;
use tdrv::{Access, Error, PendingAccess, Tensor};

/// Waits until `flag` is set or `limit` passes.
fn eventually(flag: &AtomicBool, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if flag.load(Ordering::SeqCst) {
            return true;
        }
        thread::sleep(Duration::from_millis(2));
    }
    flag.load(Ordering::SeqCst)
}

#[test]
fn many_threads_on_disjoint_slices() {
    // Under Miri: fewer and smaller (the interpreter is slow).
    const THREADS: usize = if cfg!(miri) { 3 } else { 16 };
    const CHUNK: usize = if cfg!(miri) { 64 } else { 4096 };
    let whole = Tensor::allocate_host(THREADS * CHUNK, Some("whole")).unwrap();
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let slice = whole.slice(i * CHUNK, CHUNK, None).unwrap();
            let barrier = barrier.clone();
            thread::spawn(move || {
                barrier.wait();
                for round in 0..if cfg!(miri) { 3 } else { 200u32 } {
                    let v = (i as u32 * 7 + round) as u8;
                    slice.memset(0, v, CHUNK).unwrap();
                    let data = vec![v.wrapping_add(1); CHUNK / 2];
                    slice.write(CHUNK / 4, &data).unwrap();
                    let back = slice.to_vec().unwrap();
                    assert!(back[..CHUNK / 4].iter().all(|&x| x == v));
                    assert!(back[CHUNK / 4..3 * CHUNK / 4]
                        .iter()
                        .all(|&x| x == v.wrapping_add(1)));
                    assert!(back[3 * CHUNK / 4..].iter().all(|&x| x == v));
                    // Out-of-slice access fails instead of touching a
                    // neighbour.
                    assert!(slice.write(CHUNK, &[0]).is_err());
                }
                slice.write(0, &[i as u8; CHUNK]).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let all = whole.to_vec().unwrap();
    for i in 0..THREADS {
        assert!(all[i * CHUNK..(i + 1) * CHUNK]
            .iter()
            .all(|&x| x == i as u8));
    }
    assert_eq!(whole.storage_ref_count(), 1, "every slice was dropped");
}

#[test]
fn overlapping_host_writes_never_tear() {
    const LEN: usize = if cfg!(miri) { 1 << 8 } else { 1 << 20 };
    let t = Tensor::allocate_host(LEN, None).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (1..=2u8)
        .map(|v| {
            let t = t.clone();
            let stop = stop.clone();
            thread::spawn(move || {
                let data = vec![v; LEN];
                while !stop.load(Ordering::Relaxed) {
                    t.write(0, &data).unwrap();
                }
            })
        })
        .collect();
    let mut buf = vec![0u8; LEN];
    for _ in 0..if cfg!(miri) { 3 } else { 50 } {
        t.read(0, &mut buf).unwrap();
        let first = buf[0];
        assert!(buf.iter().all(|&x| x == first), "a read saw a torn write");
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
}

#[test]
fn readers_wait_for_device_writers() {
    let t = Tensor::allocate_host(64, Some("out")).unwrap();
    let slice = t.slice(32, 32, None).unwrap();
    t.mark_async_start(Access::Write).unwrap();
    assert_eq!(
        t.pending_async().unwrap(),
        PendingAccess {
            reads: 0,
            writes: 1
        }
    );
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let done = done.clone();
        // The fence is per storage: a slice's reader waits too.
        thread::spawn(move || {
            let mut b = [0; 4];
            slice.read(0, &mut b).unwrap();
            done.store(true, Ordering::SeqCst);
        })
    };
    assert!(
        !eventually(&done, Duration::from_millis(100)),
        "read did not wait"
    );
    // Polling the fence says "busy".
    assert!(matches!(
        t.wait_device_idle(Access::Read, Some(std::time::Duration::ZERO)),
        Err(Error::Timeout { .. })
    ));
    t.mark_async_finish(Access::Write).unwrap();
    assert!(
        eventually(&done, Duration::from_secs(60)),
        "read was not woken"
    );
    reader.join().unwrap();
    t.wait_device_idle(Access::Write, Some(std::time::Duration::ZERO))
        .unwrap();
}

#[test]
fn writers_wait_for_every_device_access() {
    let t = Tensor::allocate_host(64, None).unwrap();
    t.mark_async_start(Access::Read).unwrap();
    t.mark_async_start(Access::Read).unwrap();

    // A pending device read does not block host reads...
    let mut b = [0; 8];
    t.read(0, &mut b).unwrap();
    t.wait_device_idle(Access::Read, Some(std::time::Duration::ZERO))
        .unwrap();
    // ...but blocks writes, memsets and copies into the storage.
    for op in 0..3 {
        let done = Arc::new(AtomicBool::new(false));
        let h = {
            let (t, done) = (t.clone(), done.clone());
            thread::spawn(move || {
                match op {
                    0 => t.write(0, &[1; 8]).unwrap(),
                    1 => t.memset(0, 2, 8).unwrap(),
                    _ => {
                        let src = Tensor::allocate_host(8, None).unwrap();
                        Tensor::copy(&src, 0, &t, 0, 8).unwrap();
                    }
                }
                done.store(true, Ordering::SeqCst);
            })
        };
        assert!(
            !eventually(&done, Duration::from_millis(50)),
            "op {op} did not wait"
        );
        if op == 2 {
            t.mark_async_finish(Access::Read).unwrap();
            assert!(
                !eventually(&done, Duration::from_millis(50)),
                "woke with a read pending"
            );
            t.mark_async_finish(Access::Read).unwrap();
            assert!(eventually(&done, Duration::from_secs(60)));
        } else {
            // Let it through by draining, then restore the reads.
            t.mark_async_finish(Access::Read).unwrap();
            t.mark_async_finish(Access::Read).unwrap();
            assert!(eventually(&done, Duration::from_secs(60)));
            t.mark_async_start(Access::Read).unwrap();
            t.mark_async_start(Access::Read).unwrap();
        }
        h.join().unwrap();
    }
    assert_eq!(t.pending_async().unwrap(), PendingAccess::default());
    // Unbalanced finishes are refused rather than wrapping.
    assert!(t.mark_async_finish(Access::Write).is_err());
    assert!(t.mark_async_finish(Access::Read).is_err());
}

#[test]
fn timed_device_waits() {
    let t = Tensor::allocate_host(8, None).unwrap();
    t.mark_async_start(Access::Write).unwrap();
    let start = Instant::now();
    let r = t.wait_device_idle(Access::Read, Some(std::time::Duration::from_micros(30_000)));
    assert!(r.unwrap_err().is_timeout());
    assert!(start.elapsed() >= Duration::from_millis(30));
    t.mark_async_finish(Access::Write).unwrap();
    t.wait_device_idle(Access::Write, None).unwrap();
}

#[test]
fn output_completion_counts_per_view() {
    let out = Tensor::allocate_host(128, Some("out")).unwrap();
    // 0 polls.
    out.completion()
        .wait(0, Some(std::time::Duration::ZERO))
        .unwrap();
    assert!(out
        .completion()
        .wait(1, Some(std::time::Duration::ZERO))
        .unwrap_err()
        .is_timeout());
    out.completion().record().unwrap();
    out.completion().record().unwrap();
    out.completion()
        .wait(2, Some(std::time::Duration::ZERO))
        .unwrap();
    assert_eq!(out.completion().count().unwrap(), 2);

    // A slice starts at 0 and counts on its own.
    let s = out.slice(0, 64, None).unwrap();
    assert_eq!(s.completion().count().unwrap(), 0);
    s.completion().record().unwrap();
    assert_eq!(s.completion().count().unwrap(), 1);
    assert_eq!(out.completion().count().unwrap(), 2);

    out.completion().reset().unwrap();
    assert_eq!(out.completion().count().unwrap(), 0);
    assert_eq!(s.completion().count().unwrap(), 1);

    // Timed wait that runs out.
    let start = Instant::now();
    let err = out
        .completion()
        .wait(1, Some(std::time::Duration::from_micros(20_000)))
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }));
    assert!(start.elapsed() >= Duration::from_millis(20));

    // A waiter on another thread is woken by the producer.
    let waiter = {
        let out = out.clone();
        thread::spawn(move || {
            out.completion()
                .wait(3, Some(std::time::Duration::from_micros(10_000_000)))
        })
    };
    for _ in 0..3 {
        thread::sleep(Duration::from_millis(10));
        out.completion().record().unwrap();
    }
    waiter.join().unwrap().unwrap();

    // Fake storage has counters too.
    let f = Tensor::allocate_fake(8, None).unwrap();
    f.completion().record().unwrap();
    f.completion()
        .wait(1, Some(std::time::Duration::ZERO))
        .unwrap();
}

/// nrt's names for the completion plane (`compat::TensorCompat`) are the
/// same count as `Tensor::completion`: each name acts on it, and the view
/// sees what the names did.
#[test]
fn nrt_completion_names_are_the_completion_view() {
    let out = Tensor::allocate_host(16, Some("nrt_out")).unwrap();
    let s = out.slice(0, 8, None).unwrap();
    out.record_output_completion().unwrap();
    assert_eq!(out.completion().count().unwrap(), 1);
    assert_eq!(out.output_completion_count().unwrap(), 1);
    out.check_output_completion(Some(Duration::ZERO), 1)
        .unwrap();
    assert!(out
        .check_output_completion_us(0, 2)
        .unwrap_err()
        .is_timeout());
    out.completion().record().unwrap();
    out.check_output_completion_us(-1, 2).unwrap();
    out.reset_output_completion().unwrap();
    assert_eq!(out.completion().count().unwrap(), 0);
    // Per view, under either name.
    assert_eq!(s.output_completion_count().unwrap(), 0);
    // The view borrows its tensor and names it.
    assert!(out.completion().tensor().same_view(&out));
}

#[test]
fn unbounded_completion_wait_logs_a_heartbeat() {
    let logs = Arc::new(Mutex::new(Vec::<String>::new()));
    {
        let logs = logs.clone();
        tdrv::set_logger(Some(Box::new(move |_, msg| {
            logs.lock().unwrap().push(msg.to_owned())
        })));
    }
    tdrv::set_heartbeat_interval(Duration::from_millis(20));
    let out = Tensor::allocate_host(8, Some("slow_output")).unwrap();
    let waiter = {
        let out = out.clone();
        thread::spawn(move || out.completion().wait(1, None))
    };
    // The heartbeat is the event: wait for it (the bound only turns a
    // missing heartbeat into a failure), then let the waiter through.
    let heartbeat = || {
        logs.lock()
            .unwrap()
            .iter()
            .any(|m| m.contains("slow_output") && m.contains("still waiting"))
    };
    let t0 = Instant::now();
    while !heartbeat() && t0.elapsed() < Duration::from_secs(60) {
        thread::sleep(Duration::from_millis(2));
    }
    out.completion().record().unwrap();
    waiter.join().unwrap().unwrap();
    tdrv::set_heartbeat_interval(Duration::from_secs(30));
    tdrv::set_logger(None);
    let logs = logs.lock().unwrap();
    assert!(
        logs.iter()
            .any(|m| m.contains("slow_output") && m.contains("still waiting")),
        "{logs:?}"
    );
}

#[test]
fn device_only_operations_on_host_storage() {
    let t = Tensor::allocate_host(8, None).unwrap();
    assert!(t.dma_handle().is_none());
    assert!(t.device().is_none());
    let mut j = tdrv::Job::new();
    assert!(matches!(
        j.copy(&t, 0, &t, 0, 8),
        Err(Error::Unsupported { .. })
    ));
    assert!(tdrv::Job::new().submit().is_err());
}
