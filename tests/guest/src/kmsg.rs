//! The kernel's own reports around an action: the kernel log and the
//! DMA-API debugging's error count, read before and after it.

use std::fs;

/// The DMA-API debugging's error count (`None` without it: Debian's
/// kernel). It counts every report, also those past the few it prints.
pub fn dma_api_errors() -> Option<u64> {
    fs::read_to_string("/sys/kernel/debug/dma-api/error_count")
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// The kernel log's lines.
pub fn kernel_log() -> Result<Vec<String>, String> {
    let out = std::process::Command::new("dmesg")
        .output()
        .map_err(|e| format!("dmesg: {e}"))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect())
}

/// The lines of a kernel log `after` that are not in `before` and report
/// a DMA-API error, a warning, a bug or a leak.
pub fn new_reports(before: &[String], after: &[String]) -> Vec<String> {
    after
        .iter()
        .skip(before.len())
        .filter(|l| {
            [
                "DMA-API",
                "pending DMA",
                "WARNING:",
                "BUG:",
                "leak",
                "Call Trace",
            ]
            .iter()
            .any(|w| l.contains(w))
        })
        .cloned()
        .collect()
}
