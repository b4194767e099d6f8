//! Per-process statistics and `tdrv-smi` against known state.
//!
//! The program builds state whose numbers it knows (two files with buffers
//! of chosen sizes on chosen channels, a finished job, a dup'd descriptor,
//! a forked child holding the inherited file and one of its own, a refused
//! allocation), then checks:
//! - `/proc/<pid>/fdinfo` of each file, in the parent and in the child;
//! - the device's CHANNEL_INFO and debugfs `clients` against the sums;
//! - `tdrv-smi --json`, `tdrv-smi ps --json` and `tdrv-smi top -b` against
//!   all of it, and tdrv-smi's fallbacks and exit codes (no debugfs, an
//!   unprivileged user, no such device), and its busy percentage with the
//!   engine loaded and idle.
//!
//! fdinfo is parsed here independently of tdrv-smi, so the two check each
//! other against the allocations.
//!
//! usage: smi [/dev/tdrvN]   (tdrv-smi is looked up next to this program)

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use tdrv_guest_tests::{expect_eq, expect_err, ok, open_device_or_skip, raw, raw::Dev, Tap};
use tdrv_uapi::*;

type R = Result<(), String>;

/// The uid/gid of an unprivileged user (`nobody`; no passwd entry needed).
const NOBODY: u32 = 65534;

/// First argument of this program when it runs as the trampoline that
/// drops to [`NOBODY`] and execs the rest of its arguments.
const AS_NOBODY: &str = "--exec-as-nobody";
/// Exit code of the trampoline when a step before the exec fails.
const TRAMPOLINE_FAILED: i32 = 125;

/// The trampoline: drops every group, then the gid, then the uid, and
/// execs `argv`. It exists because std's `Command::uid`/`gid` cannot run
/// on the test kernel: with them std forks itself (posix_spawn cannot
/// change ids) and reports exec failures through an AF_UNIX socketpair,
/// and a kernel without CONFIG_NET answers socketpair(2) with ENOSYS. A
/// plain `Command` (posix_spawn, a pipe) of this program does work there.
fn exec_as_nobody(argv: &[String]) -> ! {
    let fail = |step: &str| -> ! {
        eprintln!("{AS_NOBODY}: {step}: errno {}", raw::errno());
        std::process::exit(TRAMPOLINE_FAILED)
    };
    // SAFETY: plain syscalls on this single-threaded process.
    unsafe {
        if libc::setgroups(0, std::ptr::null()) != 0 {
            fail("setgroups");
        }
        if libc::setgid(NOBODY) != 0 {
            fail("setgid");
        }
        if libc::setuid(NOBODY) != 0 {
            fail("setuid");
        }
    }
    let err = Command::new(&argv[0]).args(&argv[1..]).exec();
    eprintln!("{AS_NOBODY}: exec {}: {err}", argv[0]);
    std::process::exit(TRAMPOLINE_FAILED)
}

/// The `key:\tvalue` lines of an fdinfo file.
type FdInfo = HashMap<String, String>;

fn parse_fdinfo(text: &str) -> FdInfo {
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

fn read_fdinfo(pid: &str, fd: i32) -> Result<FdInfo, String> {
    let path = format!("/proc/{pid}/fdinfo/{fd}");
    std::fs::read_to_string(&path)
        .map(|t| parse_fdinfo(&t))
        .map_err(|e| format!("{path}: {e}"))
}

fn field<'a>(f: &'a FdInfo, key: &str) -> Result<&'a str, String> {
    f.get(key)
        .map(String::as_str)
        .ok_or_else(|| format!("fdinfo has no {key:?}: {f:?}"))
}

fn num(f: &FdInfo, key: &str) -> Result<u64, String> {
    let v = field(f, key)?;
    v.parse()
        .map_err(|_| format!("fdinfo {key:?} is not a number: {v:?}"))
}

/// `drm-engine-copy:\t<N> ns`.
fn engine_ns(f: &FdInfo) -> Result<u64, String> {
    let v = field(f, "drm-engine-copy")?;
    v.strip_suffix(" ns")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("drm-engine-copy is not \"<N> ns\": {v:?}"))
}

/// Checks one file's fdinfo against what the test allocated on it.
fn check_fdinfo(f: &FdInfo, device: &str, per_channel: &[u64], buffers: u64) -> R {
    expect_eq("drm-driver", field(f, "drm-driver")?, "tdrv")?;
    expect_eq("tdrv-device", field(f, "tdrv-device")?, device)?;
    num(f, "drm-client-id")?;
    for (ch, &bytes) in per_channel.iter().enumerate() {
        expect_eq(
            &format!("drm-total-hbm{ch}"),
            num(f, &format!("drm-total-hbm{ch}"))?,
            bytes,
        )?;
        // tdrv memory is never swapped or migrated: all of it is resident.
        expect_eq(
            &format!("drm-resident-hbm{ch}"),
            num(f, &format!("drm-resident-hbm{ch}"))?,
            bytes,
        )?;
    }
    let extra = per_channel.len();
    if f.contains_key(&format!("drm-total-hbm{extra}")) {
        return Err(format!("fdinfo names a channel {extra} the device lacks"));
    }
    expect_eq("tdrv-buffers", num(f, "tdrv-buffers")?, buffers)?;
    expect_eq("tdrv-jobs-queued", num(f, "tdrv-jobs-queued")?, 0)
}

