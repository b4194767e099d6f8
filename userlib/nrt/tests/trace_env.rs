// SPDX-License-Identifier: MIT OR Apache-2.0
//! The C library's environment (issue 15 item 4: environment variables
//! and exit hooks belong to `libnrt.so.1`, not the Rust crate):
//! `TDRV_TRACE_FILE` gets a Chrome trace of the program's calls, finished
//! at exit.

use std::ffi::CString;
use std::process::Command;
use std::ptr::null_mut;

use nrt::*;

/// The child half of `trace_file_env_var`: does work only when asked.
/// Ignored, so that it is not counted as a test of its own: the parent
/// runs it with `--ignored`, in a process of its own.
#[test]
#[ignore = "the child half of another test; runs only in the process it starts"]
fn env_trace_child() {
    assert!(
        std::env::var_os("NRT_TRACE_TEST_CHILD").is_some(),
        "run only as the child of its parent test"
    );
    let name = CString::new("from_env").unwrap();
    let mut t = null_mut();
    let data = [7u8; 16];
    // SAFETY: valid pointers throughout.
    unsafe {
        assert_eq!(
            nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_HOST, -1, 64, name.as_ptr(), &mut t),
            NRT_SUCCESS
        );
        assert_eq!(
            nrt_tensor_write(t, data.as_ptr().cast(), 0, 16),
            NRT_SUCCESS
        );
        nrt_tensor_free(&mut t);
    }
}

#[test]
#[cfg_attr(miri, ignore = "re-runs the test binary; Miri cannot run processes")]
fn trace_file_env_var() {
    let path = std::env::temp_dir().join(format!("nrt-envtrace-{}.json", std::process::id()));
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "env_trace_child",
            "--ignored",
            "--test-threads=1",
        ])
        .env(TRACE_FILE_ENV, &path)
        .env("NRT_TRACE_TEST_CHILD", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The child really ran its half (a filter that matched nothing would
    // pass too).
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("test result: ok. 1 passed"),
        "the child did not run env_trace_child: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    // Finished at exit: a complete JSON array with the alloc (27), write
    // (10) and free (28) events of the tensor.
    let text = text.trim_end();
    assert!(text.starts_with('[') && text.ends_with(']'), "{text}");
    for id in [27, 10, 28] {
        let begin = format!("\"event_id\":{id}");
        assert!(
            text.contains(&begin) && text.contains("from_env"),
            "event {id} missing: {text}"
        );
    }
}
