use super::stream::order_probe::{self, Event};
use super::*;
use crate::coherency::{AccessorKind, Admission, CoherenceError, OpenCounts};
use crate::compat::TensorCompat;
use crate::ops::TensorOps;
use crate::Error;

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Barrier};

fn u32_tensor(n: usize) -> Tensor {
    let t = Tensor::allocate_host(n * 4, Some("acc")).unwrap();
    let bytes: Vec<u8> = (0..n as u32)
        .flat_map(|i| (i * 3 + 1).to_le_bytes())
        .collect();
    t.write(0, &bytes).unwrap();
    t
}

fn u32s(t: &Tensor) -> Vec<u32> {
    t.to_vec()
        .unwrap()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn counts(t: &Tensor) -> OpenCounts {
    t.coherency_enforcer().counts()
}

// ---------------------------------------------------------------- indexed

#[test]
fn indexed_reads_and_writes_row_major() {
    let mut t = u32_tensor(24);
    {
        let a = t.accessor::<u32, 3>([2, 3, 4]).unwrap();
        assert_eq!(a.strides(), &[12, 4, 1]);
        assert_eq!(a.numel(), 24);
        assert_eq!(a.get([1, 2, 3]).unwrap(), 23 * 3 + 1);
        assert_eq!(a.get([0, 1, 0]).unwrap(), 4 * 3 + 1);
        assert_eq!(counts(&t).unbuffered_accessors, 1);
    }
    assert_eq!(counts(&t), OpenCounts::default());
    {
        let mut a = t.accessor_mut::<u32, 2>([4, 6]).unwrap();
        for i in 0..4 {
            for j in 0..6 {
                a.set([i, j], (i * 100 + j) as u32).unwrap();
            }
        }
        assert_eq!(a.get([3, 5]).unwrap(), 305);
    }
    let v = u32s(&t);
    assert_eq!(v[6 * 2 + 1], 201);
    assert_eq!(v[23], 305);
}

#[test]
fn indexed_honours_strides_and_select() {
    let mut t = u32_tensor(12);
    // A transposed 4x3 view of the 3x4 row-major data, and a broadcast.
    let a = TensorAccessor::<u32, 2>::with_strides(&t, [4, 3], [1, 4]).unwrap();
    assert_eq!(a.get([1, 2]).unwrap(), (2 * 4 + 1) * 3 + 1);
    let row = a.select(3).unwrap();
    assert_eq!(row.rank(), 1);
    assert_eq!(row.get(&[1]).unwrap(), (4 + 3) * 3 + 1);
    assert_eq!(row.select(2).unwrap().value().unwrap(), (8 + 3) * 3 + 1);
    assert!(row.select(3).is_err());
    assert!(row.get(&[0, 0]).is_err());
    let b = TensorAccessor::<u32, 2>::with_strides(&t, [5, 12], [0, 1]).unwrap();
    assert_eq!(b.get([4, 11]).unwrap(), b.get([0, 11]).unwrap());
    assert_eq!(counts(&t).unbuffered_accessors, 2);
    drop((a, b));
    let mut m = t.accessor_mut::<u32, 2>([3, 4]).unwrap();
    {
        let mut r = m.select_mut(2).unwrap();
        r.set(&[3], 7).unwrap();
        r.select_mut(0).unwrap().set_value(8).unwrap();
    }
    assert_eq!(m.get([2, 3]).unwrap(), 7);
    assert_eq!(m.get([2, 0]).unwrap(), 8);
}

#[test]
fn indexed_checks_shape_index_alignment_and_kind() {
    let mut t = u32_tensor(12);
    assert!(matches!(
        t.accessor::<u32, 2>([4, 4]),
        Err(crate::Error::Accessor(AccessorError::ShapeOutOfBounds {
            needed: 64,
            len: 48,
            ..
        }))
    ));
    assert!(matches!(
        TensorAccessor::<u32, 1>::with_strides(&t, [2], [usize::MAX]),
        Err(crate::Error::Accessor(
            AccessorError::ShapeOutOfBounds { .. }
        ))
    ));
    assert!(matches!(
        t.accessor::<u8, 2>([usize::MAX, 4]),
        Err(crate::Error::Accessor(
            AccessorError::ShapeOutOfBounds { .. }
        ))
    ));
    // A size of 0 addresses nothing, so any strides fit.
    let empty = TensorAccessor::<u32, 2>::with_strides(&t, [0, 9], [1000, 1000]).unwrap();
    assert!(matches!(
        empty.get([0, 0]),
        Err(crate::Error::Accessor(
            AccessorError::IndexOutOfBounds { .. }
        ))
    ));
    drop(empty);
    let a = t.accessor::<u32, 2>([3, 4]).unwrap();
    assert!(matches!(
        a.get([3, 0]),
        Err(crate::Error::Accessor(
            AccessorError::IndexOutOfBounds { .. }
        ))
    ));
    assert!(a.select(3).is_err());
    drop(a);
    assert!(t
        .accessor_mut::<u32, 1>([12])
        .unwrap()
        .set([12], 0)
        .is_err());
    let odd = t.slice(1, 8, None).unwrap();
    assert!(matches!(
        odd.accessor::<u32, 1>([1]),
        Err(crate::Error::Accessor(AccessorError::Misaligned {
            align: 4,
            ..
        }))
    ));
    assert!(odd.accessor::<u8, 1>([8]).is_ok());
    let fake = Tensor::allocate_fake(64, None).unwrap();
    assert!(matches!(
        fake.accessor::<u8, 1>([1]),
        Err(crate::Error::Accessor(AccessorError::NotAddressable { .. }))
    ));
    assert!(fake.read_stream_accessor::<u8>().is_err());
    assert!(fake.tcm_accessor().is_err());
    let none = Tensor::allocate_empty(None).unwrap();
    assert!(none.accessor::<u8, 0>([]).is_err());
    assert!(none.read_stream_accessor::<u8>().is_err());
    // Nothing leaked a slot.
    assert_eq!(counts(&t), OpenCounts::default());
    assert_eq!(counts(&odd), OpenCounts::default());
}

#[test]
fn rank_zero_accessor_is_the_first_element() {
    let mut t = u32_tensor(2);
    assert_eq!(t.accessor::<u32, 0>([]).unwrap().get([]).unwrap(), 1);
    t.accessor_mut::<u32, 0>([]).unwrap().set([], 42).unwrap();
    assert_eq!(u32s(&t), [42, 4]);
}

// ---------------------------------------------------------------- streams

/// A stream over `n` u32s: 1024 per 4 KiB buffer, so `3 * 1024 + 5` needs
/// four fills, the last one partial.
#[test]
fn read_stream_crosses_4k_boundaries_with_a_partial_last_buffer() {
    let sizes: &[usize] = if cfg!(miri) {
        &[0, 1, 1025] // the interpreter is slow: one boundary crossing
    } else {
        &[0, 1, 1023, 1024, 1025, 2048, 3 * 1024 + 5]
    };
    for &n in sizes {
        let t = u32_tensor(n);
        let mut s = t.read_stream_accessor::<u32>().unwrap();
        assert_eq!(s.len(), n);
        assert_eq!(s.refills(), usize::from(n > 0), "primed in the constructor");
        let mut got = Vec::new();
        while let Some(v) = s.next_element().unwrap() {
            got.push(v);
            // Refills happen exactly when a 4 KiB boundary is crossed.
            assert_eq!(s.refills(), got.len().div_ceil(1024).max(1));
        }
        assert_eq!(got, (0..n as u32).map(|i| i * 3 + 1).collect::<Vec<_>>());
        assert_eq!(s.position(), n);
        assert_eq!(s.next_element().unwrap(), None);
        assert_eq!(s.refills(), n.div_ceil(1024));
    }
}

#[test]
fn read_stream_of_odd_sized_elements() {
    // 3-byte elements: 1365 per buffer (4095 bytes); 10_000 bytes hold
    // 3333 whole elements, the last byte is not an element.
    let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    let t = Tensor::allocate_host(bytes.len(), None).unwrap();
    t.write(0, &bytes).unwrap();
    let s = t.read_stream_accessor::<[u8; 3]>().unwrap();
    assert_eq!(s.len(), 3333);
    let got: Vec<[u8; 3]> = s.collect::<Result<_>>().unwrap();
    let want: Vec<[u8; 3]> = bytes[..9999]
        .chunks_exact(3)
        .map(|c| c.try_into().unwrap())
        .collect();
    assert_eq!(got, want);
    // Elements larger than the buffer, or zero-sized, cannot be staged.
    assert!(matches!(
        t.read_stream_accessor::<[u8; 4097]>(),
        Err(crate::Error::Accessor(AccessorError::BadElement {
            size: 4097,
            ..
        }))
    ));
    assert!(t.read_stream_accessor::<[u8; 0]>().is_err());
}

#[test]
fn read_stream_close_releases_and_stops() {
    let t = u32_tensor(10);
    let mut s = t.read_stream_accessor::<u32>().unwrap();
    assert_eq!(s.admission(), Some(Admission::Coherent));
    assert_eq!(counts(&t).buffered_readers, 1);
    s.close().unwrap();
    assert_eq!(counts(&t).buffered_readers, 0);
    assert!(matches!(
        s.next_element(),
        Err(crate::Error::Accessor(AccessorError::Closed))
    ));
    assert!(s.next().is_none());
    s.close().unwrap();
    drop(s);
    assert_eq!(counts(&t), OpenCounts::default());
}

#[test]
#[cfg_attr(
    miri,
    ignore = "a minute under Miri; its unsafe paths run in a_reader_opened_after_the_writer_sees_all_its_data"
)]
fn write_stream_flushes_at_4k_and_on_close() {
    let n = 2 * 1024 + 300;
    let mut t = Tensor::allocate_host(n * 4, None).unwrap();
    let observer = t.clone();
    let mut w = t.write_stream_accessor::<u32>().unwrap();
    assert_eq!(w.len(), n);
    for i in 0..n as u32 {
        w.write(i ^ 0xA5A5).unwrap();
        // A full buffer is flushed at once.
        assert_eq!(w.flushes(), (i as usize + 1) / 1024);
    }
    assert_eq!(w.buffered(), 300);
    // The two full buffers are in the tensor, the partial one is not yet.
    let before = u32s(&observer);
    assert!((0..2048).all(|i| before[i] == i as u32 ^ 0xA5A5));
    assert!(before[2048..].iter().all(|&v| v == 0));
    assert!(matches!(
        w.write(0),
        Err(crate::Error::Accessor(AccessorError::StreamFull { len })) if len == n
    ));
    w.close().unwrap();
    assert_eq!(w.flushes(), 3);
    assert!(matches!(
        w.write(0),
        Err(crate::Error::Accessor(AccessorError::Closed))
    ));
    drop(w);
    let after = u32s(&observer);
    assert!((0..n).all(|i| after[i] == i as u32 ^ 0xA5A5));
    assert_eq!(counts(&observer), OpenCounts::default());
}

