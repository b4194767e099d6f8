// SPDX-License-Identifier: MIT OR Apache-2.0
//! Builds the C test program with gcc and runs it against the freshly built
//! libnrt.so, loaded with dlopen() by its SONAME as third-party programs do
//! (VIRTUAL placement: no device needed). Fails, never skips, when a tool is
//! missing.

use std::path::{Path, PathBuf};
use std::process::Command;

/// target/<profile>, from this test binary's path (target/<profile>/deps/..).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

fn run(cmd: &mut Command) -> std::process::Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The cdylib cargo built next to this test. `cargo test` builds the
/// crate's rlib but may leave an older cdylib in place, so it is always
/// brought up to date (a no-op when it is).
fn libnrt() -> PathBuf {
    let dir = profile_dir();
    let lib = dir.join("libnrt.so");
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "-p", "nrt", "--lib"]);
    if dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    run(&mut cmd);
    assert!(lib.exists(), "{} was not built", lib.display());
    lib
}

#[test]
#[cfg_attr(miri, ignore = "runs gcc and a C program; Miri cannot run processes")]
fn library_has_the_soname_and_only_the_nrt_exports() {
    let lib = libnrt();
    let out = run(Command::new("readelf").arg("-dW").arg(&lib));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Library soname: [libnrt.so.1]"), "{text}");

    let out = run(Command::new("nm").args(["-D", "--defined-only"]).arg(&lib));
    let mut syms: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned))
        .filter(|s| s.starts_with("nrt_"))
        .collect();
    syms.sort();
    let mut want = vec![
        "nrt_tensor_allocate",
        "nrt_tensor_free",
        "nrt_tensor_read",
        "nrt_tensor_write",
        "nrt_tensor_copy",
        "nrt_tensor_get_size",
        "nrt_tensor_memset",
        "nrt_tensor_allocate_empty",
        "nrt_tensor_attach_buffer",
        "nrt_tensor_allocate_slice",
        "nrt_tensor_get_va",
        "nrt_tensor_read_batch",
        "nrt_tensor_write_batch",
        "nrt_tensor_get_device_allocation_info",
        "nrt_tensor_check_output_completion",
        "nrt_tensor_reset_output_completion",
        "nrt_allocate_tensor_set",
        "nrt_destroy_tensor_set",
        "nrt_add_tensor_to_tensor_set",
        "nrt_get_tensor_from_tensor_set",
        "nrt_get_dmabuf_fd",
        "nrt_memcpy_to_device",
        "nrt_get_total_nc_count",
        "nrt_get_status_as_str",
    ];
    want.sort();
    assert_eq!(syms, want);

    // tdrv's own job API (tdrv/job.h), and nothing else of tdrv's.
    let mut tdrv_syms: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned))
        .filter(|s| s.starts_with("tdrv_"))
        .collect();
    tdrv_syms.sort();
    let mut want = vec![
        "tdrv_job_create",
        "tdrv_job_add_copy",
        "tdrv_job_request_fd",
        "tdrv_job_submit",
        "tdrv_job_submit_notify",
        "tdrv_job_wait",
        "tdrv_job_get_fd",
        "tdrv_job_notify",
        "tdrv_read_events",
        "tdrv_job_free",
    ];
    want.sort();
    assert_eq!(tdrv_syms, want);
}

/// Compiles `src` (C, or C++ when `cxx`) against the installed-style
/// include directory only, linked to libnrt.so.1 by SONAME as `-lnrt`
/// would; returns the program.
fn build_against_headers(src: &Path, name: &str, cxx: bool) -> PathBuf {
    let lib = libnrt();
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nrt-c-link");
    std::fs::create_dir_all(&out_dir).unwrap();
    let link = out_dir.join("libnrt.so.1");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&lib, &link).unwrap();
    let exe = out_dir.join(name);
    let mut cmd = Command::new(if cxx { "g++" } else { "gcc" });
    if cxx {
        cmd.args(["-std=c++17", "-x", "c++"]);
    } else {
        cmd.arg("-std=c11");
    }
    run(cmd
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(crate_dir.join("include"))
        .arg("-o")
        .arg(&exe)
        .arg(src)
        .arg("-L")
        .arg(&out_dir)
        .arg("-l:libnrt.so.1")
        .arg(format!("-Wl,-rpath,{}", out_dir.display())));
    exe
}

#[test]
#[cfg_attr(miri, ignore = "runs gcc and a C program; Miri cannot run processes")]
fn c_example_builds_through_the_headers_alone() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = build_against_headers(&crate_dir.join("examples/c/copy_job.c"), "copy_job", false);
    // Without a device it fails with the status's name, not a crash.
    let out = Command::new(&exe)
        .arg("/nonexistent/tdrv9")
        .env("NEURON_RT_LOG_LEVEL", "OFF")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("copy_job: allocate: NRT_UNINITIALIZED"),
        "{err}"
    );
}

