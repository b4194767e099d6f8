//! Parsers of the kernel's text interfaces: debugfs `stats` and fdinfo.
//! They are lenient about what they do not know (new keys are skipped,
//! a missing key is `None`), so an older tool reads a newer module.

use crate::model::{Channel, Engine, Jobs};

/// `/sys/kernel/debug/tdrv/tdrv<N>/stats`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub kind: Option<String>,
    pub bound: Option<bool>,
    pub open_files: Option<u64>,
    pub channels: Vec<Channel>,
    pub jobs: Option<Jobs>,
    pub engine: Option<Engine>,
    pub busy_ns: Option<u64>,
}

/// Parses `key: value` lines; channel lines look like
/// `channel0: buffers B used U peak P limit L failed_allocs F`.
pub fn stats(text: &str) -> Stats {
    let mut s = Stats::default();
    let mut num = std::collections::HashMap::new();
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        if let Some(idx) = key.strip_prefix("channel") {
            if let (Ok(channel), Some(c)) = (idx.parse::<u32>(), channel_line(value)) {
                s.channels.push(Channel { channel, ..c });
            }
            continue;
        }
        match key {
            "kind" => s.kind = Some(value.to_string()),
            "bound" => s.bound = value.parse().ok(),
            _ => {
                if let Ok(n) = value.parse::<u64>() {
                    num.insert(key.to_string(), n);
                }
            }
        }
    }
    s.channels.sort_by_key(|c| c.channel);
    s.open_files = num.get("open_files").copied();
    s.busy_ns = num.get("busy_ns").copied();
    let get = |k: &str| num.get(k).copied();
    // The job block is reported only if the module printed its core
    // counters; a partial block from a future format would mislead.
    if let (Some(submitted), Some(completed), Some(failed)) = (
        get("jobs_submitted"),
        get("jobs_completed"),
        get("jobs_failed"),
    ) {
        s.jobs = Some(Jobs {
            submitted,
            completed,
            failed,
            cancelled: get("jobs_cancelled").unwrap_or(0),
            waits: get("waits").unwrap_or(0),
            wait_timeouts: get("wait_timeouts").unwrap_or(0),
        });
    }
    if let Some(irqs) = get("irqs") {
        s.engine = Some(Engine {
            irqs,
            spurious_irqs: get("spurious_irqs").unwrap_or(0),
            watchdog_timeouts: get("watchdog_timeouts").unwrap_or(0),
            resets: get("resets").unwrap_or(0),
        });
    }
    s
}

/// `buffers B used U peak P limit L failed_allocs F` (any order). All five
/// must be there: a channel with a guessed field is worse than none.
fn channel_line(value: &str) -> Option<Channel> {
    let words: Vec<&str> = value.split_whitespace().collect();
    let (mut buffers, mut used, mut peak, mut limit, mut failed) = (None, None, None, None, None);
    for pair in words.chunks(2) {
        let [k, v] = pair else { break };
        let v = v.parse::<u64>().ok();
        match *k {
            "buffers" => buffers = v,
            "used" => used = v,
            "peak" => peak = v,
            "limit" => limit = v,
            "failed_allocs" => failed = v,
            _ => {}
        }
    }
    Some(Channel {
        channel: 0,
        limit_bytes: limit?,
        used_bytes: used?,
        peak_bytes: peak?,
        buffers: buffers?,
        failed_allocs: failed?,
    })
}

/// The tdrv keys of `/proc/<pid>/fdinfo/<fd>`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct FdInfo {
    pub driver: Option<String>,
    pub client_id: Option<u64>,
    /// (channel, total bytes, resident bytes), by channel.
    pub channels: Vec<(u32, u64, u64)>,
    pub engine_copy_ns: Option<u64>,
    pub buffers: Option<u64>,
    pub device: Option<String>,
    pub jobs_queued: Option<u64>,
}

impl FdInfo {
    /// Whether this is a tdrv file (fdinfo of any other file lacks the key).
    pub fn is_tdrv(&self) -> bool {
        self.driver.as_deref() == Some("tdrv")
    }
}

