//! `tdrv-sim`: the sim device's host process (docs/sim-device.md). It
//! listens on a Unix socket as the ivshmem server of one QEMU
//! (`-chardev socket,path=SOCK -device ivshmem-doorbell,vectors=QUEUES`),
//! runs the device while QEMU is connected, and exits when QEMU
//! disconnects or on SIGTERM/SIGINT/SIGHUP, printing per-queue statistics
//! to stderr.

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

use clap::Parser;
use std::io;
use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::os::fd::FromRawFd;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use tdrv_sim::layout::defaults;
use tdrv_sim::layout::Config;
use tdrv_sim::Device;
use tdrv_sim::Options;

/// Parses a byte count with an optional K, M or G suffix (powers of 1024).
fn parse_size(s: &str) -> Result<u64, String> {
    let (num, shift) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 10),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 20),
        Some(b'G' | b'g') => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    let n: u64 = num.parse().map_err(|e| format!("{s}: {e}"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{s}: too large"))
}

/// The tdrv sim device: an ivshmem server with HBM, DMA queues and MSI-X.
/// An option given twice takes its last value (so that a caller's extra
/// options override defaults put before them).
#[derive(Parser, Debug)]
#[command(version, about, args_override_self = true)]
struct Args {
    /// Unix socket to listen on (QEMU's `-chardev socket,path=`).
    #[arg(long, short = 's')]
    socket: PathBuf,
    /// Guest RAM file (QEMU's memory-backend-file mem-path, share=on);
    /// created with --guest-ram-size if missing or empty. Without it every
    /// guest-memory address is BAD_ADDR.
    #[arg(long, short = 'r')]
    guest_ram: Option<PathBuf>,
    /// Size of a newly created guest RAM file (K/M/G suffixes).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    guest_ram_size: u64,
    /// The `max-ram-below-4g` of QEMU's pc machine that runs the guest
    /// (K/M/G suffixes; QEMU's default 3.5G): it decides which part of the
    /// guest RAM file lies below 4 GiB and which at 4 GiB.
    #[arg(long, default_value = "3584M", value_parser = parse_size)]
    max_ram_below_4g: u64,
    /// Queues, each with its own thread and MSI-X vector (1-8; QEMU's
    /// `vectors=` must match).
    #[arg(long, short = 'q', default_value_t = defaults::QUEUES)]
    queues: u32,
    /// Entries per descriptor/completion ring (power of two, 16-512).
    #[arg(long, default_value_t = defaults::RING_ENTRIES)]
    ring_entries: u32,
    /// HBM channels (1-16).
    #[arg(long, default_value_t = defaults::CHANNELS)]
    channels: u32,
    /// Bytes per HBM channel (multiple of 2 MiB; K/M/G suffixes).
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    channel_size: u64,
    /// The simulator's ivshmem peer id (the doorbell's destination).
    #[arg(long, default_value_t = 1)]
    peer_id: u16,
    /// How often (microseconds) an idle queue checks reset and inject.
    #[arg(long, default_value_t = 1000)]
    poll_us: u64,
    /// Bandwidth of each queue's DMA engine in MiB/s (0: as fast as the host
    /// copies). With a limit, queues scale like independent engines.
    #[arg(long, default_value_t = 0)]
    engine_mib_s: u64,
    /// At exit, also time a plain memcpy of 16 MiB between two buffers of
    /// this process and print its rate (`tdrv-sim: host memcpy ...`): the
    /// host's copy rate, the baseline of `make bench`'s figure 9s.
    #[arg(long)]
    measure_memcpy: bool,
}

/// Blocks the stop signals in every thread (the queue threads inherit the
/// mask) and returns a signalfd that becomes readable when one arrives.
fn stop_signals() -> io::Result<OwnedFd> {
    // SAFETY: sigset_t is plain data, initialised by sigemptyset before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live sigset_t; these calls only edit it, then
    // install it as this thread's mask (no other thread exists yet) and
    // create a signalfd for it; results are checked.
    let fd = unsafe {
        libc::sigemptyset(&mut set);
        for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
        libc::signalfd(-1, &set, libc::SFD_CLOEXEC)
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn run(args: &Args) -> io::Result<()> {
    let config = Config {
        queues: args.queues,
        ring_entries: args.ring_entries,
        channels: args.channels,
        channel_size: args.channel_size,
        sim_peer_id: u32::from(args.peer_id),
    };
    let sig = stop_signals()?;
    let ram = match &args.guest_ram {
        Some(p) => Some(
            tdrv_sim::open_guest_ram(p, args.guest_ram_size)
                .map_err(|e| io::Error::new(e.kind(), format!("guest RAM {}: {e}", p.display())))?,
        ),
        None => None,
    };
    let ram_len = ram.as_ref().map_or(0, |r| r.len());
    let dev = Device::create_pc(config, ram, args.max_ram_below_4g)?;
    let opts = Options {
        poll: Duration::from_micros(args.poll_us.max(100)),
        client_id: if args.peer_id == 0 { 1 } else { 0 },
        engine_rate: Some(args.engine_mib_s.saturating_mul(1 << 20)),
    };

    // A socket left by an earlier run is replaced; any other file is not.
    if let Ok(m) = std::fs::symlink_metadata(&args.socket) {
        if m.file_type().is_socket() {
            std::fs::remove_file(&args.socket)?;
        }
    }
    let listener = UnixListener::bind(&args.socket)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", args.socket.display())))?;
    let l = &dev.layout;
    eprintln!(
        "tdrv-sim: listening on {} (BAR2 {} MiB: {} queues x {} entries, {} channels x {} MiB; \
         guest RAM {} MiB, {} MiB of it below 4 GiB; peer id {})",
        args.socket.display(),
        l.bar_size >> 20,
        l.config.queues,
        l.config.ring_entries,
        l.config.channels,
        l.config.channel_size >> 20,
        ram_len >> 20,
        dev.mem.ram_map.below_4g >> 20,
        l.config.sim_peer_id
    );

    let result = serve(&dev, &listener, &sig, &opts);
    let _ = std::fs::remove_file(&args.socket);
    tdrv_sim::log::stderr().flush();
    eprint!("{}", dev.stats_lines());
    if args.measure_memcpy {
        const BYTES: usize = 16 << 20;
        const ROUNDS: usize = 9;
        eprintln!(
            "tdrv-sim: host memcpy bytes={BYTES} rounds={ROUNDS} median_ns={}",
            tdrv_sim::probe::host_memcpy_ns(BYTES, ROUNDS)
        );
    }
    result
}

/// Accepts one client (or a stop signal first) and serves it.
fn serve(dev: &Device, listener: &UnixListener, sig: &OwnedFd, opts: &Options) -> io::Result<()> {
    let mut fds = [
        libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: sig.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: fds is a live array of two pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            eprintln!("tdrv-sim: stopped by a signal before any client connected");
            return Ok(());
        }
        if fds[0].revents != 0 {
            break;
        }
    }
    let (sock, _) = listener.accept()?;
    eprintln!("tdrv-sim: client connected (peer id {})", opts.client_id);
    dev.serve(&sock, Some(sig.as_fd()), opts)?;
    let mut why = "client disconnected";
    // SAFETY: poll of one live pollfd with no wait.
    let signalled = unsafe {
        let mut p = libc::pollfd {
            fd: sig.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        libc::poll(&mut p, 1, 0) > 0
    };
    if signalled {
        why = "stopped by a signal";
    }
    eprintln!("tdrv-sim: {why}; queues stopped");
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tdrv-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;
    use super::Args;
    use clap::Parser;

    #[test]
    fn a_later_option_overrides_an_earlier_one() {
        let a = Args::try_parse_from([
            "tdrv-sim",
            "-s",
            "x",
            "--channel-size",
            "768M",
            "--channel-size",
            "64M",
        ])
        .unwrap();
        assert_eq!(a.channel_size, 64 << 20);
    }

    #[test]
    fn sizes_with_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("2k"), Ok(2048));
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999999G").is_err());
    }
}
