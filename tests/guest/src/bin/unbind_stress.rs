//! Unbind at a random moment: two fuzzer processes (`fuzz`, each with its
//! threads and SIGKILLed children) hammer a PCI device, the device is
//! unbound under them after a seeded pause, the fuzzers are killed, and
//! the device is bound again; each round then checks that the device
//! works (ALLOC, COPY_IN, a job, COPY_OUT, FREE). Unlike the edu and sim
//! programs' unbind tests, which unbind at chosen points, this one lands
//! wherever the fuzzers happen to be. Both fuzzers must still be running
//! at the unbind, and must end by the SIGKILL (or the SIGBUS a mapping of
//! the unbound device gets), never on their own or by a crash, and their
//! output (kept, shown when a round fails) must hold no failed check. The
//! guest run's dmesg, kmemleak and
//! rmmod checks cover what the kernel must not do meanwhile.
//!
//! usage: unbind_stress /dev/tdrvN [ROUNDS [SEED]]  (edu or sim; other
//! kinds are skipped). Defaults: 3 rounds, seed 1. It unbinds and rebinds
//! the device.

use std::{
    fs,
    os::unix::process::ExitStatusExt,
    process::{Child, Command, ExitStatus, Stdio},
    thread,
    time::Duration,
};

use tdrv_guest_tests::{
    bound_pci_address, desc, device_nodes, expect_eq, ok, open_device_or_skip, raw::Dev, skip_all,
    Rng, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

/// The fuzzer program, next to this one.
const FUZZ: &str = "/tests/fuzz";

fn driver_dir(kind: u32) -> &'static str {
    if kind == TDRV_DEVICE_SIM {
        "/sys/bus/pci/drivers/tdrv-sim"
    } else {
        "/sys/bus/pci/drivers/tdrv"
    }
}

/// A running fuzzer and the file its output goes to.
struct Fuzzer {
    child: Child,
    out: String,
}

/// Starts a fuzzer on `node` with `seed`, its output (stdout and stderr)
/// in a file of its own.
fn fuzzer(node: &str, seed: u64) -> Result<Fuzzer, String> {
    let out = format!("/tmp/unbind_stress.fuzz.{seed:x}.out");
    let file = fs::File::create(&out).map_err(|e| format!("{out}: {e}"))?;
    let err = file.try_clone().map_err(|e| format!("{out}: {e}"))?;
    let child = Command::new(FUZZ)
        .args([node, "1000000", &seed.to_string()])
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("{FUZZ}: {e}"))?;
    Ok(Fuzzer { child, out })
}

/// How a fuzzer may end: by our SIGKILL, or by the SIGBUS a touch of a
/// mapping of the unbound device gets (as documented for unbind). It
/// cannot reach its million calls in the moment between the unbind and
/// the SIGKILL, so an exit of its own (a failed final check, a panic's
/// 101) is a failure, and so is a SIGSEGV or an abort: the driver broke
/// it. Its output must hold no failed check or bail-out either. A failure
/// shows the output's tail.
fn ended_well(status: ExitStatus, out: &str) -> R {
    let text = fs::read_to_string(out).unwrap_or_else(|e| format!("(no output: {out}: {e})"));
    let _ = fs::remove_file(out);
    let bad_line = text
        .lines()
        .find(|l| l.starts_with("not ok") || l.starts_with("Bail out!"));
    let bad_end = !matches!(status.signal(), Some(libc::SIGKILL | libc::SIGBUS));
    if !bad_end && bad_line.is_none() {
        return Ok(());
    }
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(20)..].join("\n");
    Err(format!(
        "a fuzzer ended with {status}{}; its output's tail:\n{tail}",
        bad_line
            .map(|l| format!(", after \"{l}\""))
            .unwrap_or_default()
    ))
}

/// Fails if a fuzzer has already ended: the unbind is meant to land while
/// both are at work.
fn still_running(fuzzers: &mut [Fuzzer]) -> R {
    for f in fuzzers {
        if let Some(status) = f.child.try_wait().map_err(|e| format!("wait: {e}"))? {
            return Err(format!("a fuzzer ended before the unbind: {status}"));
        }
    }
    Ok(())
}

/// The device of `kind` works: a buffer round trip through a job.
fn works(kind: u32) -> R {
    let node = device_nodes(kind)
        .into_iter()
        .next()
        .ok_or("no device node after rebind")?;
    let dev = ok("open", Dev::open(&node))?;
    let data: Vec<u8> = (0..20_000u32).map(|i| (i * 13 + 5) as u8).collect();
    let a = ok("alloc", dev.alloc(data.len() as u64, 0))?;
    let b = ok("alloc", dev.alloc(data.len() as u64, 0))?;
    ok("copy_in", dev.copy_in(a.handle, 0, &data))?;
    let id = ok(
        "submit",
        dev.submit(&[desc(a.handle, 0, b.handle, 0, data.len() as u64)]),
    )?;
    expect_eq(
        "job",
        ok("job_wait", dev.job_wait(id, -1))?,
        (TDRV_JOB_DONE, 0),
    )?;
    let mut out = vec![0u8; data.len()];
    ok("copy_out", dev.copy_out(b.handle, 0, &mut out))?;
    expect_eq("bytes through the job", out == data, true)?;
    ok("free", dev.free(a.handle))?;
    ok("free", dev.free(b.handle))
}

fn round(node: &str, kind: u32, rng: &mut Rng) -> R {
    let dir = driver_dir(kind);
    let pci = bound_pci_address(dir)?;
    let mut fuzzers = vec![fuzzer(node, rng.next_u64())?, fuzzer(node, rng.next_u64())?];
    // A seeded moment for the unbind (not a threshold: nothing is timed).
    thread::sleep(Duration::from_millis(200 + rng.next_u64() % 1800));
    let running = still_running(&mut fuzzers);
    let unbound = fs::write(format!("{dir}/unbind"), &pci);
    // Calls on the unbound device fail at once; let them run a moment.
    thread::sleep(Duration::from_millis(300));
    let mut ends = Vec::new();
    for f in &mut fuzzers {
        // Fails only if the fuzzer has already been reaped, which wait()
        // below then reports.
        let _ = f.child.kill();
        ends.push((
            f.child.wait().map_err(|e| format!("wait: {e}")),
            f.out.clone(),
        ));
    }
    unbound.map_err(|e| format!("unbind {pci}: {e}"))?;
    fs::write(format!("{dir}/bind"), &pci).map_err(|e| format!("bind {pci}: {e}"))?;
    running?;
    for (end, out) in ends {
        ended_well(end?, &out)?;
    }
    // The bind probes synchronously, and devtmpfs creates the node before
    // the probe returns: the device is there now.
    works(kind)
}

fn main() {
    let (dev, node, version) = open_device_or_skip("/dev/tdrv0", None);
    let kind = version.device_kind;
    if kind != TDRV_DEVICE_EDU && kind != TDRV_DEVICE_SIM {
        skip_all("not a PCI device (edu or sim)");
    }
    drop(dev);
    if fs::metadata(FUZZ).is_err() {
        skip_all("no fuzz program next to this one");
    }
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(3);
    let seed: u64 = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(1);
    let mut rng = Rng::new(seed);
    let mut t = Tap::new(rounds);
    t.note(format!(
        "device {node}: {rounds} rounds, seed {seed} (replay: unbind_stress {node} {rounds} {seed})"
    ));
    for i in 1..=rounds {
        t.run(
            &format!("round {i}: unbind under two fuzzers, rebind, the device works"),
            || round(&node, kind, &mut rng),
        );
    }
    t.finish();
}