/// The tdrv-smi next to this program (both are installed in one directory),
/// else the one in PATH.
fn smi_path() -> PathBuf {
    let here = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("tdrv-smi")));
    match here {
        Some(p) if p.exists() => p,
        _ => PathBuf::from("tdrv-smi"),
    }
}

/// One tdrv-smi run: exit code, stdout, stderr.
fn run(cmd: &mut Command) -> Result<(i32, String, String), String> {
    let out = cmd.output().map_err(|e| format!("running {cmd:?}: {e}"))?;
    let code = out
        .status
        .code()
        .ok_or_else(|| format!("{cmd:?} was killed: {}", out.status))?;
    Ok((
        code,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// Runs tdrv-smi with `args` and parses its JSON; the exit code must be
/// `want_code`.
fn smi_json(cmd: &mut Command, want_code: i32) -> Result<Value, String> {
    let (code, out, err) = run(cmd)?;
    if code != want_code {
        return Err(format!(
            "{cmd:?} exited {code}, want {want_code}\nstderr: {err}\nstdout: {out}"
        ));
    }
    let v: Value = serde_json::from_str(&out)
        .map_err(|e| format!("{cmd:?}: not JSON ({e}):\n{out}\nstderr: {err}"))?;
    expect_eq("schema", v["schema"].as_u64(), Some(1))?;
    Ok(v)
}

fn u(v: &Value, key: &str) -> Result<u64, String> {
    v[key]
        .as_u64()
        .ok_or_else(|| format!("{key:?} is not a number in {v}"))
}

/// The entry for `node` in a device list.
fn device_entry<'a>(list: &'a Value, node: &str) -> Result<&'a Value, String> {
    list["devices"]
        .as_array()
        .ok_or("no devices array")?
        .iter()
        .find(|d| d["node"] == node)
        .ok_or_else(|| format!("{node} not in {list}"))
}

/// The ps entries of process `pid`, by client id.
fn ps_entries(ps: &Value, pid: i32) -> Result<HashMap<u64, Value>, String> {
    let all = ps["processes"].as_array().ok_or("no processes array")?;
    let mut out = HashMap::new();
    for p in all.iter().filter(|p| p["pid"].as_i64() == Some(pid.into())) {
        if out.insert(u(p, "client_id")?, p.clone()).is_some() {
            return Err(format!(
                "client {} listed twice for pid {pid}",
                p["client_id"]
            ));
        }
    }
    Ok(out)
}

/// Checks a ps entry against the fdinfo of the same file.
fn check_ps_entry(e: &Value, device: &str, fds: &[i32], per_channel: &[u64], shared: bool) -> R {
    expect_eq("device", e["device"].as_str(), Some(device))?;
    let got_fds: Vec<i64> = e["fds"]
        .as_array()
        .ok_or("no fds")?
        .iter()
        .filter_map(Value::as_i64)
        .collect();
    let mut want_fds: Vec<i64> = fds.iter().map(|&f| f.into()).collect();
    want_fds.sort_unstable();
    expect_eq("fds", got_fds, want_fds)?;
    let chans = e["channels"].as_array().ok_or("no channels")?;
    expect_eq("channel count", chans.len(), per_channel.len())?;
    for (ch, (c, &bytes)) in chans.iter().zip(per_channel).enumerate() {
        expect_eq("channel index", u(c, "channel")?, ch as u64)?;
        expect_eq(&format!("hbm{ch} total"), u(c, "total_bytes")?, bytes)?;
        expect_eq(&format!("hbm{ch} resident"), u(c, "resident_bytes")?, bytes)?;
    }
    expect_eq(
        "total_bytes",
        u(e, "total_bytes")?,
        per_channel.iter().sum(),
    )?;
    expect_eq("jobs_queued", u(e, "jobs_queued")?, 0)?;
    expect_eq("shared", e["shared"].as_bool(), Some(shared))
}

/// A pipe as two files.
fn pipe() -> Result<(File, File), String> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the local array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("pipe: errno {}", raw::errno()));
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) })
}

/// Forks; the child runs `body` and exits with its result (0 or 1) without
/// returning into the test. The program is single-threaded here (tdrv-smi
/// runs are finished processes), so the child may allocate.
fn fork_child(body: impl FnOnce() -> i32) -> Result<i32, String> {
    // SAFETY: fork in a single-threaded process; the child only runs `body`
    // and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("fork: errno {}", raw::errno()));
    }
    if pid == 0 {
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or(3);
        // Flush nothing the parent will print again: stdout is line-buffered
        // and the child prints nothing.
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    Ok(pid)
}

fn reap(pid: i32) -> Result<i32, String> {
    let mut status = 0;
    // SAFETY: waits for our own child into a local.
    if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
        return Err(format!("waitpid: errno {}", raw::errno()));
    }
    if libc::WIFEXITED(status) {
        Ok(libc::WEXITSTATUS(status))
    } else {
        Err(format!("child ended abnormally: status {status:#x}"))
    }
}

