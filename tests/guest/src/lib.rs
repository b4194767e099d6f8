//! Shared pieces of the guest test programs: a kselftest-style TAP 13
//! reporter and raw access to a tdrv device node.
//!
//! Exit codes follow kselftest: 0 all passed, 1 something failed, 4 the
//! whole program was skipped (feature absent).

pub mod bail;
pub mod dmabuf;
pub mod inject;
pub mod kmsg;
pub mod raw;
pub mod sync;
pub mod uffd;
pub mod unbind;
pub mod wait;

pub use inject::{failure_injection, inject, Hold, SimWatchdog};

use std::fmt::Display;

/// kselftest exit code for a skipped program.
pub const KSFT_SKIP: i32 = 4;

/// A TAP 13 reporter. Every check prints one `ok`/`not ok` line at once, so
/// a guest that dies mid-run still leaves a readable log.
///
/// A result line ends with the check's duration, `# time=12ms`: the time
/// since the previous line (or since `new`), which is the check's body when
/// the program reports each check as it finishes. scripts/test lists the
/// slowest checks from it. A skip keeps the TAP form `# SKIP reason`.
pub struct Tap {
    planned: usize,
    run: usize,
    failed: usize,
    last: std::time::Instant,
}

impl Tap {
    /// Prints the header and the plan.
    pub fn new(planned: usize) -> Self {
        println!("TAP version 13");
        println!("1..{planned}");
        Tap {
            planned,
            run: 0,
            failed: 0,
            last: std::time::Instant::now(),
        }
    }

    /// Milliseconds since the previous result line, and restarts the clock.
    fn lap_ms(&mut self) -> u128 {
        let now = std::time::Instant::now();
        let ms = now.duration_since(self.last).as_millis();
        self.last = now;
        ms
    }

    /// Records one test: `outcome` is a bool or a `Result` whose error says why.
    pub fn check(&mut self, name: &str, outcome: impl Outcome) {
        self.run += 1;
        let ms = self.lap_ms();
        match outcome.into_result() {
            Ok(()) => println!("ok {} {name} # time={ms}ms", self.run),
            Err(why) => {
                self.failed += 1;
                println!("not ok {} {name} # time={ms}ms", self.run);
                for line in why.lines() {
                    println!("# {line}");
                }
            }
        }
    }

    /// Runs one test body and records its outcome.
    pub fn run(&mut self, name: &str, body: impl FnOnce() -> Result<(), String>) {
        self.check(name, body());
    }

    /// Records a test that cannot run here, with the reason.
    pub fn skip(&mut self, name: &str, reason: &str) {
        self.run += 1;
        self.lap_ms();
        println!("ok {} {name} # SKIP {reason}", self.run);
    }

    /// Prints a diagnostic line.
    pub fn note(&self, msg: impl Display) {
        println!("# {msg}");
    }

    /// Prints the totals and exits with the kselftest status. Tests that were
    /// planned but never reported count as failures.
    pub fn finish(self) -> ! {
        let missing = self.planned.saturating_sub(self.run);
        let extra = self.run.saturating_sub(self.planned);
        if missing > 0 || extra > 0 {
            println!("# plan was {} but {} tests ran", self.planned, self.run);
        }
        let failed = self.failed + missing + extra;
        println!("# Totals: pass:{} fail:{failed}", self.run - self.failed);
        std::process::exit(if failed == 0 { 0 } else { 1 })
    }
}

/// What a test check can return.
pub trait Outcome {
    fn into_result(self) -> Result<(), String>;
}

impl Outcome for bool {
    fn into_result(self) -> Result<(), String> {
        if self {
            Ok(())
        } else {
            Err("check was false".into())
        }
    }
}

impl<E: Display> Outcome for Result<(), E> {
    fn into_result(self) -> Result<(), String> {
        self.map_err(|e| e.to_string())
    }
}

/// Turns a raw call's errno into a message naming the step.
pub fn ok<T>(what: &str, r: Result<T, raw::Errno>) -> Result<T, String> {
    r.map_err(|e| {
        format!(
            "{what}: errno {e} ({})",
            std::io::Error::from_raw_os_error(e)
        )
    })
}