#[test]
fn write_stream_write_all_and_drop_flush() {
    let mut t = Tensor::allocate_host(5000, None).unwrap();
    let observer = t.clone();
    {
        let mut w = t.write_stream_accessor::<u8>().unwrap();
        w.write_all(&[7; 4999]).unwrap();
        assert_eq!(w.flushes(), 1);
        assert_eq!(w.position(), 4999);
    } // dropped without close: the rest is flushed
    let v = observer.to_vec().unwrap();
    assert!(v[..4999].iter().all(|&b| b == 7));
    assert_eq!(v[4999], 0);
}

/// The writer's data reaches the tensor while it still holds the writer
/// slot, and the slot is released only after: on close and on drop.
#[test]
fn write_stream_flushes_before_releasing_its_slot() {
    let mut t = Tensor::allocate_host(4096 + 8, None).unwrap();
    let observer = t.clone();
    order_probe::take();
    {
        let mut w = t.write_stream_accessor::<u32>().unwrap();
        w.write_all(&[1; 1024 + 2]).unwrap();
        w.close().unwrap();
    }
    assert_eq!(
        order_probe::take(),
        [
            Event::Flushed {
                bytes: 4096,
                writers_open: 1
            },
            Event::Flushed {
                bytes: 8,
                writers_open: 1
            },
            Event::Released { writers_open: 0 },
        ]
    );
    {
        let mut w = t.write_stream_accessor::<u32>().unwrap();
        w.write(5).unwrap();
    }
    assert_eq!(
        order_probe::take(),
        [
            Event::Flushed {
                bytes: 4,
                writers_open: 1
            },
            Event::Released { writers_open: 0 },
        ]
    );
    assert_eq!(u32s(&observer)[0], 5);
}