/// What the forked child reports: the inherited file's fdinfo, then its
/// own file's descriptor and fdinfo, separated by a line `--`. It then
/// stays alive, holding both files, until the parent closes `from_parent`.
fn child_main(inherited: i32, path: &str, mut to_parent: File, mut from_parent: File) -> i32 {
    let report = (|| -> Result<String, String> {
        let mine = std::fs::read_to_string(format!("/proc/self/fdinfo/{inherited}"))
            .map_err(|e| e.to_string())?;
        let own = Dev::open(path).map_err(|e| format!("open: errno {e}"))?;
        own.alloc(16384, 0)
            .map_err(|e| format!("alloc: errno {e}"))?;
        let theirs = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", own.fd()))
            .map_err(|e| e.to_string())?;
        let fd = own.fd();
        // The file must outlive the parent's checks: keep it until _exit.
        std::mem::forget(own);
        Ok(format!("{mine}--\n{fd}\n{theirs}"))
    })();
    let (msg, code) = match report {
        Ok(m) => (m, 0),
        Err(e) => (format!("error {e}"), 1),
    };
    if to_parent.write_all(msg.as_bytes()).is_err() {
        return 1;
    }
    // EOF tells the parent the report is complete.
    drop(to_parent);
    let mut rest = Vec::new();
    let _ = from_parent.read_to_end(&mut rest);
    code
}

/// In a child: closes descriptors that fork copied but the child must not
/// hold: the parent's pipe ends (so that the parent closing its end is seen
/// as EOF) and tdrv files the state under test says it does not share.
fn close_in_child(fds: &[i32]) {
    for &fd in fds {
        // SAFETY: the child never uses these descriptors; closing its copies
        // affects nobody else.
        unsafe { libc::close(fd) };
    }
}

/// Keeps the device's engine busy from a child process until told to stop:
/// two jobs in flight at all times, so that jobs end throughout any window.
/// Reports "s" once the first job is queued and "d" when every job ended.
fn load_main(path: &str, kind: u32, mut to_parent: File, stop: File) -> i32 {
    // The edu engine takes ~0.2 s of virtual time per 4 KiB; the software
    // engine ~1 ms per MiB. Either way a job ends every few tens of ms or
    // less, well inside the sampling window.
    let size = if kind == TDRV_DEVICE_EDU {
        4096
    } else {
        4 << 20
    };
    let Ok(dev) = Dev::open(path) else { return 1 };
    let (Ok(src), Ok(dst)) = (dev.alloc(size, 0), dev.alloc(size, 0)) else {
        return 1;
    };
    let desc = tdrv_copy_desc {
        src_handle: src.handle,
        src_offset: 0,
        dst_handle: dst.handle,
        dst_offset: 0,
        size,
    };
    let mut inflight = std::collections::VecDeque::new();
    let mut told = false;
    let fd = stop.as_raw_fd();
    loop {
        while inflight.len() < 2 {
            match dev.submit(&[desc]) {
                Ok(id) => inflight.push_back(id),
                Err(_) => return 1,
            }
        }
        if !told {
            if to_parent.write_all(b"s").is_err() {
                return 1;
            }
            told = true;
        }
        let id = inflight.pop_front().expect("two in flight");
        if !matches!(dev.job_wait(id, -1), Ok((TDRV_JOB_DONE, 0))) {
            return 1;
        }
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polls one descriptor described by a local.
        if unsafe { libc::poll(&mut p, 1, 0) } > 0 {
            break;
        }
    }
    for id in inflight {
        if !matches!(dev.job_wait(id, -1), Ok((TDRV_JOB_DONE, 0))) {
            return 1;
        }
    }
    if to_parent.write_all(b"d").is_err() {
        return 1;
    }
    0
}

fn debugfs_clients(name: &str) -> Option<String> {
    std::fs::read_to_string(format!("/sys/kernel/debug/tdrv/{name}/clients")).ok()
}

