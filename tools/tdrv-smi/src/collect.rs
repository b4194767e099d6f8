//! Gathers what the kernel tells about tdrv devices and their users.
//!
//! Sources, and why each:
//! - the device node's ioctls (`TDRV_IOC_VERSION`, `TDRV_IOC_CHANNEL_INFO`):
//!   the ABI and exact channel accounting; needs permission to open the
//!   node (root-only unless a udev rule says otherwise);
//! - debugfs `stats`: job and engine counters and open files, which no
//!   ioctl reports; debugfs is root-only and may not be mounted;
//! - sysfs `busy_ns`: the one stable, world-readable counter, used for the
//!   busy percentage;
//! - `/proc/<pid>/fdinfo`: per-process usage (`ps`); only the caller's own
//!   processes unless root.
//!
//! Each source that fails leaves its fields `null` and adds a problem or a
//! warning; the others still answer.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::model::*;
use crate::parse;

/// Where the kernel's interfaces are. Tests point them into a fake tree.
#[derive(Debug, Clone)]
pub struct Paths {
    /// Directory of the device nodes (`/dev`).
    pub dev: PathBuf,
    /// procfs (`/proc`).
    pub proc: PathBuf,
    /// The misc class in sysfs (`/sys/class/misc`).
    pub sys_misc: PathBuf,
    /// The module's sysfs directory (`/sys/module/tdrv`): present iff loaded.
    pub sys_module: PathBuf,
    /// tdrv's debugfs directory (`/sys/kernel/debug/tdrv`).
    pub debugfs: PathBuf,
}

impl Paths {
    /// The standard locations under `root` (`/` on a real system).
    pub fn under(root: &Path) -> Paths {
        Paths {
            dev: root.join("dev"),
            proc: root.join("proc"),
            sys_misc: root.join("sys/class/misc"),
            sys_module: root.join("sys/module/tdrv"),
            debugfs: root.join("sys/kernel/debug/tdrv"),
        }
    }
}

/// Devices of the system, or the ones the user named. Returns (name, node)
/// pairs in device number order, or the reason there are none.
pub fn discover(paths: &Paths, wanted: &[String]) -> Result<Vec<(String, PathBuf)>, Problem> {
    if !wanted.is_empty() {
        let mut out = Vec::new();
        for w in wanted {
            // A path names its node; a bare name (`tdrv0`) or number (`0`)
            // means the node in the device directory.
            let (name, node) = if w.contains('/') {
                let p = PathBuf::from(w);
                let name = p
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                (name, p)
            } else if w.bytes().all(|b| b.is_ascii_digit()) && !w.is_empty() {
                let name = format!("tdrv{w}");
                (name.clone(), paths.dev.join(name))
            } else {
                (w.clone(), paths.dev.join(w))
            };
            if parse::device_number(&name).is_none() {
                return Err(Problem {
                    device: Some(w.clone()),
                    kind: ProblemKind::NoDevice,
                    message: format!("{w} is not a tdrv device (tdrv<N>)"),
                });
            }
            if !node.exists() && !paths.sys_misc.join(&name).exists() {
                return Err(Problem {
                    device: Some(node.display().to_string()),
                    kind: ProblemKind::NoDevice,
                    message: format!("no such tdrv device: {}", node.display()),
                });
            }
            out.push((name, node));
        }
        return Ok(out);
    }

    // A device registered in sysfs whose node is missing (no devtmpfs) is
    // still listed, so that the problem is reported rather than hidden.
    let mut found = BTreeMap::new();
    for dir in [&paths.dev, &paths.sys_misc] {
        let Ok(entries) = fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(n) = parse::device_number(&name) {
                found.insert(n, (name.clone(), paths.dev.join(&name)));
            }
        }
    }
    if found.is_empty() {
        let message = if paths.sys_module.exists() {
            "the tdrv module is loaded but has no devices \
             (soft_devices=0 and no edu device bound?)"
                .to_string()
        } else {
            "no tdrv device: the tdrv module is not loaded (sudo insmod tdrv.ko)".to_string()
        };
        return Err(Problem {
            device: None,
            kind: ProblemKind::NoDevice,
            message,
        });
    }
    Ok(found.into_values().collect())
}

/// Maps an I/O error to a problem kind.
fn kind_of(e: &io::Error) -> ProblemKind {
    match e.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) => ProblemKind::Permission,
        Some(libc::ENODEV) | Some(libc::ENXIO) => ProblemKind::Unbound,
        Some(libc::ENOENT) => ProblemKind::NoDevice,
        _ => ProblemKind::Io,
    }
}

