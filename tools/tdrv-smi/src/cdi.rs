//! A Container Device Interface (CDI) spec of the tdrv devices, so that
//! container engines (podman, containerd, CRI-O) can hand them to a
//! container by name: `--device tdrv.dev/device=tdrv0` or `=all`.
//!
//! The spec is generated from sysfs: one CDI device per `/sys/class/misc/
//! tdrv<N>`, with its node's major:minor, and the owner group and mode of
//! `/dev/tdrv<N>` as udev left it. The group matters: a rootful engine
//! creates the node inside the container with the numbers the spec gives,
//! so the container's users reach it through the same group as the host's
//! (`--group-add`). A rootless engine bind-mounts the host's node, whose
//! group the user keeps with `--group-add keep-groups`.
//!
//! Devices come and go (module load, unbind, hotplug), so the spec is
//! dynamic: it lives in `/var/run/cdi` (a tmpfs, empty at boot), a udev
//! rule rewrites it on every add and remove, and it is removed when there
//! is no device (a CDI spec must name at least one).

use std::fs;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::collect::Paths;
use crate::parse;

/// The CDI kind of tdrv devices: `vendor/class`, as in `tdrv.dev/device=all`.
pub const KIND: &str = "tdrv.dev/device";

/// The spec version written. 0.5.0 is the first that lets a device name
/// start with a digit and is read by every CDI-aware engine in Debian; the
/// spec uses nothing newer.
pub const CDI_VERSION: &str = "0.5.0";

/// Where the spec goes by default: the directory of dynamic specs, which
/// engines read after (and over) the static ones in `/etc/cdi`.
pub const DEFAULT_OUTPUT: &str = "/var/run/cdi/tdrv.json";

/// A CDI spec (only the fields tdrv uses).
#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    /// The CDI version the document follows.
    pub cdi_version: &'static str,
    /// [`KIND`].
    pub kind: &'static str,
    /// `tdrv<N>` for each device, then `all`.
    pub devices: Vec<Device>,
}

/// One named CDI device.
#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    /// `tdrv<N>`, or `all`.
    pub name: String,
    /// What the engine adds to the container for it.
    pub container_edits: ContainerEdits,
}

/// The container edits of a device: only device nodes.
#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// The nodes the container gets.
    pub device_nodes: Vec<DeviceNode>,
}

/// A character device node in the container.
#[derive(Debug, Serialize, PartialEq, Eq, Clone)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// The node's path, the same inside the container as on the host.
    pub path: String,
    /// Always `c`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The major number (the misc major).
    pub major: u32,
    /// The minor number.
    pub minor: u32,
    /// The device cgroup access: read and write (mmap needs no more).
    pub permissions: &'static str,
    /// The node's permission bits on the host (0660 with tdrv's udev rule).
    pub file_mode: u32,
    /// The node's owner on the host.
    pub uid: u32,
    /// The node's group on the host (`tdrv` with tdrv's udev rule).
    pub gid: u32,
}

/// Why a spec could not be made.
#[derive(Debug)]
pub enum SpecError {
    /// sysfs lists no tdrv device (module not loaded, or no device).
    NoDevice,
    /// A device's sysfs `dev` file or its node could not be read.
    Io(PathBuf, io::Error),
    /// A sysfs `dev` file did not hold `MAJOR:MINOR`.
    BadDevNumber(PathBuf, String),
}

impl std::fmt::Display for SpecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpecError::NoDevice => write!(f, "no tdrv device in sysfs"),
            SpecError::Io(p, e) => write!(f, "{}: {e}", p.display()),
            SpecError::BadDevNumber(p, s) => {
                write!(f, "{}: {s:?} is not MAJOR:MINOR", p.display())
            }
        }
    }
}

impl std::error::Error for SpecError {}

