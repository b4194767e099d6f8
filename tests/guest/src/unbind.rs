//! Checks shared by the programs that unbind their device from tdrv
//! through sysfs (`edu`, `sim`): what an open file still does once its
//! device is gone.

use std::{sync::Arc, thread};

use tdrv_uapi::*;

use crate::{
    desc, expect_eq, expect_err, inject, ok,
    raw::Dev,
    sync::poll_in,
    wait::{until, until_asleep_in, HANG},
};

/// Waits until thread `tid` of this process sleeps in poll(2) (the C
/// library may make it `poll` or `ppoll`).
fn until_asleep_in_poll(tid: i32) -> Result<(), String> {
    let dir = format!("/proc/self/task/{tid}");
    until(&format!("thread {tid} asleep in poll"), || {
        let syscall = std::fs::read_to_string(format!("{dir}/syscall"))
            .map_err(|e| format!("{dir}/syscall: {e}"))?;
        let stat = std::fs::read_to_string(format!("{dir}/stat"))
            .map_err(|e| format!("{dir}/stat: {e}"))?;
        let state = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next());
        let nr = syscall.split_whitespace().next().unwrap_or("");
        let in_poll = [libc::SYS_poll, libc::SYS_ppoll]
            .iter()
            .any(|n| n.to_string() == nr);
        Ok(in_poll && state == Some('S'))
    })
}

fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

/// (job_id, user_data, status) of events, for comparing them.
fn triples(evs: &[tdrv_event]) -> Result<Vec<(u64, u64, i32)>, String> {
    evs.iter()
        .map(|e| {
            expect_eq("event type", e.type_, TDRV_EVENT_JOB_DONE)?;
            Ok((e.job_id, e.user_data, e.status))
        })
        .collect()
}

/// One file of the device with a job held by the engine behind the
/// others, and its event asked for.
fn held_file(node: &str, user_data: u64) -> Result<(Dev, u64), String> {
    let f = ok("open", Dev::open(node))?;
    let a = ok("alloc", f.alloc(4096, 0))?;
    let b = ok("alloc", f.alloc(4096, 0))?;
    let id = ok("submit", f.submit(&[desc(a.handle, 0, b.handle, 0, 4096)]))?;
    ok("notify", f.job_notify(id, user_data))?;
    Ok((f, id))
}

/// Unbinds the device at `node` (PCI address `pci`, bound to the PCI
/// driver whose sysfs directory is `driver_dir`) while its files have
/// completion events queued and asked for, and checks that they keep
/// working: a job that ended before gives its event with its status, jobs
/// that had not (held by the engine, debugfs `hold_job`, never released)
/// give theirs with ENODEV; a reader asleep in read(2) and a poller asleep
/// in poll(2) wake with them; read and poll work as before afterwards
/// (EAGAIN, not readable, once all are read), while JOB_NOTIFY and
/// JOB_WAIT fail with ENODEV. Leaves the device unbound and returns the
/// first file, still open.
pub fn events_across_unbind(node: &str, driver_dir: &str, pci: &str) -> Result<Dev, String> {
    let f = ok("open", Dev::open(node))?;
    let a = ok("alloc", f.alloc(4096, 0))?;
    let b = ok("alloc", f.alloc(4096, 0))?;
    ok("copy_in", f.copy_in(a.handle, 0, &[0x2e; 4096]))?;
    // A job that ends before the unbind; its event stays unread.
    let done = ok("submit", f.submit(&[desc(a.handle, 0, b.handle, 0, 4096)]))?;
    expect_eq(
        "the job before the hold",
        ok("job_wait", f.job_wait(done, HANG.as_micros() as i64))?,
        (TDRV_JOB_DONE, 0),
    )?;
    ok("notify", f.job_notify(done, 100))?;
    // From now on the engine starts no job.
    inject(node, "hold_job")?;
    let held = ok("submit", f.submit(&[desc(a.handle, 0, b.handle, 0, 4096)]))?;
    let behind = ok("submit", f.submit(&[desc(b.handle, 0, a.handle, 0, 4096)]))?;
    ok("notify", f.job_notify(held, 101))?;
    ok("notify", f.job_notify(behind, 102))?;
    expect_eq(
        "the held job",
        ok("job_wait", f.job_wait(held, 0))?,
        (TDRV_JOB_PENDING, 0),
    )?;
    // A reader asleep in read(2) and a poller asleep in poll(2), each on a
    // file of its own whose only event is a held job's.
    let (g, g_job) = held_file(node, 103)?;
    let (h, h_job) = held_file(node, 104)?;
    let (g, h) = (Arc::new(g), Arc::new(h));
    let (reader_tx, reader_rx) = std::sync::mpsc::channel();
    let reader = {
        let g = g.clone();
        thread::spawn(move || {
            let _ = reader_tx.send(gettid());
            let mut ev = [tdrv_event::default(); 1];
            g.read_events(&mut ev).map(|n| ev[..n].to_vec())
        })
    };
    let (poller_tx, poller_rx) = std::sync::mpsc::channel();
    let poller = {
        let h = h.clone();
        thread::spawn(move || {
            let _ = poller_tx.send(gettid());
            poll_in(h.fd(), HANG.as_millis() as i32)
        })
    };
    let reader_tid = reader_rx.recv().map_err(|_| "the reader died")?;
    let poller_tid = poller_rx.recv().map_err(|_| "the poller died")?;
    until_asleep_in(reader_tid, libc::SYS_read)?;
    until_asleep_in_poll(poller_tid)?;
    expect_eq(
        "g readable before the unbind",
        ok("poll", poll_in(g.fd(), 0))?,
        false,
    )?;
    std::fs::write(format!("{driver_dir}/unbind"), pci)
        .map_err(|e| format!("unbind {pci}: {e}"))?;

    let woke = reader.join().map_err(|_| "the reader panicked")?;
    let woke = ok("read asleep across the unbind", woke)?;
    expect_eq(
        "the sleeping reader's event",
        triples(&woke)?,
        vec![(g_job, 103, -libc::ENODEV)],
    )?;
    let polled = poller.join().map_err(|_| "the poller panicked")?;
    expect_eq("poll asleep across the unbind", ok("poll", polled)?, true)?;
    let mut ev = [tdrv_event::default(); 4];
    let n = ok("read after the poll", h.read_events(&mut ev))?;
    expect_eq(
        "the poller's file's event",
        triples(&ev[..n])?,
        vec![(h_job, 104, -libc::ENODEV)],
    )?;

    // The first file: the event of the job that ended before comes first
    // (oldest first), with its status; then the two that the unbind
    // ended, in either order.
    expect_eq(
        "readable after the unbind",
        ok("poll", poll_in(f.fd(), 0))?,
        true,
    )?;
    let mut ev = [tdrv_event::default(); 4];
    let n = ok("read after the unbind", f.read_events(&mut ev))?;
    let mut got = triples(&ev[..n])?;
    if got.len() == 3 {
        got[1..].sort();
    }
    expect_eq(
        "events after the unbind",
        got,
        vec![
            (done, 100, 0),
            (held, 101, -libc::ENODEV),
            (behind, 102, -libc::ENODEV),
        ],
    )?;
    expect_eq("readable once read", ok("poll", poll_in(f.fd(), 0))?, false)?;
    ok("O_NONBLOCK", f.set_nonblock(true))?;
    let r = f.read_events(&mut ev);
    ok("O_NONBLOCK off", f.set_nonblock(false))?;
    expect_err("read with nothing queued (O_NONBLOCK)", r, libc::EAGAIN)?;
    expect_err(
        "JOB_NOTIFY after the unbind",
        f.job_notify(held, 1),
        libc::ENODEV,
    )?;
    expect_err(
        "JOB_NOTIFY of the ended job",
        f.job_notify(done, 1),
        libc::ENODEV,
    )?;
    expect_err(
        "JOB_WAIT after the unbind",
        f.job_wait(held, 0),
        libc::ENODEV,
    )?;
    Ok(f)
}