/// Issues one ioctl whose argument is `arg`.
fn ioctl<T>(fd: &fs::File, request: u64, arg: &mut T) -> io::Result<()> {
    // The size encoded in the request is what the kernel reads and writes.
    debug_assert!(((request >> 16) & 0x3fff) as usize <= std::mem::size_of::<T>());
    // SAFETY: `arg` is a live, exclusively borrowed value at least as large
    // as the size encoded in `request` (the uapi crate derives each request
    // from the size of the struct it names, which is `T` here).
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg as *mut T) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// What the node's ioctls report. The file stays open in `file` so that
/// the debugfs `open_files` read afterwards can discount it.
struct IoctlInfo {
    version: tdrv_uapi::tdrv_version,
    channels: Vec<Channel>,
    _file: fs::File,
}

fn ioctl_info(node: &Path) -> io::Result<IoctlInfo> {
    let file = fs::OpenOptions::new().read(true).write(true).open(node)?;
    let mut version = tdrv_uapi::tdrv_version::default();
    ioctl(&file, tdrv_uapi::TDRV_IOC_VERSION, &mut version)?;
    let mut channels = Vec::new();
    for channel in 0..version.num_channels {
        let mut c = tdrv_uapi::tdrv_channel_info {
            channel,
            ..Default::default()
        };
        ioctl(&file, tdrv_uapi::TDRV_IOC_CHANNEL_INFO, &mut c)?;
        channels.push(Channel {
            channel,
            limit_bytes: c.limit_bytes,
            used_bytes: c.used_bytes,
            peak_bytes: c.peak_bytes,
            buffers: c.buffers,
            failed_allocs: c.failed_allocs,
        });
    }
    Ok(IoctlInfo {
        version,
        channels,
        _file: file,
    })
}

/// The device's busy_ns: the stable sysfs attribute, else debugfs.
fn busy_ns(paths: &Paths, name: &str) -> Option<(u64, &'static str)> {
    let sysfs = paths.sys_misc.join(name).join("busy_ns");
    if let Ok(t) = fs::read_to_string(sysfs) {
        if let Ok(n) = t.trim().parse() {
            return Some((n, "sysfs"));
        }
    }
    let stats = fs::read_to_string(paths.debugfs.join(name).join("stats")).ok()?;
    parse::stats(&stats).busy_ns.map(|n| (n, "debugfs"))
}

/// Remembers each device's last busy_ns reading, so that the next one
/// gives a busy percentage over the time in between.
#[derive(Default)]
pub struct BusySampler {
    last: HashMap<String, (Instant, u64)>,
}

impl BusySampler {
    /// Takes a first reading of every device (before a sampling sleep).
    pub fn prime(&mut self, paths: &Paths, devices: &[(String, PathBuf)]) {
        for (name, _) in devices {
            if let Some((ns, _)) = busy_ns(paths, name) {
                self.last.insert(name.clone(), (Instant::now(), ns));
            }
        }
    }

    /// Records a reading and returns the busy share since the previous one.
    /// busy_ns is credited when a job ends, so a job that started before
    /// the interval can add more than the interval: the share is clamped to
    /// 100.
    fn sample(&mut self, name: &str, ns: u64) -> Option<f64> {
        let now = Instant::now();
        let prev = self.last.insert(name.to_string(), (now, ns));
        let (then, before) = prev?;
        let elapsed = now.duration_since(then).as_nanos() as f64;
        if elapsed <= 0.0 {
            return None;
        }
        let busy = ns.saturating_sub(before) as f64;
        Some((busy / elapsed * 100.0).clamp(0.0, 100.0))
    }
}

