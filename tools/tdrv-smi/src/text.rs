//! Plain-text tables for people (the JSON is for scripts). Unknown values
//! print as `-`.

use std::fmt::Write;

use tdrv_smi::model::{Device, ProcessClient};

/// 1536 -> "1.5 KiB".
pub fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Nanoseconds in the largest unit that keeps three digits or more.
pub fn duration(ns: u64) -> String {
    match ns {
        0..1_000 => format!("{ns} ns"),
        1_000..1_000_000 => format!("{:.1} us", ns as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} ms", ns as f64 / 1e6),
        _ => format!("{:.2} s", ns as f64 / 1e9),
    }
}

pub fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

pub fn percent(p: Option<f64>) -> String {
    p.map_or_else(|| "-".to_string(), |p| format!("{p:.1}%"))
}

/// Lays out rows under a header; columns whose header starts with `>` are
/// right-aligned (numbers), the `>` is not printed.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let right: Vec<bool> = header.iter().map(|h| h.starts_with('>')).collect();
    let header: Vec<String> = header
        .iter()
        .map(|h| h.trim_start_matches('>').to_string())
        .collect();
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < width.len() {
                width[i] = width[i].max(c.chars().count());
            }
        }
    }
    let mut out = String::new();
    for r in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, c) in r.iter().enumerate() {
            let w = width.get(i).copied().unwrap_or(0);
            if i > 0 {
                line.push_str("  ");
            }
            if right.get(i).copied().unwrap_or(false) {
                let _ = write!(line, "{c:>w$}");
            } else {
                let _ = write!(line, "{c:<w$}");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The device list: one line per device, then one per channel.
pub fn devices(devs: &[Device]) -> String {
    // No devices: the error on stderr says why; an empty table would not.
    if devs.is_empty() {
        return String::new();
    }
    let mut rows = Vec::new();
    for d in devs {
        let abi = d.abi.map(|a| format!("{}.{}", a.major, a.minor));
        let jobs = d.jobs.as_ref();
        let first = vec![
            d.node.clone(),
            opt(d.kind.clone()),
            opt(abi),
            percent(d.busy_percent),
            opt(d.open_files),
            opt(jobs.map(|j| j.completed)),
            opt(jobs.map(|j| j.failed + j.cancelled)),
        ];
        rows.push(first);
    }
    let mut out = table(
        &[
            "DEVICE",
            "KIND",
            "ABI",
            ">BUSY",
            ">FILES",
            ">JOBS DONE",
            ">FAILED/CANCELLED",
        ],
        &rows,
    );
    // One channel table for all devices, so the columns line up.
    let rows: Vec<Vec<String>> = devs
        .iter()
        .flat_map(|d| d.channels.iter().map(move |c| (d, c)))
        .map(|(d, c)| {
            let pct = if c.limit_bytes > 0 {
                format!("{:.0}%", c.used_bytes as f64 * 100.0 / c.limit_bytes as f64)
            } else {
                "-".into()
            };
            vec![
                format!("{} hbm{}", d.name, c.channel),
                size(c.used_bytes),
                size(c.limit_bytes),
                pct,
                size(c.peak_bytes),
                c.buffers.to_string(),
                c.failed_allocs.to_string(),
            ]
        })
        .collect();
    if !rows.is_empty() {
        out.push('\n');
        out.push_str(&table(
            &[
                "CHANNEL",
                ">USED",
                ">LIMIT",
                ">USE",
                ">PEAK",
                ">BUFFERS",
                ">FAILED ALLOCS",
            ],
            &rows,
        ));
    }
    out
}

/// The process list: one line per (process, open file).
pub fn processes(procs: &[ProcessClient]) -> String {
    if procs.is_empty() {
        return "no process holds a tdrv device\n".to_string();
    }
    let channels = procs
        .iter()
        .flat_map(|p| p.channels.iter().map(|c| c.channel + 1))
        .max()
        .unwrap_or(0);
    let mut header = vec!["PID", "COMM", "CLIENT", "DEVICE"];
    let names: Vec<String> = (0..channels).map(|c| format!(">HBM{c}")).collect();
    header.extend(names.iter().map(String::as_str));
    header.extend([">BUFFERS", ">ENGINE", ">QUEUED", "FDS"]);
    let rows: Vec<Vec<String>> = procs
        .iter()
        .map(|p| {
            let mut r = vec![
                p.pid.to_string(),
                p.comm.clone(),
                format!("{}{}", p.client_id, if p.shared { "*" } else { "" }),
                p.device.clone(),
            ];
            for ch in 0..channels {
                let b = p
                    .channels
                    .iter()
                    .find(|c| c.channel == ch)
                    .map(|c| c.total_bytes);
                r.push(b.map_or_else(|| "-".into(), size));
            }
            r.push(opt(p.buffers));
            r.push(p.engine_copy_ns.map_or_else(|| "-".into(), duration));
            r.push(opt(p.jobs_queued));
            r.push(
                p.fds
                    .iter()
                    .map(|f| f.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
            );
            r
        })
        .collect();
    let mut out = table(&header, &rows);
    if procs.iter().any(|p| p.shared) {
        out.push_str("* the file is shared with another process (fork, SCM_RIGHTS)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations() {
        assert_eq!(size(0), "0 B");
        assert_eq!(size(1023), "1023 B");
        assert_eq!(size(1536), "1.5 KiB");
        assert_eq!(size(64 << 20), "64.0 MiB");
        assert_eq!(duration(999), "999 ns");
        assert_eq!(duration(1_500), "1.5 us");
        assert_eq!(duration(2_500_000), "2.5 ms");
        assert_eq!(duration(3_000_000_000), "3.00 s");
    }

    #[test]
    fn table_alignment() {
        let t = table(
            &["NAME", ">N"],
            &[
                vec!["a".into(), "1".into()],
                vec!["bbb".into(), "100".into()],
            ],
        );
        assert_eq!(t, "NAME    N\na       1\nbbb   100\n");
    }
}