/// On a file whose device was unbound: VERSION still answers with the
/// device's description (`want`, what it said before), CHANNEL_INFO fails
/// with ENODEV like every other ioctl.
pub fn version_after_unbind(f: &Dev, want: &tdrv_version) -> Result<(), String> {
    let v = ok("VERSION after the unbind", f.version())?;
    expect_eq(
        "VERSION after the unbind (abi, features, kind, channels, max size)",
        (
            v.abi_major,
            v.abi_minor,
            v.features,
            v.device_kind,
            v.num_channels,
            v.max_buffer_size,
        ),
        (
            want.abi_major,
            want.abi_minor,
            want.features,
            want.device_kind,
            want.num_channels,
            want.max_buffer_size,
        ),
    )?;
    expect_err(
        "CHANNEL_INFO after the unbind",
        f.channel_info(0).map(drop),
        libc::ENODEV,
    )
}

/// Binds the PCI device `pci` to the driver of `driver_dir` again; returns once its node
/// exists (the bind probes synchronously and devtmpfs creates the node
/// before the probe returns).
pub fn rebind(driver_dir: &str, pci: &str, kind: u32) -> Result<String, String> {
    std::fs::write(format!("{driver_dir}/bind"), pci).map_err(|e| format!("bind {pci}: {e}"))?;
    crate::device_nodes(kind)
        .first()
        .cloned()
        .ok_or_else(|| format!("no device node of kind {kind} after the rebind"))
}

/// The two checks above as counted TAP checks on the (single) device of
/// `kind` bound to the PCI driver of `driver_dir` (tdrv's edu driver is
/// `tdrv`, its sim driver `tdrv-sim`): events across its unbind, then VERSION and
/// CHANNEL_INFO on the file left open; the device is bound again at the
/// end (also when the first check failed after unbinding it).
pub fn checks(t: &mut crate::Tap, kind: u32, driver_dir: &str) {
    let pci = crate::bound_pci_address(driver_dir);
    let mut unbound: Option<(Dev, tdrv_version)> = None;
    t.run(
        "events across unbind: ended and held jobs' events arrive (ENODEV for the held), read and poll keep working, JOB_NOTIFY and JOB_WAIT are ENODEV",
        || -> Result<(), String> {
            let pci = pci.clone()?;
            let node = crate::device_nodes(kind)
                .first()
                .cloned()
                .ok_or("no device node")?;
            let want = ok("version", ok("open", Dev::open(&node))?.version())?;
            unbound = Some((events_across_unbind(&node, driver_dir, &pci)?, want));
            Ok(())
        },
    );
    t.run(
        "after unbind: VERSION answers with the device's description, CHANNEL_INFO is ENODEV; rebind works",
        || -> Result<(), String> {
            let r = match &unbound {
                Some((f, want)) => version_after_unbind(f, want),
                None => Err("the check before left no file of an unbound device".into()),
            };
            drop(unbound);
            let pci = pci?;
            // Bound again whatever happened above, for the programs after.
            let rebound = if crate::bound_pci_address(driver_dir).is_err() {
                rebind(driver_dir, &pci, kind).and_then(|node| {
                    let f = ok("open after the rebind", Dev::open(&node))?;
                    ok("channel_info after the rebind", f.channel_info(0)).map(drop)
                })
            } else {
                Ok(())
            };
            r.and(rebound)
        },
    );
}