/// Everything the sources say about one device, with what went wrong.
pub fn probe(
    paths: &Paths,
    name: &str,
    node: &Path,
    sampler: &mut BusySampler,
) -> (Device, Vec<Problem>, Vec<String>) {
    let mut d = Device {
        node: node.display().to_string(),
        name: name.to_string(),
        ..Default::default()
    };
    let mut problems = Vec::new();
    let mut warnings = Vec::new();

    let (ioctls, ioctl_err) = match ioctl_info(node) {
        Ok(info) => {
            let v = &info.version;
            d.kind = Some(kind_name(v.device_kind));
            d.abi = Some(Abi {
                major: v.abi_major,
                minor: v.abi_minor,
            });
            d.features = Some(v.features);
            d.max_buffer_size = Some(v.max_buffer_size);
            d.channels = info.channels.clone();
            d.sources.push("ioctl");
            (Some(info), None)
        }
        Err(e) => (None, Some(e)),
    };

    // Read while our own file (if any) is still open, so that subtracting
    // it from open_files is exact.
    let stats_path = paths.debugfs.join(name).join("stats");
    match fs::read_to_string(&stats_path) {
        Ok(text) => {
            let s = parse::stats(&text);
            d.sources.push("debugfs");
            if d.kind.is_none() {
                d.kind = s.kind.clone();
            }
            d.bound = s.bound;
            d.open_files = s
                .open_files
                .map(|n| n.saturating_sub(u64::from(ioctls.is_some())));
            if d.channels.is_empty() {
                d.channels = s.channels;
            }
            d.jobs = s.jobs;
            d.engine = s.engine;
            d.busy_ns = s.busy_ns;
        }
        Err(e) => {
            // Whether debugfs as a whole is missing or closed is one fact
            // for every device, said without a device name (so said once).
            let dir = fs::metadata(&paths.debugfs);
            if dir
                .as_ref()
                .is_err_and(|d| d.kind() == io::ErrorKind::NotFound)
            {
                warnings.push(format!(
                    "no debugfs statistics: {} does not exist (is debugfs mounted? \
                     mount -t debugfs none /sys/kernel/debug); job counters and open files are unknown",
                    paths.debugfs.display()
                ));
            } else if dir
                .as_ref()
                .is_err_and(|d| kind_of(d) == ProblemKind::Permission)
                || kind_of(&e) == ProblemKind::Permission
            {
                warnings.push(format!(
                    "no debugfs statistics: {}: permission denied (debugfs is root-only); \
                     job counters and open files are unknown",
                    paths.debugfs.display()
                ));
            } else {
                warnings.push(format!(
                    "{name}: no debugfs statistics: {}: {e}; job counters and open files are unknown",
                    stats_path.display()
                ));
            }
        }
    }
    drop(ioctls);

    if let Some((ns, source)) = busy_ns(paths, name) {
        d.busy_ns = Some(ns);
        d.busy_percent = sampler.sample(name, ns);
        if !d.sources.contains(&source) {
            d.sources.push(source);
        }
    }

    if !d.channels.is_empty() {
        d.buffers = Some(d.channels.iter().map(|c| c.buffers).sum());
        d.failed_allocs = Some(d.channels.iter().map(|c| c.failed_allocs).sum());
    }

    if let Some(e) = ioctl_err {
        let kind = kind_of(&e);
        let message = match kind {
            ProblemKind::Permission => format!(
                "cannot open {}: permission denied (tdrv nodes are root-only: run as root, or give a group access with a udev rule)",
                d.node
            ),
            ProblemKind::Unbound => format!(
                "{}: the device is gone (unbound or being removed): {e}",
                d.node
            ),
            ProblemKind::NoDevice => format!(
                "{}: no device node (is devtmpfs mounted, or udev running?)",
                d.node
            ),
            ProblemKind::Io => format!("{}: {e}", d.node),
        };
        // With channels from debugfs the device is still described; the
        // ioctl failure is then only worth a warning.
        if d.channels.is_empty() {
            problems.push(Problem {
                device: Some(d.node.clone()),
                kind,
                message,
            });
        } else {
            warnings.push(format!("{message}; ABI and features are unknown"));
        }
    }
    (d, problems, warnings)
}

/// `TDRV_DEVICE_*` as a word.
pub fn kind_name(kind: u32) -> String {
    match kind {
        tdrv_uapi::TDRV_DEVICE_SOFT => "soft".into(),
        tdrv_uapi::TDRV_DEVICE_EDU => "edu".into(),
        tdrv_uapi::TDRV_DEVICE_SIM => "sim".into(),
        k => format!("unknown({k})"),
    }
}

/// The device list. `interval` is the busy sampling time: the first busy_ns
/// reading is taken, then the thread sleeps, then everything is read.
pub fn devices(paths: &Paths, wanted: &[String], interval: Duration) -> DeviceList {
    let mut list = DeviceList {
        schema: SCHEMA,
        devices: Vec::new(),
        errors: Vec::new(),
        warnings: Vec::new(),
    };
    let found = match discover(paths, wanted) {
        Ok(f) => f,
        Err(p) => {
            list.errors.push(p);
            return list;
        }
    };
    let mut sampler = BusySampler::default();
    if !interval.is_zero() {
        sampler.prime(paths, &found);
        std::thread::sleep(interval);
    }
    collect_into(paths, &found, &mut sampler, &mut list);
    list
}