/// The same order, seen from another thread: a reader that waits for the
/// writer slot to be free (COHERENT refuses it until then) must always find
/// every written element in the tensor.
#[test]
fn a_reader_opened_after_the_writer_sees_all_its_data() {
    // Under Miri: two buffers' worth, two rounds (the interpreter is slow).
    const N: usize = if cfg!(miri) { 1100 } else { 3000 };
    for round in 0..if cfg!(miri) { 2 } else { 20u32 } {
        let mut t = Tensor::allocate_host(N * 4, None).unwrap();
        let shared = t.clone();
        let ready = Arc::new(Barrier::new(2));
        let ready2 = ready.clone();
        let reader = std::thread::spawn(move || {
            ready2.wait();
            loop {
                match shared.read_stream_accessor::<u32>() {
                    Ok(s) => return s.collect::<Result<Vec<u32>>>().unwrap(),
                    Err(crate::Error::Coherence(CoherenceError::Incoherent { .. })) => {
                        std::thread::yield_now()
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        });
        let mut w = t.write_stream_accessor::<u32>().unwrap();
        ready.wait();
        for i in 0..N as u32 {
            w.write(i + round).unwrap();
        }
        drop(w);
        let got = reader.join().unwrap();
        assert!(
            got.iter().enumerate().all(|(i, &v)| v == i as u32 + round),
            "round {round}: the reader saw unflushed data"
        );
    }
}

// ---------------------------------------------------------------- TCM

#[test]
fn tcm_stages_both_ways() {
    // N elements, M of them staged from element A (smaller under Miri).
    const N: usize = if cfg!(miri) { 300 } else { 3000 };
    const M: usize = N * 2 / 3;
    const A: usize = N - M - 1;
    let mut t = u32_tensor(N);
    {
        let tcm = t.tcm_accessor().unwrap();
        let mut scratch = tcm.alloc_tcm::<u32>(M).unwrap();
        assert!(!scratch.is_device());
        assert_eq!(scratch.len(), M);
        tcm.tensor_to_tcm(&mut scratch, A, M).unwrap();
        assert!((0..M).all(|i| scratch[i] == (A + i) as u32 * 3 + 1));
        let mut plain = [0u32; 3];
        tcm.tensor_to_slice(&mut plain, N - 3).unwrap();
        let last = (N - 3) as u32;
        assert_eq!(
            plain,
            [last * 3 + 1, (last + 1) * 3 + 1, (last + 2) * 3 + 1]
        );
        assert!(matches!(
            tcm.tensor_to_tcm(&mut scratch, A + 2, M),
            Err(crate::Error::Accessor(
                AccessorError::RangeOutOfBounds { .. }
            ))
        ));
        assert!(matches!(
            tcm.tensor_to_tcm(&mut scratch, 0, M + 1),
            Err(crate::Error::Accessor(
                AccessorError::RangeOutOfBounds { .. }
            ))
        ));
        assert!(tcm.tensor_to_slice(&mut plain, usize::MAX).is_err());
    }
    {
        let mut tcm = t.tcm_accessor_mut().unwrap();
        let mut scratch = tcm.alloc_tcm::<u32>(10).unwrap();
        scratch
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = 9000 + i as u32);
        tcm.tcm_to_tensor(&scratch, 5, 10).unwrap();
        tcm.slice_to_tensor(&[1u32, 2], N - 2).unwrap();
        assert!(tcm.slice_to_tensor(&[1u32, 2], N - 1).is_err());
    }
    let v = u32s(&t);
    assert_eq!(v[4], 4 * 3 + 1);
    assert!((0..10).all(|i| v[5 + i] == 9000 + i as u32));
    assert_eq!(v[15], 15 * 3 + 1);
    assert_eq!(&v[N - 2..], [1, 2]);
    assert_eq!(counts(&t), OpenCounts::default());
}

/// The TCM accessor counts as unbuffered (unlike the original, where it is
/// untracked): it coexists with indexed accessors and not with streams.
#[test]
fn tcm_accessor_is_tracked_as_unbuffered() {
    let t = u32_tensor(4);
    let tcm = t.tcm_accessor().unwrap();
    assert_eq!(counts(&t).unbuffered_accessors, 1);
    let idx = t.accessor::<u32, 1>([4]).unwrap();
    assert_eq!(counts(&t).unbuffered_accessors, 2);
    assert!(t.read_stream_accessor::<u32>().is_err());
    let mut w = t.clone();
    assert!(w.write_stream_accessor::<u32>().is_err());
    drop((tcm, idx));
    let r = t.read_stream_accessor::<u32>().unwrap();
    assert!(matches!(
        t.tcm_accessor(),
        Err(crate::Error::Coherence(CoherenceError::Incoherent {
            requested: AccessorKind::Unbuffered,
            ..
        }))
    ));
    drop(r);
    assert_eq!(counts(&t), OpenCounts::default());
}

// ---------------------------------------------------------------- matrix

/// Opens one accessor of the given kind on a handle of `t` (the four
/// accessor types map onto the three slot kinds).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Which {
    Reader,
    Writer,
    Indexed,
    Tcm,
}

enum Open<'a> {
    Reader(TensorReadStreamAccessor<'a, u32>),
    Writer(TensorWriteStreamAccessor<'a, u32>),
    Indexed(TensorAccessor<'a, u32, 1, ReadWrite>),
    Tcm(TensorTcmAccessor<'a, ReadOnly>),
}

impl Open<'_> {
    fn admission(&self) -> Admission {
        match self {
            Open::Reader(a) => a.admission().unwrap(),
            Open::Writer(a) => a.admission().unwrap(),
            Open::Indexed(a) => a.admission(),
            Open::Tcm(a) => a.admission(),
        }
    }
}

fn open(which: Which, t: &mut Tensor) -> Result<Open<'_>> {
    Ok(match which {
        Which::Reader => Open::Reader(t.read_stream_accessor()?),
        Which::Writer => Open::Writer(t.write_stream_accessor()?),
        Which::Indexed => Open::Indexed(t.accessor_mut([4])?),
        Which::Tcm => Open::Tcm(t.tcm_accessor()?),
    })
}

fn kind(w: Which) -> AccessorKind {
    match w {
        Which::Reader => AccessorKind::BufferedReader,
        Which::Writer => AccessorKind::BufferedWriter,
        Which::Indexed | Which::Tcm => AccessorKind::Unbuffered,
    }
}

thread_local! {
    static WARNINGS: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn keep_warning(msg: &str) {
    WARNINGS.with(|w| w.borrow_mut().push(msg.to_owned()));
}

/// Every pair of accessor types on one tensor, under every policy, through
/// the accessor constructors.
#[test]
fn accessor_matrix_under_every_policy() {
    use Which::*;
    crate::coherency::set_warning_sink(Some(keep_warning));
    for policy in Policy::ALL {
        for first in [Reader, Writer, Indexed, Tcm] {
            for second in [Reader, Writer, Indexed, Tcm] {
                let t = u32_tensor(4);
                t.set_accessor_coherence_policy(policy);
                assert_eq!(t.get_accessor_coherence_policy(), policy);
                let (mut h1, mut h2) = (t.clone(), t.clone());
                WARNINGS.with(|w| w.borrow_mut().clear());
                let a = open(first, &mut h1).unwrap();
                let b = open(second, &mut h2);
                let ok = kind(second).compatible_with(kind(first));
                let warned = WARNINGS.with(|w| std::mem::take(&mut *w.borrow_mut()));
                let what = format!("{policy:?} {first:?} then {second:?}");
                // Below the policy, the byte-range exclusion: a reader's
                // priming copy cannot read what an open read-write indexed
                // accessor holds, whatever the policy allowed.
                if (first, second) == (Indexed, Reader) && policy != Policy::Coherent {
                    let e = b.err().expect(&what);
                    assert!(matches!(e, Error::Busy { .. }), "{what}: {e}");
                    assert_eq!(
                        warned.len(),
                        usize::from(policy == Policy::IncoherentVerbose)
                    );
                    drop(a);
                    assert_eq!(counts(&t), OpenCounts::default(), "{what}");
                    continue;
                }
                match (ok, policy) {
                    (true, _) => {
                        assert_eq!(b.unwrap().admission(), Admission::Coherent, "{what}");
                        assert!(warned.is_empty(), "{what}");
                    }
                    (false, Policy::Coherent) => {
                        let e = b.err().expect(&what);
                        assert!(
                            matches!(
                                e,
                                crate::Error::Coherence(CoherenceError::Incoherent { .. })
                            ),
                            "{what}: {e}"
                        );
                        assert!(warned.is_empty(), "{what}");
                    }
                    (false, Policy::IncoherentVerbose) => {
                        assert_eq!(b.unwrap().admission(), Admission::Incoherent, "{what}");
                        assert_eq!(warned.len(), 1, "{what}");
                        assert!(warned[0].contains("may cause incoherent behaviour"));
                    }
                    (false, Policy::IncoherentQuiet) => {
                        assert_eq!(b.unwrap().admission(), Admission::Incoherent, "{what}");
                        assert!(warned.is_empty(), "{what}");
                    }
                }
                assert_eq!(a.admission(), Admission::Coherent);
                drop(a);
                assert_eq!(counts(&t), OpenCounts::default(), "{what}");
            }
        }
    }
}

#[test]
fn enforcer_is_per_view_shared_by_handles() {
    let t = u32_tensor(8);
    let handle = t.clone();
    let slice = t.slice(0, 16, None).unwrap();
    let _r = t.read_stream_accessor::<u32>().unwrap();
    assert_eq!(counts(&handle).buffered_readers, 1);
    assert_eq!(counts(&slice), OpenCounts::default());
    assert!(handle.accessor::<u32, 1>([8]).is_err());
    assert!(slice.accessor::<u32, 1>([4]).is_ok());
    handle.set_accessor_coherence_policy(Policy::IncoherentQuiet);
    assert_eq!(t.get_accessor_coherence_policy(), Policy::IncoherentQuiet);
    assert_eq!(slice.get_accessor_coherence_policy(), Policy::Coherent);
}

// ---------------------------------------------------------------- threads

/// Many threads open random accessors on handles of one tensor. Each
/// accessor, while open, marks its kind in shadow counters; no thread may
/// ever see an incompatible kind marked while its own accessor is open,
/// and all slots are free at the end.
#[test]
fn concurrent_accessors_stay_coherent() {
    const THREADS: usize = if cfg!(miri) { 4 } else { 8 };
    const ROUNDS: usize = if cfg!(miri) { 12 } else { 400 };
    let t = u32_tensor(1100);
    let held: Arc<[AtomicI32; 3]> = Arc::new([const { AtomicI32::new(0) }; 3]);
    let bad = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(THREADS));
    let slot = |k: AccessorKind| AccessorKind::ALL.iter().position(|&x| x == k).unwrap();
    let workers: Vec<_> = (0..THREADS)
        .map(|i| {
            let (mut h, held, bad, start) = (t.clone(), held.clone(), bad.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut opened = 0;
                for r in 0..ROUNDS {
                    let which = [Which::Reader, Which::Writer, Which::Indexed, Which::Tcm]
                        [(i * 7 + r * 13) % 4];
                    let k = kind(which);
                    let Ok(mut acc) = open(which, &mut h) else {
                        continue;
                    };
                    opened += 1;
                    held[slot(k)].fetch_add(1, Ordering::SeqCst);
                    for other in AccessorKind::ALL {
                        let n = held[slot(other)].load(Ordering::SeqCst) - i32::from(other == k);
                        if n > 0 && !k.compatible_with(other) {
                            bad.store(true, Ordering::SeqCst);
                        }
                    }
                    // Use it a little, so the accessors overlap in time.
                    match &mut acc {
                        Open::Reader(s) => {
                            s.next_element().unwrap();
                        }
                        Open::Writer(w) => w.write_all(&[7; 10]).unwrap(),
                        Open::Indexed(a) => a.set([1], 5).unwrap(),
                        // An indexed accessor (compatible under COHERENT)
                        // may hold the bytes: then the copy is refused.
                        Open::Tcm(c) => match c.tensor_to_slice(&mut [0u32; 2], 0) {
                            Ok(()) | Err(Error::Busy { .. }) => {}
                            Err(e) => panic!("{e}"),
                        },
                    }
                    held[slot(k)].fetch_sub(1, Ordering::SeqCst);
                    drop(acc);
                }
                opened
            })
        })
        .collect();
    let opened: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert!(
        !bad.load(Ordering::SeqCst),
        "incompatible accessors were open together"
    );
    assert!(opened > 0);
    assert_eq!(counts(&t), OpenCounts::default());
}

#[test]
fn errors_are_one_type_with_errnos() {
    // Accessor and coherence failures are variants of the crate's error,
    // each with its errno and message.
    let e: Error = CoherenceError::Underflow(AccessorKind::Unbuffered).into();
    assert!(e.to_string().contains("unbalanced release"));
    assert_eq!(e.raw_os_error(), Some(libc::EBUSY));
    assert!(matches!(e, Error::Coherence(CoherenceError::Underflow(_))));
    let e: Error = AccessorError::Closed.into();
    assert_eq!(
        (e.to_string().as_str(), e.raw_os_error()),
        ("the stream is closed", Some(libc::EBADF))
    );
    let t = Tensor::allocate_host(8, None).unwrap();
    let Err(e) = t.accessor::<u32, 1>([3]) else {
        panic!("a 3-element u32 accessor over 8 bytes was made")
    };
    assert!(matches!(
        e,
        Error::Accessor(AccessorError::ShapeOutOfBounds {
            needed: 12,
            len: 8,
            ..
        })
    ));
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
    // As an I/O error of the errno's kind, for callers that speak std::io.
    assert_eq!(
        std::io::Error::from(e).kind(),
        std::io::ErrorKind::InvalidInput
    );
}

// ------------------------------------------- soundness (issue 11, hole 1)

/// Two threads each open `accessor_mut` on a clone of one host tensor and
/// store to the same bytes: the enforcer finds two unbuffered accessors
/// compatible, so both open. With volatile (non-atomic) stores this was a
/// data race Miri reports; the stores are atomic byte accesses now.
#[test]
fn two_accessor_mut_on_clones_do_not_race() {
    let t = u32_tensor(4);
    let start = Arc::new(Barrier::new(2));
    let workers: Vec<_> = (0..2u32)
        .map(|i| {
            let (mut h, start) = (t.clone(), start.clone());
            std::thread::spawn(move || {
                let mut a = h.accessor_mut::<u32, 1>([4]).unwrap();
                start.wait();
                for round in 0..20 {
                    a.set([1], i * 100 + round).unwrap();
                    let _ = a.get([1]).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert!([19, 119].contains(&u32s(&t)[1]));
}

/// A write, memset or copy through another handle (or a slice, which has
/// its own enforcer) of the storage while an accessor holds the bytes used
/// to race its loads and stores; it is refused now, with nothing written,
/// and works again once the accessor is gone.
#[test]
fn copies_overlapping_an_open_accessor_are_refused() {
    let mut t = u32_tensor(8);
    let other = t.clone();
    let slice = t.slice(8, 8, None).unwrap();
    let far = t.slice(24, 8, None).unwrap();
    {
        let mut a = t.accessor_mut::<u32, 1>([4]).unwrap(); // bytes 0..16
        a.set([3], 77).unwrap();
        let busy = |r: crate::Result<()>| matches!(r, Err(Error::Busy { .. }));
        assert!(busy(other.write(0, &[1; 4])));
        assert!(busy(other.memset(12, 0, 4)));
        assert!(busy(slice.write(0, &[1; 4])));
        assert!(busy(other.read(0, &mut [0; 4])));
        assert!(busy(Tensor::copy(&far, 0, &slice, 0, 4)));
        assert!(busy(Tensor::copy(&slice, 0, &far, 0, 4)));
        // Outside the accessor's bytes everything works.
        far.write(0, &[9; 8]).unwrap();
        assert_eq!(a.get([3]).unwrap(), 77);
    }
    assert_eq!(u32s(&other)[3], 77);
    slice.write(0, &[1; 4]).unwrap();
    // A read-only accessor only keeps writers out.
    let r = t.accessor::<u32, 1>([8]).unwrap();
    assert_eq!(other.to_vec().unwrap()[8..12], [1; 4]);
    assert!(matches!(other.write(0, &[0]), Err(Error::Busy { .. })));
    drop(r);
    other.write(0, &[0]).unwrap();
}

/// The same from another thread: a writer on a slice against an accessor
/// of the parent. Either the write is refused or it ran before the
/// accessor opened; never at the same time (Miri checks).
#[test]
fn accessor_against_a_concurrent_writer_on_a_slice() {
    let mut t = u32_tensor(4);
    let slice = t.slice(0, 8, None).unwrap();
    let writer = std::thread::spawn(move || {
        let mut refused = 0;
        for _ in 0..20 {
            refused += usize::from(slice.write(0, &[0xab; 8]).is_err());
        }
        refused
    });
    for _ in 0..5 {
        let mut a = t.accessor_mut::<u32, 1>([4]).unwrap();
        a.set([0], 5).unwrap();
        let _ = a.get([1]).unwrap();
    }
    writer.join().unwrap();
}

/// A batch whose second op overlaps an open accessor moves no byte (the
/// whole batch is held before copying).
#[test]
fn a_batch_refused_by_an_open_accessor_moves_no_byte() {
    let t = u32_tensor(8);
    let before = t.to_vec().unwrap();
    let mut s = t.slice(16, 16, None).unwrap();
    let a = s.accessor_mut::<u32, 1>([4]).unwrap(); // bytes 16..32 of t
    let ops = [
        crate::WriteOp {
            offset: 0,
            buf: &[0xee; 4],
        },
        crate::WriteOp {
            offset: 16,
            buf: &[0xee; 4],
        },
    ];
    assert!(matches!(
        t.write_batch(&ops, crate::Fencing::Wait),
        Err(Error::Busy { .. })
    ));
    drop(a);
    assert_eq!(t.to_vec().unwrap(), before);
}

/// A write stream whose last flush fails reports it from `finish` (drop
/// could only log it).
#[test]
fn finish_reports_a_failed_flush() {
    let mut t = u32_tensor(4);
    let mut view = t.slice(0, 16, None).unwrap();
    let mut w = t.write_stream_accessor::<u32>().unwrap();
    w.write_all(&[1, 2]).unwrap();
    // An indexed accessor on another view holds the bytes: the flush
    // cannot write them.
    let a = view.accessor_mut::<u32, 1>([4]).unwrap();
    let e = w.finish().unwrap_err();
    assert!(matches!(e, Error::Busy { .. }), "{e}");
    drop(a);
    assert_eq!(counts(&t), OpenCounts::default());
    let mut w = t.write_stream_accessor::<u32>().unwrap();
    w.write_all(&[1, 2]).unwrap();
    w.finish().unwrap();
    assert_eq!(u32s(&t)[..2], [1, 2]);
}
