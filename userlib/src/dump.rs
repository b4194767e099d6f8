//! Debug dump of job inputs (nrt's `NEURON_RT_DBG_INPUT_DUMP_DIRECTORY`,
//! which `libnrt.so.1` reads; the crate reads no environment variable).
//!
//! When a directory is set with [`set_input_dump_directory`], every
//! submitted job first writes the bytes
//! of each of its source tensors to that directory, one file per tensor:
//! `job<seq>_input<k>_<tensor name>.bin`, where `<seq>` numbers the dumped
//! jobs of the process from 1 and characters of the name other than
//! `[A-Za-z0-9._-]` become `_`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::RwLock;

use crate::error::{Error, Result};
use crate::log::log_warn;
use crate::tensor::Tensor;

static OVERRIDE: RwLock<Option<PathBuf>> = RwLock::new(None);
/// Whether `OVERRIDE` is set: every submit checks, almost always in vain.
static DUMPING: AtomicBool = AtomicBool::new(false);
static JOB_SEQ: AtomicU64 = AtomicU64::new(0);

/// Sets the dump directory; `None` turns dumping off.
pub fn set_input_dump_directory(dir: Option<PathBuf>) {
    let mut d = OVERRIDE.write().unwrap_or_else(|e| e.into_inner());
    DUMPING.store(dir.is_some(), Ordering::Relaxed);
    *d = dir;
}

/// The directory inputs are dumped to, if any.
pub fn input_dump_directory() -> Option<PathBuf> {
    OVERRIDE.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The file-name form of a tensor name.
pub fn sanitize_name(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    match s.as_str() {
        "" | "." | ".." => "_unknown_".to_owned(),
        _ => s,
    }
}

/// Writes the bytes of each tensor to `dir` (created if needed) as
/// `<prefix>input<k>_<name>.bin`; returns the files written.
pub fn dump_tensors(dir: &Path, prefix: &str, tensors: &[Tensor]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        op: "input dump: create directory",
        source,
    })?;
    let mut files = Vec::with_capacity(tensors.len());
    for (k, t) in tensors.iter().enumerate() {
        let path = dir.join(format!("{prefix}input{k}_{}.bin", sanitize_name(t.name())));
        let bytes = match t.kind() {
            // No bytes exist for fake and empty tensors: an empty file
            // still records that the input was there.
            Some(crate::StorageKind::Fake) | None => Vec::new(),
            Some(_) => t.to_vec()?,
        };
        std::fs::write(&path, bytes).map_err(|source| Error::Io {
            op: "input dump: write",
            source,
        })?;
        files.push(path);
    }
    Ok(files)
}

/// Dumps a job's inputs when a dump directory is set; failures are logged,
/// never fatal to the job.
pub(crate) fn dump_job_inputs(inputs: &[Tensor]) {
    if !DUMPING.load(Ordering::Relaxed) {
        return;
    }
    let Some(dir) = input_dump_directory() else {
        return;
    };
    let seq = JOB_SEQ.fetch_add(1, Ordering::Relaxed) + 1;
    if let Err(e) = dump_tensors(&dir, &format!("job{seq}_"), inputs) {
        log_warn!("input dump to {}: {e}", dir.display());
    }
}