/// Probes `found` into `list` (shared with `top`, whose sampler carries
/// the previous refresh's readings).
pub fn collect_into(
    paths: &Paths,
    found: &[(String, PathBuf)],
    sampler: &mut BusySampler,
    list: &mut DeviceList,
) {
    for (name, node) in found {
        let (d, problems, warnings) = probe(paths, name, node, sampler);
        list.devices.push(d);
        list.errors.extend(problems);
        for w in warnings {
            // System-wide facts (debugfs missing) come once per device.
            if !list.warnings.contains(&w) {
                list.warnings.push(w);
            }
        }
    }
}

/// The processes holding tdrv files, from `/proc/*/fdinfo`. With `wanted`
/// non-empty, only files of those devices (by name, e.g. `tdrv0`).
pub fn processes(paths: &Paths, wanted: &[String]) -> ProcessList {
    let mut list = ProcessList {
        schema: SCHEMA,
        processes: Vec::new(),
        unreadable_processes: 0,
        errors: Vec::new(),
        warnings: Vec::new(),
    };
    let Ok(entries) = fs::read_dir(&paths.proc) else {
        list.warnings.push(format!(
            "cannot read {} (is procfs mounted?)",
            paths.proc.display()
        ));
        return list;
    };
    let mut pids: Vec<i32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();

    // (pid, client id) -> entry; the map keeps the output ordered.
    let mut by_client: BTreeMap<(i32, u64), ProcessClient> = BTreeMap::new();
    let mut no_keys = 0u64;
    for pid in pids {
        let dir = paths.proc.join(pid.to_string());
        let fds = match fs::read_dir(dir.join("fd")) {
            Ok(fds) => fds,
            Err(e) if kind_of(&e) == ProblemKind::Permission => {
                list.unreadable_processes += 1;
                continue;
            }
            // Exited meanwhile, or a kernel thread without an fd table.
            Err(_) => continue,
        };
        let mut comm: Option<String> = None;
        for fd in fds.flatten() {
            let Some(fd_num) = fd.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            // The link names the node the file was opened through; only
            // tdrv<N> names can be tdrv files, which spares reading the
            // fdinfo of every socket and pipe.
            let Ok(target) = fs::read_link(fd.path()) else {
                continue;
            };
            let is_node = target
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| parse::device_number(n).is_some());
            if !is_node {
                continue;
            }
            let Ok(text) = fs::read_to_string(dir.join("fdinfo").join(fd_num.to_string())) else {
                continue;
            };
            let info = parse::fdinfo(&text);
            if !info.is_tdrv() {
                continue;
            }
            let (Some(client_id), Some(device)) = (info.client_id, info.device.clone()) else {
                no_keys += 1;
                continue;
            };
            if !wanted.is_empty() && !wanted.contains(&device) {
                continue;
            }
            let comm = comm
                .get_or_insert_with(|| {
                    fs::read_to_string(dir.join("comm"))
                        .map(|c| c.trim_end().to_string())
                        .unwrap_or_default()
                })
                .clone();
            let entry = by_client
                .entry((pid, client_id))
                .or_insert_with(|| ProcessClient {
                    pid,
                    comm,
                    client_id,
                    device,
                    fds: Vec::new(),
                    channels: info
                        .channels
                        .iter()
                        .map(|&(channel, total_bytes, resident_bytes)| ClientChannel {
                            channel,
                            total_bytes,
                            resident_bytes,
                        })
                        .collect(),
                    total_bytes: info.channels.iter().map(|c| c.1).sum(),
                    buffers: info.buffers,
                    engine_copy_ns: info.engine_copy_ns,
                    jobs_queued: info.jobs_queued,
                    shared: false,
                });
            entry.fds.push(fd_num);
        }
    }
    if no_keys > 0 {
        list.warnings.push(format!(
            "{no_keys} tdrv file(s) without drm-client-id/tdrv-device in fdinfo (a tdrv module older than per-process statistics)"
        ));
    }
    let mut holders: HashMap<u64, usize> = HashMap::new();
    for (_, client) in by_client.keys() {
        *holders.entry(*client).or_default() += 1;
    }
    list.processes = by_client
        .into_values()
        .map(|mut p| {
            p.fds.sort_unstable();
            p.shared = holders[&p.client_id] > 1;
            p
        })
        .collect();
    if list.unreadable_processes > 0 {
        list.warnings.push(format!(
            "{} process(es) could not be inspected (permission denied): run as root to see every process",
            list.unreadable_processes
        ));
    }
    list
}