/// Parses the `MAJOR:MINOR` of a sysfs `dev` file.
fn dev_number(text: &str) -> Option<(u32, u32)> {
    let (major, minor) = text.trim().split_once(':')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// The spec of the devices sysfs lists now, in device number order.
///
/// A device whose node is missing (being removed, or no devtmpfs) is left
/// out, as an engine could not give it to a container; its name is
/// returned in the second value so that the caller can say so.
pub fn spec(paths: &Paths) -> Result<(Spec, Vec<String>), SpecError> {
    let mut found = std::collections::BTreeMap::new();
    let entries = match fs::read_dir(&paths.sys_misc) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(SpecError::NoDevice),
        Err(e) => return Err(SpecError::Io(paths.sys_misc.clone(), e)),
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(n) = parse::device_number(&name) {
            found.insert(n, name);
        }
    }
    let mut nodes = Vec::new();
    let mut missing = Vec::new();
    for name in found.into_values() {
        let devfile = paths.sys_misc.join(&name).join("dev");
        let text = match fs::read_to_string(&devfile) {
            Ok(t) => t,
            // Removed between the listing and now.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(SpecError::Io(devfile, e)),
        };
        let (major, minor) =
            dev_number(&text).ok_or_else(|| SpecError::BadDevNumber(devfile, text.clone()))?;
        let node = paths.dev.join(&name);
        let meta = match fs::metadata(&node) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                missing.push(name);
                continue;
            }
            Err(e) => return Err(SpecError::Io(node, e)),
        };
        nodes.push((
            name.clone(),
            DeviceNode {
                // The path in the container, whatever root the tree was
                // read under.
                path: format!("/dev/{name}"),
                kind: "c",
                major,
                minor,
                permissions: "rw",
                file_mode: meta.permissions().mode() & 0o7777,
                uid: meta.uid(),
                gid: meta.gid(),
            },
        ));
    }
    if nodes.is_empty() {
        return Err(SpecError::NoDevice);
    }
    let all = Device {
        name: "all".into(),
        container_edits: ContainerEdits {
            device_nodes: nodes.iter().map(|(_, n)| n.clone()).collect(),
        },
    };
    let mut devices: Vec<Device> = nodes
        .into_iter()
        .map(|(name, node)| Device {
            name,
            container_edits: ContainerEdits {
                device_nodes: vec![node],
            },
        })
        .collect();
    devices.push(all);
    Ok((
        Spec {
            cdi_version: CDI_VERSION,
            kind: KIND,
            devices,
        },
        missing,
    ))
}

/// The spec as the JSON text written to a file.
pub fn to_json(spec: &Spec) -> String {
    // Serializing plain data into a String cannot fail.
    let mut s = serde_json::to_string_pretty(spec).expect("JSON of plain data");
    s.push('\n');
    s
}

/// Holds an exclusive flock on a directory for as long as it lives (the
/// lock goes with the descriptor when the file is dropped).
struct DirLock {
    _dir: fs::File,
}

impl DirLock {
    fn take(dir: &Path) -> io::Result<DirLock> {
        let f = fs::File::open(dir)?;
        // SAFETY: flock only reads the descriptor number, which `f` keeps
        // open for the duration of the call.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(DirLock { _dir: f })
    }
}

/// What [`update`] did to the file.
#[derive(Debug, PartialEq, Eq)]
pub enum Update {
    /// Wrote a spec of this many devices (not counting `all`).
    Wrote(usize),
    /// There is no device: the file was removed (or was not there).
    Removed,
}