/// Parses fdinfo text. The generic lines (`pos:`, `flags:`, ...) are
/// skipped.
pub fn fdinfo(text: &str) -> FdInfo {
    let mut f = FdInfo::default();
    let mut total = std::collections::BTreeMap::<u32, u64>::new();
    let mut resident = std::collections::BTreeMap::<u32, u64>::new();
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if let Some(ch) = key.strip_prefix("drm-total-hbm") {
            if let (Ok(ch), Some(b)) = (ch.parse(), memory(value)) {
                total.insert(ch, b);
            }
            continue;
        }
        if let Some(ch) = key.strip_prefix("drm-resident-hbm") {
            if let (Ok(ch), Some(b)) = (ch.parse(), memory(value)) {
                resident.insert(ch, b);
            }
            continue;
        }
        match key {
            "drm-driver" => f.driver = Some(value.to_string()),
            "drm-client-id" => f.client_id = value.parse().ok(),
            "drm-engine-copy" => f.engine_copy_ns = nanoseconds(value),
            "tdrv-buffers" => f.buffers = value.parse().ok(),
            "tdrv-device" => f.device = Some(value.to_string()),
            "tdrv-jobs-queued" => f.jobs_queued = value.parse().ok(),
            _ => {}
        }
    }
    // A channel is listed if either key names it; a missing resident
    // figure is the total (tdrv memory is always resident).
    let mut chans: std::collections::BTreeSet<u32> = total.keys().copied().collect();
    chans.extend(resident.keys().copied());
    f.channels = chans
        .into_iter()
        .map(|ch| {
            let t = total.get(&ch).or(resident.get(&ch)).copied().unwrap_or(0);
            (ch, t, resident.get(&ch).copied().unwrap_or(t))
        })
        .collect();
    f
}

/// A drm-usage-stats memory value: bytes, optionally with a `KiB`/`MiB`
/// unit (the spec allows them; tdrv prints plain bytes).
fn memory(value: &str) -> Option<u64> {
    let mut it = value.split_whitespace();
    let n: u64 = it.next()?.parse().ok()?;
    let scale = match it.next() {
        None => 1,
        Some("KiB") => 1 << 10,
        Some("MiB") => 1 << 20,
        Some("GiB") => 1 << 30,
        Some(_) => return None,
    };
    n.checked_mul(scale)
}

/// A drm-usage-stats engine value: `N ns`.
fn nanoseconds(value: &str) -> Option<u64> {
    let mut it = value.split_whitespace();
    let n = it.next()?.parse().ok()?;
    match it.next() {
        Some("ns") | None => Some(n),
        Some(_) => None,
    }
}