fn debugfs_stat(name: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/sys/kernel/debug/tdrv/{name}/stats")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':')?.trim().parse().ok())
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(AS_NOBODY) && argv.len() > 2 {
        exec_as_nobody(&argv[2..]);
    }
    let (dev, path, v) = open_device_or_skip("/dev/tdrv0", None);
    let name = path.rsplit('/').next().unwrap_or(&path).to_string();
    let smi = smi_path();
    let smi_cmd = |args: &[&str]| {
        let mut c = Command::new(&smi);
        c.args(args);
        c
    };
    // tdrv-smi as user and group `nobody`, through this program's
    // trampoline (see `exec_as_nobody`).
    let me_exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
    let smi_as_nobody = |args: &[&str]| {
        let mut c = Command::new(&me_exe);
        c.arg(AS_NOBODY).arg(&smi).args(args);
        c
    };
    let me = std::process::id() as i32;
    let page = raw::page_size() as u64;
    let chans = v.num_channels as usize;
    let last = v.num_channels - 1;
    let kind = match v.device_kind {
        TDRV_DEVICE_SOFT => "soft",
        TDRV_DEVICE_EDU => "edu",
        TDRV_DEVICE_SIM => "sim",
        _ => "unknown",
    };

    let mut t = Tap::new(23);
    t.note(format!(
        "{path}: {kind}, {chans} channels; tdrv-smi at {}",
        smi.display()
    ));

    // ---- known state ------------------------------------------------
    let base: Vec<tdrv_channel_info> = (0..v.num_channels)
        .map(|c| dev.channel_info(c).unwrap_or_default())
        .collect();
    // File A: 8193 bytes (charged as 3 pages) and 64 KiB on channel 0,
    // 20 KiB on the last channel, and one finished job.
    let mut exp_a = vec![0u64; chans];
    let mut exp_b = vec![0u64; chans];
    let setup = (|| -> Result<(u64, u64), String> {
        let a1 = ok("alloc a1", dev.alloc(8193, 0))?;
        let a2 = ok("alloc a2", dev.alloc(65536, 0))?;
        ok("alloc a3", dev.alloc(20480, last))?;
        exp_a[0] += 8193u64.next_multiple_of(page) + 65536;
        exp_a[last as usize] += 20480;
        let id = ok(
            "submit",
            dev.submit(&[tdrv_copy_desc {
                src_handle: a1.handle,
                src_offset: 0,
                dst_handle: a2.handle,
                dst_offset: 0,
                size: 4096,
            }]),
        )?;
        let (state, status) = ok("job_wait", dev.job_wait(id, -1))?;
        expect_eq("job", (state, status), (TDRV_JOB_DONE, 0))?;
        Ok((a1.handle, a2.handle))
    })();
    let b = Dev::open(&path);
    let b_ok = b
        .as_ref()
        .map_err(|e| format!("open B: errno {e}"))
        .and_then(|b| ok("alloc b1", b.alloc(3 * 4096, last)).map(drop));
    exp_b[last as usize] += 3 * 4096;
    // Close-on-exec like the original, so that tdrv-smi, run from here,
    // does not inherit the file and show up as a second holder.
    // SAFETY: duplicates our own open descriptor.
    let dup_fd = unsafe { libc::fcntl(dev.fd(), libc::F_DUPFD_CLOEXEC, 0) };
    let ready = setup.clone().and(b_ok).and(if dup_fd >= 0 {
        Ok(())
    } else {
        Err("dup failed".into())
    });
    // Every check below depends on this state: a setup that fails stops
    // the program (a failure, not a check).
    tdrv_guest_tests::bail::require(
        "setting up a known state: two files, buffers, a finished job, a dup",
        ready,
    );
    let b = b.expect("checked above");
    let a1 = setup.expect("checked above").0;

    // ---- fdinfo in this process --------------------------------------
    let fa = read_fdinfo("self", dev.fd());
    let fb = read_fdinfo("self", b.fd());
    let (id_a, id_b, eng_a) = match (&fa, &fb) {
        (Ok(fa), Ok(fb)) => (
            num(fa, "drm-client-id").unwrap_or(0),
            num(fb, "drm-client-id").unwrap_or(0),
            engine_ns(fa).unwrap_or(0),
        ),
        _ => (0, 0, 0),
    };
    t.run(
        "fdinfo: the file with three buffers and a finished job",
        || {
            let fa = fa.clone()?;
            check_fdinfo(&fa, &name, &exp_a, 3)?;
            if engine_ns(&fa)? == 0 {
                return Err("drm-engine-copy is 0 ns after a finished job".into());
            }
            Ok(())
        },
    );
    t.run("fdinfo: a second file counts only its own buffer", || {
        let fb = fb.clone()?;
        check_fdinfo(&fb, &name, &exp_b, 1)?;
        expect_eq("drm-engine-copy of a file without jobs", engine_ns(&fb)?, 0)?;
        if id_a == id_b {
            return Err(format!("both files have client id {id_a}"));
        }
        Ok(())
    });
    t.run("fdinfo: a dup'd descriptor shows the same file", || {
        let fd = read_fdinfo("self", dup_fd)?;
        expect_eq("client id", num(&fd, "drm-client-id")?, id_a)?;
        check_fdinfo(&fd, &name, &exp_a, 3)
    });
    t.run(
        "CHANNEL_INFO grew by exactly the files' fdinfo totals",
        || {
            for ch in 0..chans {
                let now = ok("channel_info", dev.channel_info(ch as u32))?;
                expect_eq(
                    &format!("channel {ch} used"),
                    now.used_bytes - base[ch].used_bytes,
                    exp_a[ch] + exp_b[ch],
                )?;
            }
            Ok(())
        },
    );
    t.run(
        "debugfs clients: one line per file with pid, buffers, bytes, busy",
        || {
            let Some(text) = debugfs_clients(&name) else {
                return Err("cannot read debugfs clients".into());
            };
            let line_of = |id: u64| {
                text.lines()
                    .find(|l| l.starts_with(&format!("client {id} ")))
                    .ok_or_else(|| format!("no client {id} in:\n{text}"))
            };
            let mut want = format!(
                "client {id_a} pid {me} buffers 3 bytes {}",
                exp_a.iter().sum::<u64>()
            );
            for (ch, b) in exp_a.iter().enumerate() {
                want += &format!(" hbm{ch} {b}");
            }
            want += &format!(" jobs 0 busy_ns {eng_a}");
            expect_eq("file A", line_of(id_a)?, want.as_str())?;
            let mut want = format!("client {id_b} pid {me} buffers 1 bytes {}", 3 * 4096);
            for (ch, b) in exp_b.iter().enumerate() {
                want += &format!(" hbm{ch} {b}");
            }
            want += " jobs 0 busy_ns 0";
            expect_eq("file B", line_of(id_b)?, want.as_str())
        },
    );

    // ---- a forked child -------------------------------------------------
    let child = (|| -> Result<(i32, File, String), String> {
        let (mut from_child, child_out) = pipe()?;
        let (child_in, to_child) = pipe()?;
        let inherited = dev.fd();
        // The child keeps file A (one descriptor) and opens its own; B and
        // the dup stay the parent's alone.
        let not_childs = [from_child.as_raw_fd(), to_child.as_raw_fd(), b.fd(), dup_fd];
        // The closure owns the child's ends: the parent's copies close when
        // fork_child returns.
        let pid = fork_child(|| {
            close_in_child(&not_childs);
            child_main(inherited, &path, child_out, child_in)
        })?;
        let mut report = String::new();
        from_child
            .read_to_string(&mut report)
            .map_err(|e| e.to_string())?;
        Ok((pid, to_child, report))
    })();
    let (child_pid, to_child, report) = match child {
        Ok((pid, to_child, report)) => (pid, Some(to_child), report),
        Err(e) => (-1, None, format!("error {e}")),
    };
    let (inherited_text, own) = report.split_once("--\n").unwrap_or((&report, ""));
    let (own_fd, own_text) = own.split_once('\n').unwrap_or(("", ""));
    let own_fd: i32 = own_fd.parse().unwrap_or(-1);
    let fc = parse_fdinfo(own_text);
    let id_c = num(&fc, "drm-client-id").unwrap_or(0);
    t.run(
        "fork: the child sees the inherited file's numbers in its fdinfo",
        || {
            if report.starts_with("error") {
                return Err(format!("child: {report}"));
            }
            let fi = parse_fdinfo(inherited_text);
            expect_eq("client id", num(&fi, "drm-client-id")?, id_a)?;
            expect_eq("drm-engine-copy", engine_ns(&fi)?, eng_a)?;
            check_fdinfo(&fi, &name, &exp_a, 3)
        },
    );
    t.run(
        "fork: the child's own file has its own client id and numbers",
        || {
            let mut want = vec![0u64; chans];
            want[0] = 16384;
            check_fdinfo(&fc, &name, &want, 1)?;
            if [id_a, id_b].contains(&id_c) {
                return Err(format!("the child's file reuses client id {id_c}"));
            }
            Ok(())
        },
    );

    // ---- tdrv-smi ps ----------------------------------------------------
    t.run(
        "ps --json: this process's two files, as fdinfo says",
        || {
            let ps = smi_json(&mut smi_cmd(&["ps", "--json"]), 0)?;
            let mine = ps_entries(&ps, me)?;
            let mut ids: Vec<u64> = mine.keys().copied().collect();
            ids.sort_unstable();
            let mut want = vec![id_a, id_b];
            want.sort_unstable();
            expect_eq("client ids of this process", ids, want)?;
            let a = &mine[&id_a];
            check_ps_entry(a, &name, &[dev.fd(), dup_fd], &exp_a, true)?;
            expect_eq("buffers", u(a, "buffers")?, 3)?;
            expect_eq("engine_copy_ns", u(a, "engine_copy_ns")?, eng_a)?;
            expect_eq("comm", a["comm"].as_str(), Some("smi"))?;
            let second = &mine[&id_b];
            check_ps_entry(second, &name, &[b.fd()], &exp_b, false)?;
            expect_eq("buffers", u(second, "buffers")?, 1)?;
            expect_eq("engine_copy_ns", u(second, "engine_copy_ns")?, 0)
        },
    );
    t.run("ps --json: the child's inherited file and its own", || {
        let ps = smi_json(&mut smi_cmd(&["ps", "--json"]), 0)?;
        let theirs = ps_entries(&ps, child_pid)?;
        let mut ids: Vec<u64> = theirs.keys().copied().collect();
        ids.sort_unstable();
        let mut want = vec![id_a, id_c];
        want.sort_unstable();
        expect_eq("client ids of the child", ids, want)?;
        check_ps_entry(&theirs[&id_a], &name, &[dev.fd()], &exp_a, true)?;
        let mut c = vec![0u64; chans];
        c[0] = 16384;
        check_ps_entry(&theirs[&id_c], &name, &[own_fd], &c, false)
    });
    t.run(
        "ps --json -d: the device filter keeps this device's files",
        || {
            let ps = smi_json(&mut smi_cmd(&["ps", "--json", "-d", &path]), 0)?;
            expect_eq("entries of this process", ps_entries(&ps, me)?.len(), 2)?;
            let other = smi_json(&mut smi_cmd(&["ps", "--json", "-d", "/dev/tdrv99"]), 3)?;
            expect_eq(
                "processes for a missing device",
                other["processes"].as_array().map(Vec::len),
                Some(0),
            )?;
            expect_eq(
                "error kind",
                other["errors"][0]["kind"].as_str(),
                Some("no-device"),
            )
        },
    );

    // ---- tdrv-smi (device list) -------------------------------------------
    // One refused allocation: one byte more than the channel has left.
    let failed_alloc = (|| -> Result<bool, String> {
        let c0 = ok("channel_info", dev.channel_info(0))?;
        let size = c0.limit_bytes - c0.used_bytes + page;
        if size > v.max_buffer_size {
            return Ok(false);
        }
        expect_err("ALLOC beyond the channel", dev.alloc(size, 0), libc::ENOSPC)?;
        Ok(true)
    })();
    let infos: Vec<tdrv_channel_info> = (0..v.num_channels)
        .map(|c| dev.channel_info(c).unwrap_or_default())
        .collect();
    t.run(
        "list --json: VERSION and CHANNEL_INFO of the device, exactly",
        || {
            let l = smi_json(
                &mut smi_cmd(&["--json", "-d", &path, "--interval-ms", "0"]),
                0,
            )?;
            expect_eq("errors", l["errors"].as_array().map(Vec::len), Some(0))?;
            expect_eq("devices", l["devices"].as_array().map(Vec::len), Some(1))?;
            let d = device_entry(&l, &path)?;
            expect_eq("name", d["name"].as_str(), Some(name.as_str()))?;
            expect_eq("kind", d["kind"].as_str(), Some(kind))?;
            expect_eq("abi.major", u(&d["abi"], "major")?, v.abi_major.into())?;
            expect_eq("abi.minor", u(&d["abi"], "minor")?, v.abi_minor.into())?;
            expect_eq("features", u(d, "features")?, v.features)?;
            expect_eq(
                "max_buffer_size",
                u(d, "max_buffer_size")?,
                v.max_buffer_size,
            )?;
            let got = d["channels"].as_array().ok_or("no channels")?;
            expect_eq("channel count", got.len(), chans)?;
            for (c, i) in got.iter().zip(&infos) {
                let ch = i.channel;
                expect_eq("channel", u(c, "channel")?, ch.into())?;
                expect_eq(
                    &format!("hbm{ch} limit"),
                    u(c, "limit_bytes")?,
                    i.limit_bytes,
                )?;
                expect_eq(&format!("hbm{ch} used"), u(c, "used_bytes")?, i.used_bytes)?;
                expect_eq(&format!("hbm{ch} peak"), u(c, "peak_bytes")?, i.peak_bytes)?;
                expect_eq(&format!("hbm{ch} buffers"), u(c, "buffers")?, i.buffers)?;
                expect_eq(
                    &format!("hbm{ch} failed"),
                    u(c, "failed_allocs")?,
                    i.failed_allocs,
                )?;
            }
            expect_eq(
                "buffers",
                u(d, "buffers")?,
                infos.iter().map(|i| i.buffers).sum(),
            )?;
            expect_eq(
                "failed_allocs",
                u(d, "failed_allocs")?,
                infos.iter().map(|i| i.failed_allocs).sum(),
            )?;
            expect_eq(
                "busy_percent without sampling",
                d["busy_percent"].is_null(),
                true,
            )
        },
    );
    t.run(
        "list --json: a refused allocation counts in failed_allocs",
        || {
            if !failed_alloc.clone()? {
                return Err(
                    "channel 0 is larger than one allocation: cannot provoke ENOSPC".into(),
                );
            }
            let l = smi_json(
                &mut smi_cmd(&["--json", "-d", &path, "--interval-ms", "0"]),
                0,
            )?;
            let c0 = &device_entry(&l, &path)?["channels"][0];
            expect_eq(
                "failed_allocs",
                u(c0, "failed_allocs")?,
                base[0].failed_allocs + 1,
            )
        },
    );
    t.run(
        "list --json: open files, jobs and busy_ns from debugfs and sysfs",
        || {
            let l = smi_json(
                &mut smi_cmd(&["--json", "-d", &path, "--interval-ms", "0"]),
                0,
            )?;
            let d = device_entry(&l, &path)?;
            // A, B and the child's own; the dup and the inherited descriptor are
            // the same file as A, and tdrv-smi does not count its own.
            expect_eq("open_files", u(d, "open_files")?, 3)?;
            let completed = debugfs_stat(&name, "jobs_completed").ok_or("no debugfs stats")?;
            expect_eq("jobs.completed", u(&d["jobs"], "completed")?, completed)?;
            let sysfs: u64 = std::fs::read_to_string(format!("/sys/class/misc/{name}/busy_ns"))
                .map_err(|e| e.to_string())?
                .trim()
                .parse()
                .map_err(|e| format!("sysfs busy_ns: {e}"))?;
            expect_eq("busy_ns (engine idle)", u(d, "busy_ns")?, sysfs)?;
            if sysfs < eng_a {
                return Err(format!(
                    "device busy_ns {sysfs} < file A's engine time {eng_a}"
                ));
            }
            let sources: Vec<&str> = d["sources"]
                .as_array()
                .ok_or("no sources")?
                .iter()
                .filter_map(Value::as_str)
                .collect();
            expect_eq("sources", sources, vec!["ioctl", "debugfs", "sysfs"])
        },
    );
    t.run(
        "list (text): the device, its kind and every channel",
        || {
            let (code, out, err) = run(&mut smi_cmd(&["-d", &path, "--interval-ms", "0"]))?;
            expect_eq("exit code", code, 0)?;
            let mut want = vec![path.clone(), kind.to_string()];
            want.extend((0..chans).map(|c| format!("{name} hbm{c}")));
            for w in want {
                if !out.contains(&w) {
                    return Err(format!("{w:?} missing from:\n{out}\nstderr: {err}"));
                }
            }
            Ok(())
        },
    );
    t.run(
        "top -b -n 2: two frames with the device and this process's file",
        || {
            let (code, out, err) = run(&mut smi_cmd(&[
                "top",
                "-b",
                "-n",
                "2",
                "--delay-ms",
                "100",
                "-d",
                &path,
            ]))?;
            expect_eq("exit code", code, 0)?;
            expect_eq("frames", out.matches("tdrv-smi top at").count(), 2)?;
            let row = format!("{me}  ");
            if !out.contains(&path) || !out.lines().any(|l| l.starts_with(&row)) {
                return Err(format!("device or pid {me} missing:\n{out}\nstderr: {err}"));
            }
            Ok(())
        },
    );

    // ---- the child leaves ----------------------------------------------------
    drop(to_child);
    let child_exit = if child_pid > 0 {
        reap(child_pid)
    } else {
        Err("no child".into())
    };
    t.run(
        "after the child exits, ps drops it and A is no longer shared",
        || {
            expect_eq("child exit", child_exit.clone()?, 0)?;
            let ps = smi_json(&mut smi_cmd(&["ps", "--json"]), 0)?;
            expect_eq("child entries", ps_entries(&ps, child_pid)?.len(), 0)?;
            let mine = ps_entries(&ps, me)?;
            let a = mine.get(&id_a).ok_or("file A missing")?;
            expect_eq("A shared", a["shared"].as_bool(), Some(false))
        },
    );
    t.run("fdinfo follows FREE", || {
        ok("free a1", dev.free(a1))?;
        let fa = read_fdinfo("self", dev.fd())?;
        let mut want = exp_a.clone();
        want[0] -= 8193u64.next_multiple_of(page);
        check_fdinfo(&fa, &name, &want, 2)
    });

    // ---- fallbacks and errors ---------------------------------------------------
    t.run(
        "without debugfs: channels from ioctls, a warning, null counters",
        || {
            let l = smi_json(
                &mut smi_cmd(&[
                    "--json",
                    "-d",
                    &path,
                    "--interval-ms",
                    "0",
                    "--debugfs",
                    "/nonexistent",
                ]),
                0,
            )?;
            let d = device_entry(&l, &path)?;
            let c0 = ok("channel_info", dev.channel_info(0))?;
            expect_eq(
                "hbm0 used",
                u(&d["channels"][0], "used_bytes")?,
                c0.used_bytes,
            )?;
            expect_eq("open_files", d["open_files"].is_null(), true)?;
            expect_eq("jobs", d["jobs"].is_null(), true)?;
            let w = l["warnings"].to_string();
            if !w.contains("debugfs") {
                return Err(format!("no warning about debugfs: {w}"));
            }
            expect_eq(
                "sources",
                d["sources"].to_string(),
                r#"["ioctl","sysfs"]"#.into(),
            )
        },
    );
    // Unprivileged runs need a second user: only a kernel without
    // CONFIG_MULTIUSER answers setuid itself with ENOSYS, and has no
    // permission checks to test.
    let probe = run(&mut smi_as_nobody(&["--version"]));
    let no_users = match &probe {
        Ok((TRAMPOLINE_FAILED, _, err)) if err.contains(&format!("errno {}", libc::ENOSYS)) => {
            Some(format!("kernel without CONFIG_MULTIUSER: {}", err.trim()))
        }
        _ => None,
    };
    if no_users.is_none() {
        t.run(
            "unprivileged: exit 4, a permission error, sysfs figures only",
            || {
                let (code, out, err) = run(&mut smi_as_nobody(&["--version"]))?;
                if code != 0 || !out.contains("tdrv-smi") {
                    return Err(format!("--version as nobody: exit {code}, {out}{err}"));
                }
                let l = smi_json(
                    &mut smi_as_nobody(&["--json", "-d", &path, "--interval-ms", "0"]),
                    4,
                )?;
                let e = &l["errors"][0];
                expect_eq("error kind", e["kind"].as_str(), Some("permission"))?;
                let msg = e["message"].as_str().unwrap_or("");
                if !msg.contains("permission denied") || !msg.contains(&path) {
                    return Err(format!("unclear message: {msg:?}"));
                }
                let d = device_entry(&l, &path)?;
                expect_eq("sources", d["sources"].to_string(), r#"["sysfs"]"#.into())?;
                expect_eq("channels", d["channels"].as_array().map(Vec::len), Some(0))?;
                let w = l["warnings"].to_string();
                if !w.contains("root-only") {
                    return Err(format!("no warning that debugfs is root-only: {w}"));
                }
                u(d, "busy_ns").map(drop)
            },
        );
        t.run(
            "unprivileged ps: root's processes are counted as unreadable",
            || {
                let ps = smi_json(&mut smi_as_nobody(&["ps", "--json"]), 0)?;
                expect_eq("entries of a root process", ps_entries(&ps, me)?.len(), 0)?;
                if u(&ps, "unreadable_processes")? == 0 {
                    return Err(format!("unreadable_processes is 0: {ps}"));
                }
                let w = ps["warnings"].to_string();
                if !w.contains("permission denied") {
                    return Err(format!("no permission warning: {w}"));
                }
                Ok(())
            },
        );
    } else {
        let why = no_users.unwrap_or_default();
        t.skip(
            "unprivileged: exit 4, a permission error, sysfs figures only",
            &why,
        );
        t.skip(
            "unprivileged ps: root's processes are counted as unreadable",
            &why,
        );
    }
    t.run("no such device: exit 3 and a no-device error", || {
        let l = smi_json(&mut smi_cmd(&["--json", "-d", "/dev/tdrv99"]), 3)?;
        expect_eq("kind", l["errors"][0]["kind"].as_str(), Some("no-device"))?;
        let (code, _, err) = run(&mut smi_cmd(&["-d", "/dev/tdrv99"]))?;
        expect_eq("text exit code", code, 3)?;
        if !err.contains("no such tdrv device: /dev/tdrv99") {
            return Err(format!("stderr: {err}"));
        }
        Ok(())
    });

    // ---- busy percentage --------------------------------------------------------
    let load = (|| -> Result<(i32, File, File), String> {
        let (mut from_load, load_out) = pipe()?;
        let (load_stop, stop) = pipe()?;
        let parent_ends = [from_load.as_raw_fd(), stop.as_raw_fd()];
        let (p, kind_raw) = (path.clone(), v.device_kind);
        let pid = fork_child(move || {
            close_in_child(&parent_ends);
            load_main(&p, kind_raw, load_out, load_stop)
        })?;
        let mut b = [0u8; 1];
        from_load
            .read_exact(&mut b)
            .map_err(|e| format!("load generator did not start: {e}"))?;
        expect_eq("load generator", b[0], b's')?;
        Ok((pid, from_load, stop))
    })();
    let seen_busy = std::cell::Cell::new(None);
    t.run(
        "busy_percent is above 0 while jobs run (1 s sample)",
        || {
            if let Err(e) = &load {
                return Err(e.clone());
            }
            let l = smi_json(
                &mut smi_cmd(&["--json", "-d", &path, "--interval-ms", "1000"]),
                0,
            )?;
            let p = device_entry(&l, &path)?["busy_percent"]
                .as_f64()
                .ok_or("busy_percent is not a number")?;
            seen_busy.set(Some(p));
            if p > 0.0 && p <= 100.0 {
                Ok(())
            } else {
                Err(format!("busy_percent {p} with the engine loaded"))
            }
        },
    );
    t.note(format!("busy_percent under load: {:?}", seen_busy.get()));
    let load_done = load.and_then(|(pid, mut from_load, stop)| {
        drop(stop);
        let mut b = [0u8; 1];
        from_load
            .read_exact(&mut b)
            .map_err(|e| format!("load generator did not finish: {e}"))?;
        expect_eq("load generator", b[0], b'd')?;
        expect_eq("load generator exit", reap(pid)?, 0)
    });
    t.run(
        "busy_percent is 0 while the device's busy_ns stands still",
        || {
            load_done.clone()?;
            // Idleness is the counter's, not the clock's: every job of
            // the load has ended, and the sample must span no engine time.
            let name = path.trim_start_matches("/dev/");
            let busy_ns = || -> Result<u64, String> {
                let f = format!("/sys/class/misc/{name}/busy_ns");
                std::fs::read_to_string(&f)
                    .map_err(|e| format!("{f}: {e}"))?
                    .trim()
                    .parse()
                    .map_err(|e| format!("{f}: {e}"))
            };
            let before = busy_ns()?;
            let l = smi_json(
                &mut smi_cmd(&["--json", "-d", &path, "--interval-ms", "200"]),
                0,
            )?;
            expect_eq(
                "busy_ns across the sample (engine idle)",
                busy_ns()?,
                before,
            )?;
            let p = device_entry(&l, &path)?["busy_percent"].as_f64();
            expect_eq("busy_percent", p, Some(0.0))
        },
    );

    drop(b);
    // SAFETY: closes the descriptor dup'd above, used by nothing else now.
    unsafe { libc::close(dup_fd) };
    t.finish();
}
