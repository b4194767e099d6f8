//! tdrv-sim: the simulator behind the tdrv "sim" device (docs/sim-device.md).
//!
//! QEMU's `ivshmem-doorbell` gives the guest a PCI device whose BAR2 is
//! shared memory and whose doorbells and MSI-X vectors are eventfds. This
//! crate is the other end: the ivshmem server ([`server`]), the BAR2 layout
//! ([`layout`]: header, per-queue rings, HBM channels), one DMA engine
//! thread per queue ([`queue`]) copying between HBM and guest RAM
//! ([`dma`]), with fault injection and reset. [`Device::serve`] runs a
//! device for one connected QEMU until it disconnects or is told to stop.
//!
//! Soundness: the memory shared with the guest is never Rust memory; see
//! [`shm`] for the access rules.

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

pub mod dma;
pub mod layout;
pub mod log;
pub mod probe;
pub mod queue;
pub mod server;
pub mod shm;

use dma::Memory;
use layout::Config;
use layout::Layout;
use queue::Doorbell;
use queue::Engine;
use queue::QueueStats;
use server::EventFd;
use server::Handshake;
use server::Vectors;
use shm::Region;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// How a running device behaves beyond its [`Config`].
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// How often an idle queue looks at `reset` and `inject[q]`.
    pub poll: Duration,
    /// The peer id given to QEMU.
    pub client_id: u16,
    /// Bandwidth of each queue's engine in bytes per second (None: as fast
    /// as the host copies).
    pub engine_rate: Option<u64>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            poll: Duration::from_millis(1),
            client_id: 0,
            engine_rate: None,
        }
    }
}

/// A sim device: BAR2 with its header written, guest RAM, per-queue stats.
pub struct Device {
    /// Where everything lies.
    pub layout: Layout,
    /// HBM, guest RAM and BAR2 itself.
    pub mem: Arc<Memory>,
    /// One per queue.
    pub stats: Vec<Arc<QueueStats>>,
}

impl Device {
    /// A device over BAR2 `bar` (at least `layout.bar_size` bytes) and
    /// guest RAM `ram` of a pc machine with QEMU's default
    /// `max-ram-below-4g`; writes the header (ready last).
    pub fn new(config: Config, bar: Region, ram: Option<Region>) -> io::Result<Device> {
        Self::new_pc(config, bar, ram, dma::PC_MAX_RAM_BELOW_4G)
    }

    /// [`new`](Self::new) for a pc machine whose `max-ram-below-4g` is
    /// `max_ram_below_4g` (see [`dma::RamMap`]).
    pub fn new_pc(
        config: Config,
        bar: Region,
        ram: Option<Region>,
        max_ram_below_4g: u64,
    ) -> io::Result<Device> {
        let layout = config
            .layout()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let bar = Arc::new(bar);
        let mem = Arc::new(Memory::with_max_ram_below_4g(
            bar.clone(),
            &layout,
            ram.map(Arc::new),
            max_ram_below_4g,
        ));
        queue::write_header(&bar, &layout);
        let stats = (0..config.queues).map(|_| Arc::default()).collect();
        Ok(Device { layout, mem, stats })
    }

    /// A device whose BAR2 is a new memfd of the layout's size.
    pub fn create(config: Config, ram: Option<Region>) -> io::Result<Device> {
        Self::create_pc(config, ram, dma::PC_MAX_RAM_BELOW_4G)
    }

    /// [`create`](Self::create) for a pc machine whose `max-ram-below-4g`
    /// is `max_ram_below_4g`.
    pub fn create_pc(
        config: Config,
        ram: Option<Region>,
        max_ram_below_4g: u64,
    ) -> io::Result<Device> {
        let layout = config
            .layout()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let bar = Region::memfd("tdrv-sim-bar2", layout.bar_size as usize)?;
        Device::new_pc(config, bar, ram, max_ram_below_4g)
    }

    /// BAR2's fd (for the client).
    pub fn shm_fd(&self) -> BorrowedFd<'_> {
        self.mem.bar.fd().expect("BAR2 is not a file").as_fd()
    }

    /// Serves one connected client (QEMU): sends the handshake, runs every
    /// queue on its own thread, and returns once the client hangs up or
    /// `stop_fd` (e.g. a signalfd) becomes readable; the threads are
    /// stopped and joined before it returns.
    pub fn serve(
        &self,
        sock: &UnixStream,
        stop_fd: Option<BorrowedFd<'_>>,
        opts: &Options,
    ) -> io::Result<()> {
        let q = self.layout.config.queues as usize;
        let doorbells = (0..q)
            .map(|_| EventFd::new())
            .collect::<io::Result<Vec<_>>>()?;
        let vectors = Vectors(
            (0..q)
                .map(|_| EventFd::new())
                .collect::<io::Result<Vec<_>>>()?,
        );
        Handshake {
            client_id: opts.client_id,
            sim_id: self.layout.config.sim_peer_id as u16,
            shm: self.shm_fd(),
            doorbells: &doorbells,
            vectors: &vectors.0,
        }
        .send(sock.as_fd())?;
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            for (i, bell) in doorbells.iter().enumerate() {
                let mut e = Engine::new(
                    i as u32,
                    self.layout,
                    self.mem.clone(),
                    self.stats[i].clone(),
                );
                e.set_rate(opts.engine_rate);
                let (vectors, stop) = (&vectors, &stop);
                std::thread::Builder::new()
                    .name(format!("tdrv-sim-q{i}"))
                    .spawn_scoped(s, move || queue::run(e, bell, vectors, stop, opts.poll))
                    .expect("spawning a queue thread");
            }
            let r = wait_hangup(sock, stop_fd);
            stop.store(true, Ordering::Release);
            for b in &doorbells {
                b.ring();
            }
            r
        })
    }

    /// One line per queue: `tdrv-sim: stats queue=Q descs=... ...`.
    pub fn stats_lines(&self) -> String {
        self.stats
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut line = format!("tdrv-sim: stats queue={i} {s}\n");
                if let Some(probes) = s.probe_line() {
                    line += &format!("tdrv-sim: memcpy probes queue={i} {probes}\n");
                }
                line
            })
            .collect()
    }
}

/// Waits until the client hangs up (end of stream or error) or `stop_fd`
/// is readable. Anything the client sends is read and ignored (QEMU sends
/// nothing).
fn wait_hangup(sock: &UnixStream, stop_fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let mut fds = vec![libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    if let Some(f) = stop_fd {
        fds.push(libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
    }
    loop {
        // SAFETY: fds is a live array of fds.len() pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds.len() > 1 && fds[1].revents != 0 {
            return Ok(());
        }
        if fds[0].revents != 0 {
            let mut buf = [0u8; 64];
            // SAFETY: reads into a live local buffer of its size.
            let r = unsafe {
                libc::recv(
                    sock.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if r == 0 || (r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock) {
                return Ok(());
            }
        }
    }
}

/// Opens the guest RAM file (QEMU's memory-backend-file mem-path), creating
/// it with `size_if_new` bytes if it is missing or empty, and maps it all.
pub fn open_guest_ram(path: &Path, size_if_new: u64) -> io::Result<Region> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    let mut len = f.metadata()?.len();
    if len == 0 {
        f.set_len(size_if_new)?;
        len = size_if_new;
    }
    let len = usize::try_from(len).map_err(io::Error::other)?;
    Region::map(f.into(), len)
}