/// Passes only if `got` failed with exactly `want`.
pub fn expect_err<T: std::fmt::Debug>(
    what: &str,
    got: Result<T, raw::Errno>,
    want: raw::Errno,
) -> Result<(), String> {
    match got {
        Err(e) if e == want => Ok(()),
        other => Err(format!("{what}: got {other:?}, want Err({want})")),
    }
}

/// Opens the device named by the first argument (default `default`). If it
/// cannot be opened, or `wanted_kind` is given and differs, prints a
/// skipped TAP plan and exits with the kselftest skip code.
pub fn open_device_or_skip(
    default: &str,
    wanted_kind: Option<u32>,
) -> (raw::Dev, String, tdrv_uapi::tdrv_version) {
    let path = std::env::args().nth(1).unwrap_or_else(|| default.into());
    let opened = raw::Dev::open(&path).and_then(|d| d.version().map(|v| (d, v)));
    match opened {
        Ok((dev, v)) if wanted_kind.is_none_or(|k| k == v.device_kind) => (dev, path, v),
        Ok(_) => skip_all(&format!(
            "{path} is not the kind of device this program tests"
        )),
        Err(e) => skip_all(&format!("cannot open {path}: errno {e}")),
    }
}

/// Prints a skipped TAP plan with the reason and exits with the kselftest
/// skip code.
pub fn skip_all(reason: &str) -> ! {
    println!("TAP version 13\n1..0 # SKIP {reason}");
    std::process::exit(KSFT_SKIP)
}

/// Fails with a message naming both values when they differ.
pub fn expect_eq<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: T,
    want: T,
) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, want {want:?}"))
    }
}

/// The exit code of a child's wait status. A child killed by a signal
/// (or stopped) has no exit code: that is an error naming the signal, so
/// that a crash never reads as `WEXITSTATUS` 0.
pub fn exit_code(status: i32) -> Result<i32, String> {
    if libc::WIFEXITED(status) {
        Ok(libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        Err(format!(
            "the child was killed by signal {}",
            libc::WTERMSIG(status)
        ))
    } else {
        Err(format!("the child did not exit: wait status {status:#x}"))
    }
}

/// Short name of an errno value, for messages and histograms.
pub fn errno_name(e: raw::Errno) -> String {
    let name = match e {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::E2BIG => "E2BIG",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::EXDEV => "EXDEV",
        libc::ENODEV => "ENODEV",
        libc::EINVAL => "EINVAL",
        libc::ENFILE => "ENFILE",
        libc::EMFILE => "EMFILE",
        libc::ENOTTY => "ENOTTY",
        libc::ENOSPC => "ENOSPC",
        libc::ERANGE => "ERANGE",
        libc::EOVERFLOW => "EOVERFLOW",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::ECANCELED => "ECANCELED",
        libc::ESRCH => "ESRCH",
        libc::ENXIO => "ENXIO",
        libc::ENODATA => "ENODATA",
        libc::ESTALE => "ESTALE",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ERESTART => "ERESTART",
        _ => return format!("errno {e}"),
    };
    name.into()
}

/// A small seeded pseudo-random generator (xorshift64* seeded through
/// splitmix64), so that a failing run can be replayed from its seed.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        // splitmix64 of the seed: any seed, 0 included, gives a non-zero state.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        // The modulo bias is irrelevant for fuzzing.
        self.next_u64() % n
    }

    /// True with probability `num`/`den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    /// A new generator for a thread or child, derived from this one.
    pub fn fork(&mut self) -> Rng {
        Rng::new(self.next_u64())
    }
}

/// `(used_bytes, buffers)` of every channel of the device.
pub fn channel_usage(dev: &raw::Dev, channels: u32) -> Result<Vec<(u64, u64)>, String> {
    (0..channels)
        .map(|ch| ok("channel_info", dev.channel_info(ch)).map(|c| (c.used_bytes, c.buffers)))
        .collect()
}

