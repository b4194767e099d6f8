//! The ABI is pinned three ways: request numbers against literals, structs
//! and numbers against what gcc computes from the header, and the committed
//! bindings against a fresh bindgen run.

extern crate std;

use super::*;
use std::{
    collections::BTreeMap,
    format,
    path::{Path, PathBuf},
    process::Command,
    string::String,
    vec::Vec,
};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

#[test]
fn request_numbers_are_pinned() {
    let pinned: &[(&str, u64)] = &[
        ("TDRV_IOC_VERSION", 0x8040_D700),
        ("TDRV_IOC_CHANNEL_INFO", 0xC040_D701),
        ("TDRV_IOC_ALLOC", 0xC038_D702),
        ("TDRV_IOC_FREE", 0x4010_D703),
        ("TDRV_IOC_BUF_INFO", 0xC050_D704),
        ("TDRV_IOC_COPY_IN", 0x4030_D705),
        ("TDRV_IOC_COPY_OUT", 0x4030_D706),
        ("TDRV_IOC_MEMSET", 0x4030_D707),
        ("TDRV_IOC_COPY", 0x4038_D708),
        ("TDRV_IOC_SUBMIT", 0xC048_D709),
        ("TDRV_IOC_JOB_WAIT", 0xC028_D70A),
        ("TDRV_IOC_FENCE_WAIT", 0x4028_D70B),
        ("TDRV_IOC_COMPLETION_WAIT", 0xC030_D70C),
        ("TDRV_IOC_COMPLETION_RESET", 0x4010_D70D),
        ("TDRV_IOC_EXPORT", 0xC028_D70E),
        ("TDRV_IOC_IMPORT", 0xC038_D70F),
        ("TDRV_IOC_JOB_NOTIFY", 0x4020_D710),
    ];
    assert_eq!(ALL_REQUESTS, pinned);
}

#[test]
fn request_with_size_replaces_only_the_size() {
    let r = request_with_size(TDRV_IOC_ALLOC, 8);
    assert_eq!(r, 0xC008_D702);
    assert_eq!(
        request_with_size(r, size_of::<tdrv_alloc>()),
        TDRV_IOC_ALLOC
    );
}

/// Compiles a C program against uapi/tdrv.h and compares every struct size,
/// field offset and request number it prints with the Rust side.
#[test]
fn c_compiler_agrees_with_rust() {
    macro_rules! layout {
        ($($ty:ident { $($field:ident),* })*) => {{
            let mut c = String::new();
            let mut rust = BTreeMap::new();
            $(
                c += &format!("P(\"sizeof {0}\", sizeof(struct {0}));\n", stringify!($ty));
                rust.insert(format!("sizeof {}", stringify!($ty)), size_of::<$ty>() as u64);
                $(
                    c += &format!(
                        "P(\"offsetof {0}.{1}\", offsetof(struct {0}, {1}));\n",
                        stringify!($ty), stringify!($field)
                    );
                    rust.insert(
                        format!("offsetof {}.{}", stringify!($ty), stringify!($field)),
                        core::mem::offset_of!($ty, $field) as u64,
                    );
                )*
            )*
            (c, rust)
        }};
    }
    let (mut body, mut rust) = layout! {
        tdrv_version { abi_major, abi_minor, features, device_kind, num_channels, max_buffer_size, reserved }
        tdrv_channel_info { channel, pad, limit_bytes, used_bytes, peak_bytes, buffers, failed_allocs, reserved }
        tdrv_alloc { size, channel, flags, handle, dma_addr, mmap_offset, reserved }
        tdrv_free { handle, reserved }
        tdrv_buf_info { handle, size, dma_addr, mmap_offset, pending_reads, pending_writes, completion_count, channel, pad, error, pad2, buf_id }
        tdrv_xfer { handle, offset, size, user_ptr, reserved }
        tdrv_memset { handle, offset, size, value, pad, reserved }
        tdrv_copy_desc { src_handle, src_offset, dst_handle, dst_offset, size }
        tdrv_copy { desc, reserved }
        tdrv_submit { descs, desc_count, desc_size, flags, pad, job_id, reserved, in_fences, in_fence_count, out_fence, user_data }
        tdrv_job_wait { job_id, timeout_us, state, status, reserved }
        tdrv_fence_wait { handle, timeout_us, kind, pad, reserved }
        tdrv_completion_wait { handle, expected, timeout_us, count, reserved }
        tdrv_completion_reset { handle, reserved }
        tdrv_export { handle, flags, fd, pad, pad2, reserved }
        tdrv_import { fd, channel, flags, pad, handle, size, mmap_offset, reserved }
        tdrv_job_notify { job_id, user_data, reserved }
        tdrv_event { status, job_id, user_data }
    };
    for (name, value) in ALL_REQUESTS {
        body += &format!("P(\"{name}\", {name});\n");
        rust.insert(String::from(*name), *value);
    }
    let src = format!(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"tdrv.h\"\n\
         #define P(n, v) printf(\"%s=%llu\\n\", n, (unsigned long long)(v))\n\
         int main(void) {{\n{body}return 0;\n}}\n"
    );
    let dir = std::env::temp_dir().join(format!("tdrv-uapi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let c_file = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&c_file, src).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(cc)
        .args(["-std=c11", "-Wall", "-Werror", "-I"])
        .arg(repo_root().join("uapi"))
        .arg(&c_file)
        .arg("-o")
        .arg(&exe)
        .status()
        .expect("run the C compiler");
    assert!(status.success(), "C compiler failed on uapi/tdrv.h");
    let out = Command::new(&exe).output().expect("run the layout program");
    let c: BTreeMap<String, u64> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap();
            (String::from(k), v.parse().unwrap())
        })
        .collect();
    std::fs::remove_dir_all(&dir).ok();
    let diffs: Vec<_> = rust.iter().filter(|(k, v)| c.get(*k) != Some(v)).collect();
    assert!(
        diffs.is_empty(),
        "Rust and C disagree: {diffs:?} (C: {c:?})"
    );
    assert_eq!(c.len(), rust.len());
}

/// The committed bindgen output must match what bindgen makes of the header
/// now. bindgen and libclang come from scripts/setup.
#[test]
fn generated_bindings_are_current() {
    let out = Command::new(repo_root().join("scripts/gen-uapi"))
        .arg("--check")
        .output()
        .expect("run scripts/gen-uapi (installed by scripts/setup)");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
