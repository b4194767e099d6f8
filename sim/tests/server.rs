//! The simulator against a fake QEMU: the ivshmem handshake over a real
//! Unix socket (values and fds in QEMU 7.2's order), then DMA through the
//! received shared memory, doorbell and interrupt eventfds, then hang-up;
//! and the `tdrv-sim` binary's lifecycle (socket, SIGTERM, statistics).
#![cfg(not(miri))] // sockets, memfds, eventfds and processes: not in Miri
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

use std::io::Read;
use std::os::fd::AsFd;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Command;
use std::process::Stdio;
use std::sync::atomic::Ordering::Acquire;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::Ordering::Release;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;
use tdrv_sim::layout::hdr;
use tdrv_sim::layout::inject;
use tdrv_sim::layout::qb;
use tdrv_sim::layout::Config;
use tdrv_sim::layout::FLAG_DST_DEV;
use tdrv_sim::layout::FLAG_IRQ;
use tdrv_sim::layout::FLAG_SRC_DEV;
use tdrv_sim::layout::MAGIC;
use tdrv_sim::server::recv_msg;
use tdrv_sim::server::EventFd;
use tdrv_sim::shm::Region;
use tdrv_sim::Device;
use tdrv_sim::Options;

/// Bound of every wait for an event: it only turns a hang into a failure.
const HANG: Duration = Duration::from_secs(60);

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tdrv-sim-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn fd_size(fd: &OwnedFd) -> u64 {
    std::fs::File::from(fd.try_clone().unwrap())
        .metadata()
        .unwrap()
        .len()
}

/// What QEMU keeps from the handshake.
struct Client {
    id: i64,
    shm: OwnedFd,
    /// The simulator's doorbells (peer `sim_id`'s eventfds).
    doorbells: Vec<EventFd>,
    /// QEMU's own interrupt eventfds.
    vectors: Vec<EventFd>,
    sim_id: i64,
}

/// Receives the handshake the way QEMU 7.2 checks it.
fn handshake(sock: &UnixStream, queues: usize) -> Client {
    let next = || recv_msg(sock.as_fd()).unwrap().expect("server hung up");
    let (v, fd) = next();
    assert_eq!(
        (v, fd.is_none()),
        (0, true),
        "protocol version 0 without fd first"
    );
    let (id, fd) = next();
    assert!(
        fd.is_none() && (0..=65535).contains(&id),
        "then the client's id, without fd"
    );
    let (v, shm) = next();
    assert_eq!(v, -1, "then the shared memory");
    let shm = shm.expect("shared memory message without fd");
    let mut peers: Vec<(i64, OwnedFd)> = Vec::new();
    for _ in 0..2 * queues {
        let (v, fd) = next();
        peers.push((v, fd.expect("peer message without an eventfd")));
    }
    // First the other peer's eventfds (the simulator's), then the client's own.
    let sim_id = peers[0].0;
    assert_ne!(sim_id, id);
    assert!(peers[..queues].iter().all(|p| p.0 == sim_id));
    assert!(peers[queues..].iter().all(|p| p.0 == id));
    let mut it = peers.into_iter().map(|(_, fd)| EventFd::from_fd(fd));
    let doorbells = it.by_ref().take(queues).collect();
    let vectors = it.collect();
    Client {
        id,
        shm,
        doorbells,
        vectors,
        sim_id,
    }
}