#[test]
#[cfg_attr(miri, ignore = "runs gcc and a C program; Miri cannot run processes")]
fn headers_compile_as_c_and_cxx_and_name_every_status() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nrt-c-status");
    std::fs::create_dir_all(&dir).unwrap();
    // Every value of libnrt's NRT_STATUS, by name: the enum's values and
    // nrt_get_status_as_str's names must agree with the public header.
    let statuses: &[(&str, i32)] = &[
        ("NRT_SUCCESS", 0),
        ("NRT_FAILURE", 1),
        ("NRT_INVALID", 2),
        ("NRT_INVALID_HANDLE", 3),
        ("NRT_RESOURCE", 4),
        ("NRT_TIMEOUT", 5),
        ("NRT_HW_ERROR", 6),
        ("NRT_QUEUE_FULL", 7),
        ("NRT_LOAD_NOT_ENOUGH_NC", 9),
        ("NRT_UNSUPPORTED_NEFF_VERSION", 10),
        ("NRT_FAIL_HOST_MEM_ALLOC", 11),
        ("NRT_UNINITIALIZED", 13),
        ("NRT_CLOSED", 14),
        ("NRT_QUEUE_EMPTY", 15),
        ("NRT_EXEC_UNIT_UNRECOVERABLE", 101),
        ("NRT_EXEC_BAD_INPUT", 1002),
        ("NRT_EXEC_COMPLETED_WITH_NUM_ERR", 1003),
        ("NRT_EXEC_COMPLETED_WITH_ERR", 1004),
        ("NRT_EXEC_NC_BUSY", 1005),
        ("NRT_EXEC_OOB", 1006),
        ("NRT_COLL_PENDING", 1100),
        ("NRT_EXEC_HW_ERR_COLLECTIVES", 1200),
        ("NRT_EXEC_HW_ERR_HBM_UE", 1201),
        ("NRT_EXEC_HW_ERR_NC_UE", 1202),
        ("NRT_EXEC_HW_ERR_DMA_ABORT", 1203),
        ("NRT_EXEC_SW_NQ_OVERFLOW", 1204),
        ("NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE", 1205),
        ("NRT_NETWORK_PROXY_FAILURE", 1206),
    ];
    let mut src = String::from(
        "#include <stdio.h>\n#include <string.h>\n#include <nrt/nrt.h>\n#include <nrt/nrt_status.h>\n\
         #include <tdrv/job.h>\nint main(void)\n{\n\tint bad = 0;\n",
    );
    for (name, value) in statuses {
        src.push_str(&format!(
            "\tif ({name} != {value} || strcmp(nrt_get_status_as_str({name}), \"{name}\")) \
             {{ printf(\"%s\\n\", \"{name}\"); bad = 1; }}\n"
        ));
    }
    src.push_str(
        "\tif (strcmp(nrt_get_status_as_str((NRT_STATUS)8), \"UNKNOWN STATUS\")) bad = 1;\n\
         \treturn bad;\n}\n",
    );
    let file = dir.join("status.c");
    std::fs::write(&file, &src).unwrap();
    for (cxx, name) in [(false, "status_c"), (true, "status_cxx")] {
        let exe = build_against_headers(&file, name, cxx);
        let out = run(&mut Command::new(&exe));
        assert!(
            out.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

#[test]
#[cfg_attr(miri, ignore = "runs gcc and a C program; Miri cannot run processes")]
fn c_program_dlopens_libnrt_virtual_placement() {
    let lib = libnrt();
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nrt-c");
    std::fs::create_dir_all(&out_dir).unwrap();
    let exe = out_dir.join("nrt_dlopen");
    run(Command::new("gcc")
        .args(["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(crate_dir.join("include"))
        .arg("-o")
        .arg(&exe)
        .arg(crate_dir.join("tests/c/nrt_dlopen.c"))
        .arg("-ldl"));
    // Found by SONAME through the loader's search path.
    let link = out_dir.join("libnrt.so.1");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&lib, &link).unwrap();

    for placement in ["virtual", "host"] {
        let out = run(Command::new(&exe)
            .arg(placement)
            .env("LD_LIBRARY_PATH", &out_dir)
            .env("NEURON_RT_LOG_LEVEL", "OFF"));
        let tap = String::from_utf8_lossy(&out.stdout);
        assert!(tap.starts_with("TAP version 13\n1..28\n"), "{tap}");
        assert!(!tap.contains("not ok"), "{tap}");
        assert_eq!(
            tap.lines().filter(|l| l.starts_with("ok ")).count(),
            28,
            "{tap}"
        );
    }
}