/// The device number of a `tdrv<N>` name, if it is one.
pub fn device_number(name: &str) -> Option<u32> {
    let n = name.strip_prefix("tdrv")?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATS: &str = "kind: edu\nbound: true\nopen_files: 3\n\
        channel0: buffers 2 used 8192 peak 12288 limit 67108864 failed_allocs 1\n\
        channel1: buffers 0 used 0 peak 4096 limit 67108864 failed_allocs 0\n\
        jobs_submitted: 5\njobs_completed: 4\njobs_failed: 1\nwaits: 7\n\
        wait_timeouts: 2\njobs_cancelled: 0\nbusy_ns: 123456\nirqs: 9\n\
        spurious_irqs: 1\nwatchdog_timeouts: 0\nresets: 0\n";

    #[test]
    fn stats_every_field() {
        let s = stats(STATS);
        assert_eq!(s.kind.as_deref(), Some("edu"));
        assert_eq!(s.bound, Some(true));
        assert_eq!(s.open_files, Some(3));
        assert_eq!(s.busy_ns, Some(123456));
        assert_eq!(
            s.channels,
            vec![
                Channel {
                    channel: 0,
                    limit_bytes: 67108864,
                    used_bytes: 8192,
                    peak_bytes: 12288,
                    buffers: 2,
                    failed_allocs: 1
                },
                Channel {
                    channel: 1,
                    limit_bytes: 67108864,
                    used_bytes: 0,
                    peak_bytes: 4096,
                    buffers: 0,
                    failed_allocs: 0
                },
            ]
        );
        assert_eq!(
            s.jobs,
            Some(Jobs {
                submitted: 5,
                completed: 4,
                failed: 1,
                cancelled: 0,
                waits: 7,
                wait_timeouts: 2
            })
        );
        assert_eq!(
            s.engine,
            Some(Engine {
                irqs: 9,
                spurious_irqs: 1,
                watchdog_timeouts: 0,
                resets: 0
            })
        );
    }

    #[test]
    fn stats_partial_channel_line_is_dropped() {
        let s = stats("channel0: buffers 2 used 8192 peak 12288\nchannel1: buffers 1 used 4096 peak 4096 limit 8192 failed_allocs 0\n");
        assert_eq!(s.channels.len(), 1);
        assert_eq!(s.channels[0].channel, 1);
        assert_eq!(s.jobs, None);
        assert_eq!(s.kind, None);
    }

    #[test]
    fn stats_unknown_keys_and_order() {
        let s = stats("future_key: 9\nchannel1: failed_allocs 0 limit 4 peak 3 used 2 buffers 1\nchannel0: buffers 0 used 0 peak 0 limit 4 failed_allocs 0\n");
        assert_eq!(
            s.channels.iter().map(|c| c.channel).collect::<Vec<_>>(),
            [0, 1]
        );
        assert_eq!(s.channels[1].used_bytes, 2);
        assert_eq!(s.channels[1].buffers, 1);
    }

    const FDINFO: &str = "pos:\t0\nflags:\t02100002\nmnt_id:\t20\nino:\t5\n\
        drm-driver:\ttdrv\ndrm-client-id:\t17\n\
        drm-total-hbm0:\t8192\ndrm-resident-hbm0:\t8192\n\
        drm-total-hbm1:\t4096\ndrm-resident-hbm1:\t4096\n\
        tdrv-buffers:\t3\ndrm-engine-copy:\t991 ns\ntdrv-device:\ttdrv1\n\
        tdrv-jobs-queued:\t2\n";

    #[test]
    fn fdinfo_every_field() {
        let f = fdinfo(FDINFO);
        assert!(f.is_tdrv());
        assert_eq!(f.client_id, Some(17));
        assert_eq!(f.channels, vec![(0, 8192, 8192), (1, 4096, 4096)]);
        assert_eq!(f.buffers, Some(3));
        assert_eq!(f.engine_copy_ns, Some(991));
        assert_eq!(f.device.as_deref(), Some("tdrv1"));
        assert_eq!(f.jobs_queued, Some(2));
    }

    #[test]
    fn fdinfo_of_another_file() {
        let f = fdinfo("pos:\t0\nflags:\t02\nmnt_id:\t20\nino:\t5\n");
        assert!(!f.is_tdrv());
        assert_eq!(f, FdInfo::default());
        // Another DRM driver's keys are not tdrv's.
        assert!(!fdinfo("drm-driver:\ti915\ndrm-client-id:\t3\n").is_tdrv());
    }

    #[test]
    fn fdinfo_units() {
        let f = fdinfo("drm-driver:\ttdrv\ndrm-total-hbm0:\t8 KiB\ndrm-resident-hbm0:\t2 MiB\ndrm-total-hbm2:\t1 GiB\ndrm-total-hbm3:\t1 parsecs\n");
        assert_eq!(f.channels, vec![(0, 8192, 2 << 20), (2, 1 << 30, 1 << 30)]);
        assert_eq!(nanoseconds("5 ms"), None);
        assert_eq!(nanoseconds("5"), Some(5));
    }

    #[test]
    fn device_numbers() {
        assert_eq!(device_number("tdrv0"), Some(0));
        assert_eq!(device_number("tdrv12"), Some(12));
        assert_eq!(device_number("tdrv"), None);
        assert_eq!(device_number("tdrv-1"), None);
        assert_eq!(device_number("tdrvx"), None);
        assert_eq!(device_number("nvme0"), None);
    }
}