/// Polls every channel's usage every 10 ms until it equals `want`, for at
/// most `limit` (jobs of closed files may still be draining).
pub fn wait_usage(
    dev: &raw::Dev,
    want: &[(u64, u64)],
    limit: std::time::Duration,
) -> Result<std::time::Duration, String> {
    let start = std::time::Instant::now();
    loop {
        let now = channel_usage(dev, want.len() as u32)?;
        if now == want {
            return Ok(start.elapsed());
        }
        if start.elapsed() >= limit {
            return Err(format!(
                "channel (used_bytes, buffers) still {now:?} after {limit:?}, want {want:?}"
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A numeric line `key: N` of the device's debugfs statistics
/// (`/sys/kernel/debug/tdrv/<node>/stats`), if the driver reports it.
pub fn device_stat(path: &str, key: &str) -> Option<u64> {
    let node = path.rsplit('/').next()?;
    let text = std::fs::read_to_string(format!("/sys/kernel/debug/tdrv/{node}/stats")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
}

extern "C" fn on_fatal(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    let mut msg = *b"# fatal signal 00 at address 0x0000000000000000\n";
    msg[15] = b'0' + (sig / 10) as u8;
    msg[16] = b'0' + (sig % 10) as u8;
    for i in 0..16 {
        let nibble = (addr >> (60 - 4 * i)) & 0xf;
        msg[31 + i] = b"0123456789abcdef"[nibble];
    }
    // SAFETY: write(2) and signal(2)/raise(3) are async-signal-safe.
    unsafe {
        libc::write(1, msg.as_ptr().cast(), msg.len());
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// Reports a SIGBUS or SIGSEGV (e.g. a touch of a mapping the driver
/// accepted) with its address on stdout, then dies of it as before.
pub fn install_fatal_handlers() {
    for sig in [libc::SIGBUS, libc::SIGSEGV] {
        // SAFETY: installs a handler that only uses async-signal-safe calls.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_fatal as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// A copy descriptor: `size` bytes from `src` at `src_offset` to `dst` at
/// `dst_offset`.
pub fn desc(
    src: u64,
    src_offset: u64,
    dst: u64,
    dst_offset: u64,
    size: u64,
) -> tdrv_uapi::tdrv_copy_desc {
    tdrv_uapi::tdrv_copy_desc {
        src_handle: src,
        src_offset,
        dst_handle: dst,
        dst_offset,
        size,
    }
}

/// One counter of a device's debugfs statistics, with an error naming it.
pub fn stat(node: &str, key: &str) -> Result<u64, String> {
    device_stat(node, key).ok_or_else(|| format!("no {key} in the stats of {node}"))
}

/// Waits (at most `limit`) until every job submitted to the device at
/// `node` has ended, as its debugfs statistics count them.
pub fn all_jobs_ended(node: &str, limit: std::time::Duration) -> Result<(), String> {
    let t0 = std::time::Instant::now();
    loop {
        let submitted = stat(node, "jobs_submitted")?;
        let ended = stat(node, "jobs_completed")?
            + stat(node, "jobs_failed")?
            + stat(node, "jobs_cancelled")?;
        if ended == submitted {
            return Ok(());
        }
        if t0.elapsed() > limit {
            return Err(format!(
                "{} of {submitted} jobs still running",
                submitted - ended
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A child process holding its own mapping of a buffer (mappings are not
/// inherited: DONTCOPY), for tests of what unbind does to mappings. On request it reads the mapping and exits 0; if
/// the pages are gone it dies of SIGBUS instead.
///
/// A child the test did not wait for (a check that failed before
/// [`MappedChild::touch_and_wait`]) is killed and reaped on drop, so that
/// its mapping does not keep the module loaded for the checks after it.
pub struct MappedChild {
    pid: libc::pid_t,
    go: i32,
    reaped: std::cell::Cell<bool>,
}

impl MappedChild {
    pub fn spawn(dev: &raw::Dev, buf: &tdrv_uapi::tdrv_alloc) -> Result<Self, String> {
        let (mut ready, mut go) = ([0; 2], [0; 2]);
        // SAFETY: pipe(2) into local arrays.
        if unsafe { libc::pipe(ready.as_mut_ptr()) } != 0
            || unsafe { libc::pipe(go.as_mut_ptr()) } != 0
        {
            return Err("pipe".into());
        }
        // SAFETY: the child runs only the code below and leaves with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let m = dev.map(buf);
            let mut byte = 0u8;
            // SAFETY: one-byte reads and writes on our pipe ends.
            unsafe {
                libc::write(ready[1], b"r".as_ptr().cast(), 1);
                libc::read(go[0], (&mut byte as *mut u8).cast(), 1);
            }
            let code = match m {
                Ok(m) => {
                    // SAFETY: a volatile read of our own (maybe revoked)
                    // mapping; revoked pages raise SIGBUS here.
                    let _ = unsafe { std::ptr::read_volatile(m.as_slice().as_ptr()) };
                    0
                }
                Err(_) => 3,
            };
            // SAFETY: leaves the child without running the parent's cleanup.
            unsafe { libc::_exit(code) };
        }
        let mut byte = 0u8;
        // SAFETY: waits for the child to have mapped the buffer.
        unsafe { libc::read(ready[0], (&mut byte as *mut u8).cast(), 1) };
        // SAFETY: closing the ends this process does not use.
        unsafe {
            libc::close(ready[0]);
            libc::close(ready[1]);
            libc::close(go[0]);
        }
        Ok(MappedChild {
            pid,
            go: go[1],
            reaped: std::cell::Cell::new(false),
        })
    }

    /// Lets the child touch its mapping; returns its wait status.
    pub fn touch_and_wait(&self) -> Result<i32, String> {
        let mut status = 0;
        // SAFETY: a one-byte write on our pipe end, then reaping our child.
        unsafe {
            libc::write(self.go, b"g".as_ptr().cast(), 1);
            if libc::waitpid(self.pid, &mut status, 0) != self.pid {
                return Err("waitpid".into());
            }
        }
        self.reaped.set(true);
        Ok(status)
    }
}

impl Drop for MappedChild {
    fn drop(&mut self) {
        // SAFETY: our own child (killed and reaped only if not reaped
        // yet) and our own pipe end.
        unsafe {
            if !self.reaped.get() {
                libc::kill(self.pid, libc::SIGKILL);
                libc::waitpid(self.pid, std::ptr::null_mut(), 0);
            }
            libc::close(self.go);
        }
    }
}

/// The PCI address of the (single) device bound to the driver whose sysfs
/// directory is `driver_dir`.
pub fn bound_pci_address(driver_dir: &str) -> Result<String, String> {
    std::fs::read_dir(driver_dir)
        .map_err(|e| format!("{driver_dir}: {e}"))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.contains(':') && n.contains('.'))
        .ok_or_else(|| format!("no PCI device bound to {driver_dir}"))
}

/// The tdrv device nodes that exist now whose device kind is `kind`
/// (`TDRV_DEVICE_*`), sorted.
pub fn device_nodes(kind: u32) -> Vec<String> {
    let mut nodes: Vec<String> = std::fs::read_dir("/dev")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
                .filter(|p| p.starts_with("/dev/tdrv"))
                .collect()
        })
        .unwrap_or_default();
    nodes.sort();
    nodes.retain(|p| {
        raw::Dev::open(p)
            .and_then(|d| d.version())
            .is_ok_and(|v| v.device_kind == kind)
    });
    nodes
}

/// Turns a hang into a failure that says where each thread was: if not
/// dropped within `secs` seconds (guest time), prints every thread's state,
/// wait channel and kernel stack as TAP comments and exits the program
/// with status 1.
pub struct HangGuard {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HangGuard {
    /// Arms the guard for `what`.
    pub fn arm(what: &str, secs: u64) -> HangGuard {
        let (stop, rx) = std::sync::mpsc::channel::<()>();
        let what = what.to_owned();
        let thread = std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                rx.recv_timeout(std::time::Duration::from_secs(secs))
            {
                println!("# HUNG: {what} did not finish in {secs} s; its threads:");
                print!("{}", thread_report());
                std::process::exit(1);
            }
        });
        HangGuard {
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for HangGuard {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Every thread of this process: name, state, wait channel and kernel
/// stack, as `#` lines.
pub fn thread_report() -> String {
    let mut out = String::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return "#   (no /proc/self/task)\n".to_owned();
    };
    for task in dir.flatten() {
        let p = task.path();
        let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
        let stat = read("stat");
        // The state follows the parenthesised name.
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next()
            .unwrap_or("?");
        out += &format!(
            "#   tid {} ({}) state {} wchan {}\n",
            task.file_name().to_string_lossy(),
            read("comm").trim(),
            state,
            read("wchan").trim()
        );
        for line in read("stack").lines() {
            out += &format!("#     {line}\n");
        }
    }
    out
}