#[test]
fn handshake_then_dma_with_doorbells_and_interrupts() {
    let dir = temp_dir("dma");
    let config = Config {
        queues: 2,
        ring_entries: 16,
        channels: 2,
        channel_size: 2 << 20,
        sim_peer_id: 1,
    };
    let ram = tdrv_sim::open_guest_ram(&dir.join("ram"), 1 << 20).unwrap();
    let dev = Arc::new(Device::create(config, Some(ram)).unwrap());
    let (server, client) = UnixStream::pair().unwrap();
    let t = {
        let dev = dev.clone();
        std::thread::spawn(move || dev.serve(&server, None, &Options::default()))
    };

    let c = handshake(&client, 2);
    assert_eq!((c.id, c.sim_id), (0, 1));
    let layout = config.layout().unwrap();
    assert_eq!(fd_size(&c.shm), layout.bar_size);
    assert!(layout.bar_size.is_power_of_two());
    let bar = Region::map(c.shm, layout.bar_size as usize).unwrap();
    assert_eq!(bar.read_u64(hdr::MAGIC), MAGIC);
    assert_eq!(bar.u32(hdr::VERSION).load(Acquire), 1);
    assert_eq!(bar.u32(hdr::NUM_QUEUES).load(Acquire), 2);
    assert_eq!(bar.u32(hdr::RING_ENTRIES).load(Acquire), 16);
    assert_eq!(bar.u32(hdr::NUM_CHANNELS).load(Acquire), 2);
    assert_eq!(bar.read_u64(hdr::CHANNEL_SIZE), 2 << 20);
    assert_eq!(bar.read_u64(hdr::HBM_OFFSET), layout.hbm_offset);
    assert_eq!(bar.read_u64(hdr::QUEUE_OFFSET), 0x10000);
    assert_eq!(bar.read_u64(hdr::QUEUE_STRIDE), 0x10000);
    assert_eq!(bar.u32(hdr::SIM_PEER_ID).load(Acquire), 1);
    assert_eq!(bar.u32(hdr::READY).load(Acquire), 1);

    // The guest's RAM as QEMU would map it.
    let guest = tdrv_sim::open_guest_ram(&dir.join("ram"), 0).unwrap();
    let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    guest.write_bytes(0x3000, &data);

    let q = 1u32;
    let blk = layout.queue_block(q);
    let post = |src: u64, dst: u64, id: u64, len: u32, flags: u32| {
        let tail = bar.u32(blk + qb::SQ_TAIL).load(Relaxed);
        let o = layout.desc(q, tail);
        bar.write_u64(o, src);
        bar.write_u64(o + 8, dst);
        bar.write_u64(o + 16, id);
        bar.write_u32(o + 24, len);
        bar.write_u32(o + 28, flags);
        bar.u32(blk + qb::SQ_TAIL).store(tail + 1, Release);
    };
    let wait_irq = |what: &str| {
        assert!(
            c.vectors[q as usize].poll(HANG),
            "no interrupt on vector {q} for {what}"
        );
        c.vectors[q as usize].take();
    };
    // host -> device, then device -> host elsewhere: the round trip.
    post(0x3000, 4096, 77, data.len() as u32, FLAG_DST_DEV);
    post(
        4096,
        0x8_0000,
        78,
        data.len() as u32,
        FLAG_SRC_DEV | FLAG_IRQ,
    );
    c.doorbells[q as usize].signal().unwrap();
    wait_irq("the round trip");
    assert_eq!(bar.u32(blk + qb::CQ_TAIL).load(Acquire), 2);
    assert_eq!(bar.u32(blk + qb::SQ_HEAD).load(Acquire), 2);
    for (i, id) in [(0u32, 77u64), (1, 78)] {
        let o = layout.cpl(q, i);
        assert_eq!(
            (bar.read_u64(o), bar.read_u32(o + 8), bar.read_u32(o + 12)),
            (id, 0, 10_000)
        );
    }
    assert_eq!(bar.read_bytes(layout.hbm_offset + 4096, data.len()), data);
    assert_eq!(guest.read_bytes(0x8_0000, data.len()), data);
    // The other queue saw nothing.
    assert!(!c.vectors[0].poll(Duration::from_millis(1)));

    // An injected fault, through BAR2 like the driver would.
    bar.u32(layout.inject(q)).store(inject::FAIL_NEXT, Release);
    post(0x3000, 0, 79, 16, FLAG_DST_DEV | FLAG_IRQ);
    c.doorbells[q as usize].signal().unwrap();
    wait_irq("the failed descriptor");
    let o = layout.cpl(q, 2);
    assert_eq!(
        (bar.read_u64(o), bar.read_u32(o + 8), bar.read_u32(o + 12)),
        (79, 3, 0)
    );

    // A stall, then a reset without any doorbell.
    bar.u32(layout.inject(q)).store(inject::STALL, Release);
    let t0 = Instant::now();
    while bar.u32(blk + qb::STATUS).load(Acquire) != 2 {
        assert!(t0.elapsed() < HANG, "queue did not stall");
        std::thread::sleep(Duration::from_millis(1));
    }
    post(0x3000, 0, 80, 16, FLAG_DST_DEV | FLAG_IRQ);
    c.doorbells[q as usize].signal().unwrap();
    assert!(
        !c.vectors[q as usize].poll(Duration::from_millis(50)),
        "a stalled queue completed"
    );
    bar.u32(blk + qb::RESET).store(1, Release);
    while bar.u32(blk + qb::RESET).load(Acquire) != 0 {
        assert!(t0.elapsed() < HANG, "reset not acknowledged");
        std::thread::sleep(Duration::from_millis(1));
    }
    for f in [
        qb::SQ_TAIL,
        qb::SQ_HEAD,
        qb::CQ_TAIL,
        qb::CQ_HEAD,
        qb::STATUS,
    ] {
        assert_eq!(bar.u32(blk + f).load(Acquire), 0);
    }

    // QEMU goes away: serve() returns and every queue thread has ended.
    drop(client);
    t.join().unwrap().unwrap();
    let s = dev.stats_lines();
    assert!(
        s.contains("queue=1 descs=3 ok=2 bad_addr=0 bad_desc=0 fault=1 bytes=20000 irqs=2"),
        "{s}"
    );
    assert!(s.contains("stalls=1 resets=1"), "{s}");
    assert!(s.contains("queue=0 descs=0"), "{s}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn serve_returns_when_told_to_stop() {
    let dev = Device::create(
        Config {
            queues: 1,
            channels: 1,
            channel_size: 2 << 20,
            ..Config::default()
        },
        None,
    )
    .unwrap();
    let (server, client) = UnixStream::pair().unwrap();
    let stop = EventFd::new().unwrap();
    std::thread::scope(|s| {
        let t = s.spawn(|| dev.serve(&server, Some(stop.as_fd()), &Options::default()));
        let c = handshake(&client, 1);
        // With QEMU still connected, serve() does not return on its own.
        assert!(!t.is_finished(), "serve() returned before the stop");
        stop.signal().unwrap();
        // The stop is the only reason to return: the client is still
        // connected. The bound only turns a hang into a failure.
        let t0 = Instant::now();
        while !t.is_finished() {
            assert!(t0.elapsed() < HANG, "serve() ignored the stop");
            std::thread::sleep(Duration::from_millis(1));
        }
        t.join().unwrap().unwrap();
        // Its queue threads ended with it (serve joins them): nothing was
        // processed, and the connection was never closed from our side.
        let stats = dev.stats_lines();
        assert!(stats.contains("queue=0 descs=0"), "{stats}");
        drop(c);
    });
}

fn wait_for(path: &std::path::Path) {
    let t0 = Instant::now();
    while !path.exists() {
        assert!(t0.elapsed() < HANG, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn sim_command(dir: &std::path::Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tdrv-sim"));
    cmd.args(["--socket", dir.join("sock").to_str().unwrap()])
        .args(["--guest-ram", dir.join("ram").to_str().unwrap()])
        .args(["--guest-ram-size", "4M", "--queues", "3", "--channels", "1"])
        .args(["--channel-size", "2M"])
        .stderr(Stdio::piped());
    cmd
}

#[test]
fn binary_stops_on_sigterm_with_statistics() {
    let dir = temp_dir("sigterm");
    let mut child = sim_command(&dir).spawn().unwrap();
    wait_for(&dir.join("sock"));
    assert_eq!(std::fs::metadata(dir.join("ram")).unwrap().len(), 4 << 20);
    let sock = UnixStream::connect(dir.join("sock")).unwrap();
    let c = handshake(&sock, 3);
    assert_eq!(fd_size(&c.shm), 4 << 20);
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "{status}: {err}");
    assert!(err.contains("stopped by a signal"), "{err}");
    for q in 0..3 {
        assert!(
            err.contains(&format!("tdrv-sim: stats queue={q} descs=0")),
            "{err}"
        );
    }
    assert!(!dir.join("sock").exists(), "socket left behind");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn binary_exits_when_the_client_disconnects() {
    let dir = temp_dir("hangup");
    let mut child = sim_command(&dir).spawn().unwrap();
    wait_for(&dir.join("sock"));
    let sock = UnixStream::connect(dir.join("sock")).unwrap();
    let _c = handshake(&sock, 3);
    drop(sock);
    let status = child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "{status}: {err}");
    assert!(err.contains("client disconnected"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn binary_refuses_a_bad_configuration() {
    let dir = temp_dir("badcfg");
    let out = sim_command(&dir)
        .args(["--ring-entries", "100"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ring entries must be a power of two"), "{err}");
    assert!(!dir.join("sock").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
