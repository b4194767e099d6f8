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
    ];
    want.sort();
    assert_eq!(syms, want);
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
