use super::*;
use std::cell::RefCell;
use std::mem::{align_of, offset_of, size_of};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Barrier};

use AccessorKind::{BufferedReader as R, BufferedWriter as W, Unbuffered as U};

thread_local! {
    static CAPTURED: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// A sink that keeps the warnings of the thread that raised them, so tests
/// running in parallel each see their own.
fn capture(msg: &str) {
    CAPTURED.with(|c| c.borrow_mut().push(msg.to_owned()));
}

fn take_captured() -> Vec<String> {
    CAPTURED.with(|c| std::mem::take(&mut *c.borrow_mut()))
}

#[test]
fn layout_matches_the_seed() {
    assert_eq!(size_of::<CoherencyEnforcer>(), 16);
    assert_eq!(align_of::<CoherencyEnforcer>(), 4);
    assert_eq!(offset_of!(CoherencyEnforcer, buffered_readers), 0);
    assert_eq!(offset_of!(CoherencyEnforcer, buffered_writers), 4);
    assert_eq!(offset_of!(CoherencyEnforcer, unbuffered_accessors), 8);
    assert_eq!(offset_of!(CoherencyEnforcer, policy), 12);
    assert_eq!(size_of::<TensorBase32>(), 20);
    assert_eq!(offset_of!(TensorBase32, coherency_enforcer), 4);
    assert_eq!(Policy::COHERENT as u32, 0);
    assert_eq!(Policy::INCOHERENT_VERBOSE as u32, 1);
    assert_eq!(Policy::INCOHERENT_QUIET as u32, 2);
}

#[test]
fn default_is_all_zero_and_coherent() {
    let e = CoherencyEnforcer::default();
    assert_eq!(e.snapshot(), RawCoherencyEnforcer::default());
    assert_eq!(e.policy(), Policy::Coherent);
    let t = TensorBase32::default();
    assert_eq!(
        t.coherency_enforcer.snapshot(),
        RawCoherencyEnforcer::default()
    );
}

/// The bytes of a live enforcer are the seed's little-endian struct, so a
/// foreign op reading `tensor + 4` sees the same counts.
#[test]
fn bytes_are_the_seed_struct() {
    let t = TensorBase32 {
        impl_handle: 0xdead_beef,
        coherency_enforcer: CoherencyEnforcer::with_policy(Policy::IncoherentQuiet),
    };
    let e = &t.coherency_enforcer;
    let _r1 = e.slot(R).unwrap();
    let _r2 = e.slot(R).unwrap();
    let _w = e.slot(W).unwrap();
    let _u = e.slot(U).unwrap();
    // SAFETY: TensorBase32 is repr(C), 20 bytes, without padding (asserted
    // at compile time), so all its bytes are initialised.
    let bytes: [u8; 20] = unsafe { std::mem::transmute_copy(&t) };
    let word = |i: usize| u32::from_ne_bytes(bytes[i..i + 4].try_into().unwrap());
    assert_eq!(word(0), 0xdead_beef);
    assert_eq!(word(4), 2, "buffered_readers at +4");
    assert_eq!(word(8), 1, "buffered_writers at +8");
    assert_eq!(word(12), 1, "unbuffered_accessors at +12");
    assert_eq!(word(16), 2, "policy at +16");
}

#[test]
fn raw_round_trip() {
    let raw = RawCoherencyEnforcer {
        buffered_readers: 3,
        buffered_writers: 0,
        unbuffered_accessors: 0,
        policy: 1,
    };
    let e = CoherencyEnforcer::from_raw(raw);
    assert_eq!(e.snapshot(), raw);
    assert_eq!(e.policy(), Policy::IncoherentVerbose);
    // An unknown value fails safe.
    let odd = CoherencyEnforcer::from_raw(RawCoherencyEnforcer { policy: 7, ..raw });
    assert_eq!(odd.policy(), Policy::Coherent);
}

/// The seed's matrix: only reader+reader and unbuffered+unbuffered mix.
fn coherent(open: AccessorKind, new: AccessorKind) -> bool {
    matches!((open, new), (R, R) | (U, U))
}

/// Every (open, requested) pair under every policy: what the acquire
/// returns, what the counters become, and what is logged.
#[test]
fn full_matrix_under_every_policy() {
    for policy in Policy::ALL {
        for open in AccessorKind::ALL {
            for new in AccessorKind::ALL {
                let what = format!("{policy:?}: open {open}, then {new}");
                let e = CoherencyEnforcer::with_policy(policy);
                let first = e.slot(open).unwrap();
                assert_eq!(first.admission(), Admission::Coherent, "{what}");
                take_captured();
                set_warning_sink(Some(capture));
                let second = e.slot(new);
                let logged = take_captured();
                let before = e.counts();
                match (coherent(open, new), policy) {
                    (true, _) => {
                        let s = second.expect(&what);
                        assert_eq!(s.admission(), Admission::Coherent, "{what}");
                        assert!(logged.is_empty(), "{what}: {logged:?}");
                        assert_eq!(before.get(new), 2, "{what}");
                    }
                    (false, Policy::Coherent) => {
                        let err = second.expect_err(&what);
                        assert_eq!(
                            err,
                            CoherenceError::Incoherent {
                                requested: new,
                                open: {
                                    let mut c = OpenCounts::default();
                                    match open {
                                        R => c.buffered_readers = 1,
                                        W => c.buffered_writers = 1,
                                        U => c.unbuffered_accessors = 1,
                                    }
                                    c
                                },
                            },
                            "{what}"
                        );
                        assert!(err.to_string().contains("COHERENT"), "{err}");
                        assert!(logged.is_empty(), "{what}: {logged:?}");
                        // A refused acquire changes nothing.
                        assert_eq!(before.get(new), i32::from(open == new), "{what}");
                    }
                    (false, Policy::IncoherentVerbose) => {
                        let s = second.expect(&what);
                        assert_eq!(s.admission(), Admission::Incoherent, "{what}");
                        assert_eq!(logged.len(), 1, "{what}: {logged:?}");
                        let msg = &logged[0];
                        assert!(msg.contains("may cause incoherent behaviour"), "{msg}");
                        let count = |k: AccessorKind| i32::from(open == k);
                        for (k, name) in [
                            (R, "buffered reader(s)"),
                            (W, "buffered writer(s)"),
                            (U, "unbuffered accessor(s)"),
                        ] {
                            let part = format!("{} {name}", count(k));
                            assert!(msg.contains(&part), "{what}: {msg} lacks {part}");
                        }
                        assert_eq!(before.get(new), 1 + i32::from(open == new), "{what}");
                    }
                    (false, Policy::IncoherentQuiet) => {
                        let s = second.expect(&what);
                        assert_eq!(s.admission(), Admission::Incoherent, "{what}");
                        assert!(logged.is_empty(), "{what}: {logged:?}");
                        assert_eq!(before.get(new), 1 + i32::from(open == new), "{what}");
                    }
                }
                drop(first);
                assert_eq!(e.counts(), OpenCounts::default(), "{what}");
            }
        }
    }
}

#[test]
fn matrix_helpers_agree() {
    for open in AccessorKind::ALL {
        for new in AccessorKind::ALL {
            assert_eq!(new.compatible_with(open), coherent(open, new));
            let mut c = OpenCounts::default();
            match open {
                R => c.buffered_readers = 5,
                W => c.buffered_writers = 1,
                U => c.unbuffered_accessors = 5,
            }
            assert_eq!(c.conflicts_with(new), !coherent(open, new), "{open} {new}");
        }
        assert!(!OpenCounts::default().conflicts_with(open));
    }
}

#[test]
fn many_readers_and_many_unbuffered() {
    let e = CoherencyEnforcer::new();
    let readers: Vec<_> = (0..10).map(|_| e.slot(R).unwrap()).collect();
    assert_eq!(e.counts().buffered_readers, 10);
    assert!(e.slot(U).is_err());
    assert!(e.slot(W).is_err());
    drop(readers);
    let unbuffered: Vec<_> = (0..10).map(|_| e.slot(U).unwrap()).collect();
    assert_eq!(e.counts().unbuffered_accessors, 10);
    assert!(e.slot(R).is_err());
    drop(unbuffered);
    let w = e.slot(W).unwrap();
    assert!(e.slot(W).is_err(), "a writer excludes other writers");
    drop(w);
    assert_eq!(e.counts(), OpenCounts::default());
}

#[test]
fn release_below_zero_is_an_error_and_never_wraps() {
    let e = CoherencyEnforcer::new();
    for kind in AccessorKind::ALL {
        assert_eq!(e.release(kind), Err(CoherenceError::Underflow(kind)));
        assert_eq!(e.counts().get(kind), 0);
    }
    assert_eq!(
        e.release_buffered_reader(),
        Err(CoherenceError::Underflow(R))
    );
    assert_eq!(
        e.release_buffered_writer(),
        Err(CoherenceError::Underflow(W))
    );
    assert_eq!(
        e.release_unbuffered_accessor(),
        Err(CoherenceError::Underflow(U))
    );
    e.acquire_buffered_reader().unwrap();
    e.release_buffered_reader().unwrap();
    assert!(e.release_buffered_reader().is_err());
    assert_eq!(e.snapshot(), RawCoherencyEnforcer::default());
}

#[test]
fn acquire_at_i32_max_is_refused() {
    let e = CoherencyEnforcer::from_raw(RawCoherencyEnforcer {
        unbuffered_accessors: i32::MAX,
        ..Default::default()
    });
    assert_eq!(e.acquire(U), Err(CoherenceError::Overflow(U)));
    assert_eq!(e.counts().unbuffered_accessors, i32::MAX);
}

#[test]
fn policy_through_a_shared_reference() {
    let e = CoherencyEnforcer::new();
    let shared: &CoherencyEnforcer = &e;
    let _r = shared.slot(R).unwrap();
    assert!(shared.slot(W).is_err());
    shared.set_policy(Policy::IncoherentQuiet);
    assert_eq!(shared.policy(), Policy::IncoherentQuiet);
    let _w = shared.slot(W).unwrap();
    shared.set_policy(Policy::Coherent);
    assert!(shared.slot(R).is_err());
    assert_eq!(e.snapshot().policy, 0);
}

/// Many threads open and close random accessors on one enforcer. Each
/// thread, while it holds a slot obtained as coherent, records it in a
/// shadow tally; if two incompatible slots were ever open at once, some
/// thread sees the other's tally. The counters end at zero.
#[test]
fn stress_concurrent_acquires_never_mix() {
    const THREADS: usize = if cfg!(miri) { 3 } else { 8 };
    const ROUNDS: usize = if cfg!(miri) { 100 } else { 20_000 };
    let e = Arc::new(CoherencyEnforcer::new());
    // Shadow tallies of slots actually held, per kind.
    let held: Arc<[AtomicI32; 3]> = Arc::new([const { AtomicI32::new(0) }; 3]);
    let granted: Arc<[AtomicUsize; 3]> = Arc::new([const { AtomicUsize::new(0) }; 3]);
    let violation = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(THREADS));
    let idx = |k: AccessorKind| match k {
        R => 0,
        W => 1,
        U => 2,
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (e, held, granted, violation, start) = (
                e.clone(),
                held.clone(),
                granted.clone(),
                violation.clone(),
                start.clone(),
            );
            std::thread::spawn(move || {
                let mut seed = 0x9e37_79b9_7f4a_7c15_u64 ^ (t as u64 + 1);
                start.wait();
                for _ in 0..ROUNDS {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let kind = AccessorKind::ALL[(seed % 3) as usize];
                    let Ok(slot) = e.slot(kind) else { continue };
                    assert_eq!(slot.admission(), Admission::Coherent);
                    held[idx(kind)].fetch_add(1, Ordering::SeqCst);
                    granted[idx(kind)].fetch_add(1, Ordering::Relaxed);
                    let others = AccessorKind::ALL
                        .iter()
                        .filter(|&&k| !kind.compatible_with(k))
                        .map(|&k| {
                            let n = held[idx(k)].load(Ordering::SeqCst);
                            if k == kind {
                                n - 1
                            } else {
                                n
                            }
                        })
                        .sum::<i32>();
                    if others != 0 {
                        violation.store(true, Ordering::SeqCst);
                    }
                    if seed & 8 != 0 {
                        std::thread::yield_now();
                    }
                    held[idx(kind)].fetch_sub(1, Ordering::SeqCst);
                    drop(slot);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert!(
        !violation.load(Ordering::SeqCst),
        "two incompatible accessors were open at once"
    );
    assert_eq!(e.counts(), OpenCounts::default());
    // Every kind got through, so the test exercised real contention.
    for k in AccessorKind::ALL {
        assert!(
            granted[idx(k)].load(Ordering::Relaxed) > 0,
            "{k} never granted"
        );
    }
}

/// Under QUIET everything is granted; the counters must still be exact
/// after millions of racing increments and decrements.
#[test]
fn stress_counts_stay_exact() {
    const THREADS: usize = if cfg!(miri) { 3 } else { 8 };
    const ROUNDS: usize = if cfg!(miri) { 100 } else { 20_000 };
    let e = Arc::new(CoherencyEnforcer::with_policy(Policy::IncoherentQuiet));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let e = e.clone();
            std::thread::spawn(move || {
                for i in 0..ROUNDS {
                    let kind = AccessorKind::ALL[(i + t) % 3];
                    e.acquire(kind).unwrap();
                    if i % 2 == 0 {
                        e.release(kind).unwrap();
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let c = e.counts();
    let total = c.buffered_readers + c.buffered_writers + c.unbuffered_accessors;
    assert_eq!(total as usize, THREADS * ROUNDS / 2);
    // Drain concurrently, then one more release per kind must fail.
    let drains: Vec<_> = AccessorKind::ALL
        .into_iter()
        .map(|k| {
            let e = e.clone();
            std::thread::spawn(move || while e.release(k).is_ok() {})
        })
        .collect();
    for d in drains {
        d.join().unwrap();
    }
    assert_eq!(e.counts(), OpenCounts::default());
}

/// The seed's `TensorBase` layout is a 32-bit one: this builds the crate
/// for i686, where the `target_pointer_width = "32"` compile-time asserts in
/// `coherency.rs` are evaluated (a failed assert fails the build). The
/// target is installed by `scripts/setup`.
#[test]
#[cfg_attr(miri, ignore = "spawns cargo; Miri cannot run processes")]
fn layout_builds_for_a_32_bit_target() {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    const TARGET: &str = "i686-unknown-linux-gnu";
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    // A target directory of its own: the outer `cargo test` may hold the
    // lock of the usual one while tests run.
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
        .join("layout-32bit");
    let cargo = std::env::var_os("CARGO")
        .or_else(|| option_env!("CARGO").map(Into::into))
        .unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "check", "--quiet", "--lib", "-p", "tdrv", "--target", TARGET,
        ])
        .arg("--manifest-path")
        .arg(&manifest)
        .env("CARGO_TARGET_DIR", &target_dir)
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET")
        .output()
        .expect("cannot run cargo");
    assert!(
        out.status.success(),
        "building tdrv for {TARGET} failed (is the target installed? scripts/setup adds it):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