/// The names (`tdrv<N>`) of the devices `wanted` designates, for the
/// process filter.
pub fn wanted_names(wanted: &[String]) -> Vec<String> {
    wanted
        .iter()
        .map(|w| {
            if w.bytes().all(|b| b.is_ascii_digit()) && !w.is_empty() {
                format!("tdrv{w}")
            } else {
                Path::new(w)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| w.clone())
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A fresh empty directory for one test's fake system, removed when
    /// the test ends (also when it fails).
    struct Scratch(PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn scratch() -> Scratch {
        static N: AtomicU32 = AtomicU32::new(0);
        let d = std::env::temp_dir().join(format!(
            "tdrv-smi-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }

    fn write(path: &Path, text: &str) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }

    fn fdinfo(client: u64, dev: &str, hbm0: u64, hbm1: u64) -> String {
        format!(
            "pos:\t0\nflags:\t02\ndrm-driver:\ttdrv\ndrm-client-id:\t{client}\n\
             drm-total-hbm0:\t{hbm0}\ndrm-resident-hbm0:\t{hbm0}\n\
             drm-total-hbm1:\t{hbm1}\ndrm-resident-hbm1:\t{hbm1}\n\
             tdrv-buffers:\t2\ndrm-engine-copy:\t50 ns\ntdrv-device:\t{dev}\ntdrv-jobs-queued:\t0\n"
        )
    }

    /// A process `pid` named `comm` with `fds`: (fd, link target, fdinfo).
    fn process(root: &Path, pid: i32, comm: &str, fds: &[(i32, &str, String)]) {
        let dir = root.join("proc").join(pid.to_string());
        write(&dir.join("comm"), &format!("{comm}\n"));
        fs::create_dir_all(dir.join("fd")).unwrap();
        for (fd, target, info) in fds {
            symlink(target, dir.join("fd").join(fd.to_string())).unwrap();
            write(&dir.join("fdinfo").join(fd.to_string()), info);
        }
    }

    #[test]
    fn no_module() {
        let scratch = scratch();
        let root = &scratch.0;
        let p = Paths::under(root);
        let l = devices(&p, &[], Duration::ZERO);
        assert!(l.devices.is_empty());
        assert_eq!(l.errors.len(), 1);
        assert_eq!(l.errors[0].kind, ProblemKind::NoDevice);
        assert!(l.errors[0].message.contains("not loaded"), "{:?}", l.errors);
        // Loaded, but without devices: another message.
        fs::create_dir_all(root.join("sys/module/tdrv")).unwrap();
        let l = devices(&p, &[], Duration::ZERO);
        assert!(l.errors[0].message.contains("no devices"), "{:?}", l.errors);
        // A named device that does not exist.
        let l = devices(&p, &["tdrv3".into()], Duration::ZERO);
        assert_eq!(l.errors[0].kind, ProblemKind::NoDevice);
        assert!(l.errors[0].message.contains("tdrv3"));
        let l = devices(&p, &["sda".into()], Duration::ZERO);
        assert!(l.errors[0].message.contains("not a tdrv device"));
    }

    /// A node that is not a tdrv device (here a regular file, so the ioctls
    /// fail with ENOTTY) is described from debugfs and sysfs.
    #[test]
    fn fallback_to_debugfs_and_sysfs() {
        let scratch = scratch();
        let root = &scratch.0;
        let p = Paths::under(root);
        write(&root.join("dev/tdrv1"), "");
        write(&root.join("dev/tdrvx"), "");
        write(&root.join("sys/class/misc/tdrv1/busy_ns"), "1000\n");
        write(
            &root.join("sys/kernel/debug/tdrv/tdrv1/stats"),
            "kind: soft\nbound: true\nopen_files: 2\n\
             channel0: buffers 1 used 4096 peak 8192 limit 65536 failed_allocs 3\n\
             jobs_submitted: 1\njobs_completed: 1\njobs_failed: 0\nbusy_ns: 999\nirqs: 0\n",
        );
        let l = devices(&p, &[], Duration::ZERO);
        assert!(l.errors.is_empty(), "{:?}", l.errors);
        assert_eq!(l.devices.len(), 1, "tdrvx is not a device name");
        let d = &l.devices[0];
        assert_eq!(d.name, "tdrv1");
        assert_eq!(d.kind.as_deref(), Some("soft"));
        assert_eq!(d.abi, None);
        // Not discounted: tdrv-smi did not hold a file of its own.
        assert_eq!(d.open_files, Some(2));
        assert_eq!(d.channels.len(), 1);
        assert_eq!(d.buffers, Some(1));
        assert_eq!(d.failed_allocs, Some(3));
        // sysfs wins over debugfs for busy_ns.
        assert_eq!(d.busy_ns, Some(1000));
        assert_eq!(d.busy_percent, None, "not sampled");
        assert_eq!(d.sources, ["debugfs", "sysfs"]);
        assert!(
            l.warnings.iter().any(|w| w.contains("ABI")),
            "{:?}",
            l.warnings
        );
    }

    #[test]
    fn no_source_at_all_is_an_error() {
        let scratch = scratch();
        let root = &scratch.0;
        let p = Paths::under(root);
        fs::create_dir_all(root.join("sys/class/misc/tdrv0")).unwrap();
        let l = devices(&p, &[], Duration::ZERO);
        assert_eq!(l.devices.len(), 1);
        assert_eq!(l.errors.len(), 1);
        assert_eq!(l.errors[0].kind, ProblemKind::NoDevice);
        assert!(l.errors[0].message.contains("no device node"));
        assert!(
            l.warnings.iter().any(|w| w.contains("debugfs mounted")),
            "{:?}",
            l.warnings
        );
    }

    #[test]
    fn busy_share() {
        let mut s = BusySampler::default();
        assert_eq!(s.sample("tdrv0", 100), None, "first reading");
        std::thread::sleep(Duration::from_millis(20));
        let pct = s.sample("tdrv0", 100).unwrap();
        assert_eq!(pct, 0.0);
        std::thread::sleep(Duration::from_millis(20));
        // More busy time than wall time (a long job ended): clamped.
        assert_eq!(s.sample("tdrv0", 100 + 10_000_000_000).unwrap(), 100.0);
        std::thread::sleep(Duration::from_millis(20));
        let p = s.sample("tdrv0", 100 + 10_000_000_000 + 5_000_000).unwrap();
        assert!(p > 0.0 && p < 100.0, "{p}");
    }

    #[test]
    fn processes_grouped_by_client() {
        let scratch = scratch();
        let root = &scratch.0;
        let p = Paths::under(root);
        // pid 10: two fds of client 5 (dup), one of client 6 on tdrv1, a pipe.
        process(
            root,
            10,
            "trainer",
            &[
                (3, "/dev/tdrv0", fdinfo(5, "tdrv0", 8192, 0)),
                (7, "/dev/tdrv0", fdinfo(5, "tdrv0", 8192, 0)),
                (4, "/dev/tdrv1", fdinfo(6, "tdrv1", 0, 4096)),
                (5, "pipe:[1234]", "pos:\t0\n".into()),
            ],
        );
        // pid 11 inherited client 5 (fork).
        process(
            root,
            11,
            "worker",
            &[(3, "/dev/tdrv0", fdinfo(5, "tdrv0", 8192, 0))],
        );
        // A file named like a node whose fdinfo is not tdrv's.
        process(root, 12, "odd", &[(3, "/tmp/tdrv0", "pos:\t0\n".into())]);
        // Not a process directory.
        write(&root.join("proc/self-test"), "");

        let l = processes(&p, &[]);
        assert_eq!(l.unreadable_processes, 0);
        let rows: Vec<_> = l
            .processes
            .iter()
            .map(|c| (c.pid, c.client_id, c.fds.clone(), c.shared))
            .collect();
        assert_eq!(
            rows,
            [
                (10, 5, vec![3, 7], true),
                (10, 6, vec![4], false),
                (11, 5, vec![3], true)
            ]
        );
        let c = &l.processes[0];
        assert_eq!(c.comm, "trainer");
        assert_eq!(c.device, "tdrv0");
        assert_eq!(c.total_bytes, 8192);
        assert_eq!(c.channels[0].total_bytes, 8192);
        assert_eq!(c.channels[1].resident_bytes, 0);
        assert_eq!(c.buffers, Some(2));
        assert_eq!(c.engine_copy_ns, Some(50));

        let only1 = processes(&p, &wanted_names(&["/dev/tdrv1".into()]));
        assert_eq!(only1.processes.len(), 1);
        assert_eq!(only1.processes[0].client_id, 6);
        assert!(!only1.processes[0].shared);
        assert_eq!(
            processes(&p, &wanted_names(&["1".into()])).processes.len(),
            1
        );
    }
}
