//! What `tdrv-smi --json` and `tdrv-smi ps --json` print: the stable
//! output for scripts, documented field by field in the crate's README.
//!
//! Compatibility rule: within one `schema` number, fields are only ever
//! added, never renamed, removed or given another meaning. A value that a
//! source could not provide is `null` (never a made-up 0), so a script can
//! tell "zero" from "unknown".

use serde::Serialize;

/// The `schema` number of both documents.
pub const SCHEMA: u32 = 1;

/// `tdrv-smi --json`.
#[derive(Debug, Serialize)]
pub struct DeviceList {
    pub schema: u32,
    /// Devices in node number order.
    pub devices: Vec<Device>,
    /// Problems that left part of the picture unknown; see `Problem`.
    pub errors: Vec<Problem>,
    /// Sources that were unavailable but had a fallback.
    pub warnings: Vec<String>,
}

/// One tdrv device.
#[derive(Debug, Serialize, Default, Clone)]
pub struct Device {
    /// Device node, e.g. `/dev/tdrv0`.
    pub node: String,
    /// Kernel name, e.g. `tdrv0` (also fdinfo's `tdrv-device`).
    pub name: String,
    /// `soft`, `edu`, or `unknown(N)` for a kind this tool does not know.
    pub kind: Option<String>,
    pub abi: Option<Abi>,
    /// `TDRV_FEAT_*` bits.
    pub features: Option<u64>,
    /// Largest single allocation the device accepts, bytes.
    pub max_buffer_size: Option<u64>,
    /// Whether the device is bound to its hardware (debugfs only).
    pub bound: Option<bool>,
    /// Open files of the device, not counting tdrv-smi's own (debugfs only).
    pub open_files: Option<u64>,
    /// HBM channels in index order (empty when no source answered).
    pub channels: Vec<Channel>,
    /// Live buffers over all channels.
    pub buffers: Option<u64>,
    /// Allocations refused for lack of space, over all channels.
    pub failed_allocs: Option<u64>,
    /// Job counters since the module was loaded (debugfs only).
    pub jobs: Option<Jobs>,
    /// Engine counters since the module was loaded (debugfs only).
    pub engine: Option<Engine>,
    /// Nanoseconds the copy engine has spent running jobs since load.
    pub busy_ns: Option<u64>,
    /// Share of the sampling interval the engine was busy, 0-100, or null
    /// when not sampled (`--interval-ms 0`) or busy_ns is unknown.
    pub busy_percent: Option<f64>,
    /// Which sources answered: any of `ioctl`, `debugfs`, `sysfs`.
    pub sources: Vec<&'static str>,
}

#[derive(Debug, Serialize, Clone, Copy, PartialEq, Eq)]
pub struct Abi {
    pub major: u32,
    pub minor: u32,
}

/// One HBM channel of a device.
#[derive(Debug, Serialize, Default, Clone, PartialEq, Eq)]
pub struct Channel {
    pub channel: u32,
    pub limit_bytes: u64,
    pub used_bytes: u64,
    pub peak_bytes: u64,
    pub buffers: u64,
    pub failed_allocs: u64,
}

#[derive(Debug, Serialize, Default, Clone, PartialEq, Eq)]
pub struct Jobs {
    pub submitted: u64,
    pub completed: u64,
    pub failed: u64,
    pub cancelled: u64,
    pub waits: u64,
    pub wait_timeouts: u64,
}

#[derive(Debug, Serialize, Default, Clone, PartialEq, Eq)]
pub struct Engine {
    pub irqs: u64,
    pub spurious_irqs: u64,
    pub watchdog_timeouts: u64,
    pub resets: u64,
}

/// Something tdrv-smi could not find out.
#[derive(Debug, Serialize, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The node concerned, or null for the whole system.
    pub device: Option<String>,
    /// One of `no-device`, `permission`, `unbound`, `io`.
    pub kind: ProblemKind,
    pub message: String,
}

#[derive(Debug, Serialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum ProblemKind {
    /// Any other failure.
    Io,
    /// The device went away (edu unbound): ENODEV.
    Unbound,
    /// The module is not loaded, or no such device.
    NoDevice,
    /// EACCES/EPERM on the node or on debugfs.
    Permission,
}

/// `tdrv-smi ps --json`.
#[derive(Debug, Serialize)]
pub struct ProcessList {
    pub schema: u32,
    /// One entry per (process, open tdrv file) pair, by pid then client id.
    pub processes: Vec<ProcessClient>,
    /// Processes whose file descriptors could not be read (not root).
    pub unreadable_processes: u64,
    /// Why there is nothing to list (no tdrv device); see `Problem`.
    pub errors: Vec<Problem>,
    pub warnings: Vec<String>,
}

/// One open tdrv file as one process sees it. A file shared by several
/// processes (inherited over fork, passed over a socket) appears once per
/// process, with the same `client_id` and `shared: true`.
#[derive(Debug, Serialize, Clone, PartialEq, Eq)]
pub struct ProcessClient {
    pub pid: i32,
    /// `/proc/<pid>/comm`.
    pub comm: String,
    /// fdinfo `drm-client-id`: unique per open file, across devices.
    pub client_id: u64,
    /// fdinfo `tdrv-device`, e.g. `tdrv0`.
    pub device: String,
    /// The process's descriptors of this file, ascending (dup'd fds share
    /// one file).
    pub fds: Vec<i32>,
    /// Per HBM channel, in index order.
    pub channels: Vec<ClientChannel>,
    /// Sum of `channels[].total_bytes`.
    pub total_bytes: u64,
    /// fdinfo `tdrv-buffers`: live buffer handles of the file.
    pub buffers: Option<u64>,
    /// fdinfo `drm-engine-copy`: engine time of this file's jobs, ns.
    pub engine_copy_ns: Option<u64>,
    /// fdinfo `tdrv-jobs-queued`: unfinished jobs of the file.
    pub jobs_queued: Option<u64>,
    /// Another process holds the same file (same client id).
    pub shared: bool,
}

#[derive(Debug, Serialize, Clone, PartialEq, Eq)]
pub struct ClientChannel {
    pub channel: u32,
    /// fdinfo `drm-total-hbm<N>`.
    pub total_bytes: u64,
    /// fdinfo `drm-resident-hbm<N>`.
    pub resident_bytes: u64,
}