/// Rewrites `output` from the devices present now, or removes it when
/// there are none. Returns what it did and the devices left out because
/// their node is missing.
///
/// Several updates may run at once (udev runs one per event, in
/// parallel): each holds a lock on `output`'s directory from reading sysfs
/// to renaming its file into place, so the last to finish read the newest
/// state. Readers see the old file or the new one, never a part: the text
/// goes to a temporary file in the same directory first.
pub fn update(paths: &Paths, output: &Path) -> Result<(Update, Vec<String>), SpecError> {
    let dir = match output.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    // No directory and no device: nothing to write and nothing to remove
    // (a package install in a chroot, say), so nothing is created.
    if !dir.exists() && matches!(spec(paths), Err(SpecError::NoDevice)) {
        return Ok((Update::Removed, Vec::new()));
    }
    fs::create_dir_all(&dir).map_err(|e| SpecError::Io(dir.clone(), e))?;
    let _lock = DirLock::take(&dir).map_err(|e| SpecError::Io(dir.clone(), e))?;
    let (spec, missing) = match spec(paths) {
        Ok(s) => s,
        Err(SpecError::NoDevice) => {
            return match fs::remove_file(output) {
                Ok(()) => Ok((Update::Removed, Vec::new())),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok((Update::Removed, Vec::new())),
                Err(e) => Err(SpecError::Io(output.to_path_buf(), e)),
            };
        }
        Err(e) => return Err(e),
    };
    let name = output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "tdrv.json".into());
    // A leading dot and no .json/.yaml suffix: engines scanning the
    // directory ignore the file while it is being written.
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let write = || -> io::Result<()> {
        let mut f = fs::File::create(&tmp)?;
        f.set_permissions(fs::Permissions::from_mode(0o644))?;
        f.write_all(to_json(&spec).as_bytes())?;
        f.sync_all()?;
        fs::rename(&tmp, output)
    };
    if let Err(e) = write() {
        let _ = fs::remove_file(&tmp);
        return Err(SpecError::Io(output.to_path_buf(), e));
    }
    Ok((Update::Wrote(spec.devices.len() - 1), missing))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake tree: sysfs entries with `dev` files and nodes (plain files,
    /// whose mode and owner stand in for a device node's).
    fn tree(devs: &[(&str, &str, bool)]) -> (PathBuf, Paths) {
        let root = std::env::temp_dir().join(format!(
            "tdrv-smi-cdi-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&root);
        let paths = Paths::under(&root);
        fs::create_dir_all(&paths.dev).unwrap();
        fs::create_dir_all(&paths.sys_misc).unwrap();
        // Another misc device, which is not tdrv's.
        fs::create_dir_all(paths.sys_misc.join("fuse")).unwrap();
        fs::write(paths.sys_misc.join("fuse/dev"), "10:229\n").unwrap();
        for (name, dev, node) in devs {
            fs::create_dir_all(paths.sys_misc.join(name)).unwrap();
            fs::write(paths.sys_misc.join(name).join("dev"), format!("{dev}\n")).unwrap();
            if *node {
                let p = paths.dev.join(name);
                fs::write(&p, "").unwrap();
                fs::set_permissions(&p, fs::Permissions::from_mode(0o660)).unwrap();
            }
        }
        (root, paths)
    }

    #[test]
    fn spec_names_each_device_in_number_order_then_all() {
        let (root, paths) = tree(&[
            ("tdrv10", "10:120", true),
            ("tdrv2", "10:121", true),
            ("tdrv0", "10:122", true),
        ]);
        let (spec, missing) = spec(&paths).unwrap();
        assert!(missing.is_empty());
        assert_eq!(spec.cdi_version, "0.5.0");
        assert_eq!(spec.kind, "tdrv.dev/device");
        let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["tdrv0", "tdrv2", "tdrv10", "all"]);
        let n = &spec.devices[1].container_edits.device_nodes;
        assert_eq!(n.len(), 1);
        assert_eq!(
            (n[0].path.as_str(), n[0].kind, n[0].major, n[0].minor),
            ("/dev/tdrv2", "c", 10, 121)
        );
        assert_eq!((n[0].permissions, n[0].file_mode), ("rw", 0o660));
        let meta = fs::metadata(paths.dev.join("tdrv2")).unwrap();
        assert_eq!((n[0].uid, n[0].gid), (meta.uid(), meta.gid()));
        let all: Vec<&str> = spec.devices[3]
            .container_edits
            .device_nodes
            .iter()
            .map(|n| n.path.as_str())
            .collect();
        assert_eq!(all, ["/dev/tdrv0", "/dev/tdrv2", "/dev/tdrv10"]);
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn json_uses_cdi_field_names() {
        let (root, paths) = tree(&[("tdrv0", "10:125", true)]);
        let (spec, _) = spec(&paths).unwrap();
        let v: serde_json::Value = serde_json::from_str(&to_json(&spec)).unwrap();
        assert_eq!(v["cdiVersion"], "0.5.0");
        assert_eq!(v["kind"], "tdrv.dev/device");
        let node = &v["devices"][0]["containerEdits"]["deviceNodes"][0];
        assert_eq!(node["path"], "/dev/tdrv0");
        assert_eq!(node["type"], "c");
        assert_eq!(node["major"], 10);
        assert_eq!(node["minor"], 125);
        assert_eq!(node["fileMode"], 0o660);
        assert_eq!(node["permissions"], "rw");
        assert!(node["gid"].is_u64());
        assert_eq!(v["devices"][1]["name"], "all");
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_device_without_its_node_is_left_out_and_named() {
        let (root, paths) = tree(&[("tdrv0", "10:122", true), ("tdrv1", "10:123", false)]);
        let (spec, missing) = spec(&paths).unwrap();
        assert_eq!(missing, ["tdrv1"]);
        let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["tdrv0", "all"]);
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_bad_dev_file_is_an_error_naming_it() {
        let (root, paths) = tree(&[("tdrv0", "10-122", true)]);
        match spec(&paths) {
            Err(SpecError::BadDevNumber(p, s)) => {
                assert!(p.ends_with("tdrv0/dev"), "{}", p.display());
                assert_eq!(s, "10-122\n");
            }
            other => panic!("expected BadDevNumber, got {other:?}"),
        }
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn update_writes_then_removes_when_no_device_is_left() {
        let (root, paths) = tree(&[("tdrv0", "10:122", true)]);
        let out = root.join("run/cdi/tdrv.json");
        assert_eq!(update(&paths, &out).unwrap().0, Update::Wrote(1));
        let v: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(v["devices"][0]["name"], "tdrv0");
        assert_eq!(
            fs::metadata(&out).unwrap().permissions().mode() & 0o777,
            0o644
        );
        // Nothing but the spec is left in the directory.
        let left: Vec<_> = fs::read_dir(out.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["tdrv.json"]);
        // The device goes away (module unloaded): the spec goes too.
        fs::remove_dir_all(paths.sys_misc.join("tdrv0")).unwrap();
        assert_eq!(update(&paths, &out).unwrap().0, Update::Removed);
        assert!(!out.exists());
        // Removing what is not there is no error.
        assert_eq!(update(&paths, &out).unwrap().0, Update::Removed);
        // With no device, a missing directory is not created.
        let elsewhere = root.join("run/other/tdrv.json");
        assert_eq!(update(&paths, &elsewhere).unwrap().0, Update::Removed);
        assert!(!root.join("run/other").exists());
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn no_sysfs_class_is_no_device() {
        let (root, paths) = tree(&[]);
        fs::remove_dir_all(&paths.sys_misc).unwrap();
        assert!(matches!(spec(&paths), Err(SpecError::NoDevice)));
        fs::remove_dir_all(root).unwrap();
    }
}
