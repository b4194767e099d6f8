//! The kselftest-style runner `run_tests` (installed next to the programs
//! by `make install-tests`), run the way a user runs it on their machine:
//! its TAP output, its exit codes, which programs it picks, that the
//! edu-only programs skip with exit 4 on other devices, that bigbuf is
//! skipped below its channel size, and how it reports a failing, a
//! skipping and a hanging program (fake programs in a scratch directory).
//!
//! usage: ksft_runner [/dev/tdrvN]   (run_tests is looked up next to this
//! program)

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use tdrv_guest_tests::{expect_eq, open_device_or_skip, raw::Dev, Tap};
use tdrv_uapi::*;

type R = Result<(), String>;

/// Runs `run_tests` in `dir` with `args`: (exit code, stdout).
fn run_tests(dir: &Path, args: &[&str]) -> Result<(i32, String), String> {
    let out = Command::new(dir.join("run_tests"))
        .args(args)
        .output()
        .map_err(|e| format!("run_tests {args:?}: {e}"))?;
    let code = out.status.code().ok_or("run_tests was killed")?;
    Ok((code, String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// The runner's own result lines (`ok`/`not ok`, not indented).
fn results(out: &str) -> Vec<&str> {
    out.lines()
        .filter(|l| l.starts_with("ok ") || l.starts_with("not ok "))
        .collect()
}

/// The first software device node, if any.
fn soft_device() -> Option<String> {
    let mut nodes: Vec<String> = std::fs::read_dir("/dev")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            n.strip_prefix("tdrv")
                .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(|n| format!("/dev/{n}"))
        .collect();
    nodes.sort();
    nodes.into_iter().find(|n| {
        Dev::open(n)
            .and_then(|d| d.version())
            .is_ok_and(|v| v.device_kind == TDRV_DEVICE_SOFT)
    })
}

fn write_script(dir: &Path, name: &str, body: &str) -> R {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).map_err(|e| e.to_string())?;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).map_err(|e| e.to_string())
}

fn main() {
    let (dev, path, _) = open_device_or_skip("/dev/tdrv0", None);
    let name = path.trim_start_matches("/dev/").to_string();
    let here: PathBuf = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("."));
    let limit = dev.channel_info(0).map(|c| c.limit_bytes).unwrap_or(0);
    drop(dev);

    let mut t = Tap::new(6);
    t.run(
        "-l lists the test programs and nothing else, edu and sim last",
        || {
            let (code, out) = run_tests(&here, &["-l"])?;
            expect_eq("exit code", code, 0)?;
            let listed: Vec<&str> = out.lines().collect();
            for want in ["tdrv:abi", "tdrv:smi", "tdrv:ksft_runner", "tdrv:bigbuf"] {
                if !listed.contains(&want) {
                    return Err(format!("{want} not listed:\n{out}"));
                }
            }
            for not in [
                "tdrv:tdrv-smi",
                "tdrv:tdrv-demo",
                "tdrv:bench",
                "tdrv:run-all",
                "tdrv:sim_raw",
            ] {
                if listed.contains(&not) {
                    return Err(format!("{not} listed:\n{out}"));
                }
            }
            if listed.iter().any(|l| l.contains(".so")) {
                return Err(format!("a library is listed:\n{out}"));
            }
            // `unbind_stress`, `edu` and `sim` unbind their device: they
            // must come after everything else.
            expect_eq(
                "last four",
                &listed[listed.len().saturating_sub(4)..],
                &[
                    "tdrv:watchdog",
                    "tdrv:unbind_stress",
                    "tdrv:edu",
                    "tdrv:sim",
                ][..],
            )
        },
    );

    t.run(
        "a real program passes, bigbuf skips below its channel size",
        || {
            let (code, out) = run_tests(&here, &["-t", "abi", "-t", "bigbuf", "-d", &path])?;
            expect_eq("exit code", code, 0)?;
            expect_eq(
                "header",
                out.lines().take(2).collect::<Vec<_>>(),
                vec!["TAP version 13", "1..2"],
            )?;
            let r = results(&out);
            expect_eq(
                "first result",
                r.first().copied(),
                Some(format!("ok 1 selftests: tdrv: abi {name}").as_str()),
            )?;
            let big = r.get(1).copied().unwrap_or("");
            let want_skip = limit < 512 << 20;
            if big.starts_with(&format!("ok 2 selftests: tdrv: bigbuf {name}"))
                && big.contains("# SKIP") == want_skip
            {
                Ok(())
            } else {
                Err(format!("bigbuf with a {limit}-byte channel: {big:?}"))
            }?;
            // The program's own TAP is nested, indented by "# ".
            if !out.lines().any(|l| l.starts_with("# TAP version 13")) {
                return Err(format!("abi's TAP is not nested:\n{out}"));
            }
            Ok(())
        },
    );

    // The check needs a software device, not necessarily the one under test
    // (running edu on the edu device would unbind it mid-suite).
    match soft_device() {
        Some(soft) => t.run(
            "edu and watchdog skip with exit 4 on a software device",
            || {
                let soft_name = soft.trim_start_matches("/dev/");
                let (code, out) = run_tests(&here, &["-t", "edu", "-t", "watchdog", "-d", &soft])?;
                expect_eq("exit code", code, 0)?;
                expect_eq(
                    "results",
                    results(&out),
                    vec![
                        format!("ok 1 selftests: tdrv: watchdog {soft_name} # SKIP").as_str(),
                        format!("ok 2 selftests: tdrv: edu {soft_name} # SKIP").as_str(),
                    ],
                )
            },
        ),
        None => t.skip(
            "edu and watchdog skip with exit 4 on a software device",
            "no software device (module loaded with soft_devices=0)",
        ),
    }

    t.run(
        "no accessible device: a skipped empty plan (1..0) and exit 4",
        || {
            let (code, out) = run_tests(&here, &["-d", "/dev/tdrv-none"])?;
            expect_eq("exit code", code, 4)?;
            if !out.lines().any(|l| l.starts_with("1..0 # SKIP")) {
                return Err(format!("no skipped plan:\n{out}"));
            }
            let (code, _) = run_tests(&here, &["-t", "no-such-program"])?;
            expect_eq("unknown program: exit code", code, 2)
        },
    );

    // Fake programs: the runner's verdicts do not depend on tdrv.
    let scratch = std::env::temp_dir().join(format!("ksft_runner.{}", std::process::id()));
    let made = (|| -> R {
        std::fs::create_dir_all(&scratch).map_err(|e| e.to_string())?;
        std::fs::copy(here.join("run_tests"), scratch.join("run_tests"))
            .map_err(|e| e.to_string())?;
        write_script(&scratch, "a_fails", "echo 'not ok 1 broken'; exit 1")?;
        write_script(&scratch, "b_skips", "echo '1..0 # SKIP absent'; exit 4")?;
        write_script(&scratch, "c_passes", "echo 'ok 1 fine'; exit 0")?;
        write_script(&scratch, "d_hangs", "exec sleep 30")
    })();
    t.run(
        "a failing program is not ok with its exit code; the run exits 1",
        || {
            made.clone()?;
            let (code, out) = run_tests(
                &scratch,
                &[
                    "-t", "a_fails", "-t", "b_skips", "-t", "c_passes", "-d", &path,
                ],
            )?;
            expect_eq("exit code", code, 1)?;
            expect_eq(
                "results",
                results(&out),
                vec![
                    format!("not ok 1 selftests: tdrv: a_fails {name} # exit=1").as_str(),
                    format!("ok 2 selftests: tdrv: b_skips {name} # SKIP").as_str(),
                    format!("ok 3 selftests: tdrv: c_passes {name}").as_str(),
                ],
            )?;
            if !out.lines().any(|l| l == "# not ok 1 broken") {
                return Err(format!("the program's output is not nested:\n{out}"));
            }
            Ok(())
        },
    );
    t.run("a program past -T is not ok, marked TIMEOUT", || {
        made.clone()?;
        let (code, out) = run_tests(&scratch, &["-t", "d_hangs", "-T", "1", "-d", &path])?;
        expect_eq("exit code", code, 1)?;
        expect_eq(
            "results",
            results(&out),
            vec![format!("not ok 1 selftests: tdrv: d_hangs {name} # TIMEOUT 1 seconds").as_str()],
        )
    });
    let _ = std::fs::remove_dir_all(&scratch);
    t.finish();
}
