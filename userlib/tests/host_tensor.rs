//! Host paths of the tensor layer: Malloc, Fake, user-attached and empty
//! tensors, slices, refcounts, I/O, batches, copies and tensor sets.

use tdrv::compat::TensorCompat;
use tdrv::ops::TensorOps;
use tdrv::{Error, Fencing, Placement, ReadOp, StorageKind, Tensor, TensorSet, WriteOp};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn allocate_host_and_virtual() {
    for p in [Placement::Host, Placement::Virtual] {
        let t = Tensor::allocate(p, 7, 4096, None).unwrap();
        assert_eq!(t.name(), "_unknown_");
        assert_eq!(t.size(), 4096);
        assert_eq!(t.kind(), Some(StorageKind::Malloc));
        assert_eq!(t.to_vec().unwrap(), vec![0; 4096], "host memory is zeroed");
        let va = t.va().unwrap();
        assert_eq!(va.as_ptr() as usize % tdrv::HOST_ALIGN, 0);
        assert!(matches!(
            t.pa(),
            Err(Error::Unsupported {
                kind: StorageKind::Malloc,
                ..
            })
        ));
        assert!(t.device_allocation_info().is_err());
        assert_eq!(t.channel(), None);
    }
    let named = Tensor::allocate_host(1, Some("in0")).unwrap();
    assert_eq!(named.name(), "in0");
}

#[test]
fn impossible_host_allocations_fail_cleanly() {
    // Miri stops the program on an allocation it cannot back (1 << 60)
    // instead of returning null; the layout-overflow sizes still run.
    let sizes: &[usize] = if cfg!(miri) {
        &[usize::MAX, usize::MAX / 2]
    } else {
        &[usize::MAX, usize::MAX / 2, 1 << 60]
    };
    for &size in sizes {
        assert!(
            matches!(Tensor::allocate_host(size, None), Err(Error::OutOfMemory(s)) if s == size),
            "{size}"
        );
    }
}

#[test]
fn write_read_round_trip() {
    let t = Tensor::allocate_host(1000, Some("t")).unwrap();
    let data = pattern(300, 3);
    t.write(100, &data).unwrap();
    let mut back = vec![0; 300];
    t.read(100, &mut back).unwrap();
    assert_eq!(back, data);
    // The VA sees the same bytes.
    // SAFETY: the tensor is alive and nothing writes it concurrently.
    let via_va = unsafe { std::slice::from_raw_parts(t.va().unwrap().as_ptr().add(100), 300) };
    assert_eq!(via_va, &data[..]);
    // Zero-sized I/O at the end is fine.
    t.read(1000, &mut []).unwrap();
    t.write(1000, &[]).unwrap();
}

#[test]
fn caller_mistakes_are_errors() {
    let t = Tensor::allocate_host(64, None).unwrap();
    let mut buf = [0u8; 16];
    assert!(matches!(
        t.read(60, &mut buf),
        Err(Error::OutOfBounds {
            offset: 60,
            size: 16,
            len: 64,
            ..
        })
    ));
    assert!(matches!(t.write(49, &buf), Err(Error::OutOfBounds { .. })));
    assert!(matches!(
        t.read(usize::MAX, &mut buf),
        Err(Error::Overflow { .. })
    ));
    assert!(matches!(
        t.memset(usize::MAX - 1, 0, 4),
        Err(Error::Overflow { .. })
    ));
    assert!(matches!(t.memset(0, 0, 65), Err(Error::OutOfBounds { .. })));
    assert!(matches!(
        t.slice(60, 5, None),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        t.slice(usize::MAX, 2, None),
        Err(Error::Overflow { .. })
    ));
    assert!(matches!(
        Tensor::copy(&t, 0, &t, 60, 8),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        Tensor::copy(&t, 60, &t, 0, 8),
        Err(Error::OutOfBounds { .. })
    ));
    // Nothing was modified by the failed calls.
    assert_eq!(t.to_vec().unwrap(), vec![0; 64]);
}

#[test]
fn slices_share_storage_and_compose_offsets() {
    let parent = Tensor::allocate_host(1024, Some("parent")).unwrap();
    parent.write(0, &pattern(1024, 0)).unwrap();
    let s1 = parent.slice(100, 500, Some("s1")).unwrap();
    assert_eq!((s1.offset(), s1.size()), (100, 500));
    assert!(s1.shares_storage_with(&parent));
    let s2 = s1.slice(50, 100, None).unwrap();
    assert_eq!(s2.offset(), 150, "offsets compose");
    assert_eq!(s2.name(), "_unknown_");
    assert_eq!(parent.storage_ref_count(), 3);

    // Bounds are the parent view's, not the storage's.
    assert!(matches!(
        s2.slice(0, 101, None),
        Err(Error::OutOfBounds { len: 100, .. })
    ));
    assert!(s1.slice(400, 101, None).is_err());

    let mut b = vec![0; 100];
    s2.read(0, &mut b).unwrap();
    assert_eq!(b, pattern(1024, 0)[150..250]);

    // Writes through a slice are visible through the parent (no copy).
    s2.write(0, &[0xAA; 10]).unwrap();
    let mut p = [0; 10];
    parent.read(150, &mut p).unwrap();
    assert_eq!(p, [0xAA; 10]);

    // The parent may go first: the slices keep the storage alive.
    drop(parent);
    assert_eq!(s1.storage_ref_count(), 2);
    drop(s1);
    assert_eq!(s2.storage_ref_count(), 1);
    s2.read(0, &mut b).unwrap();
    assert_eq!(&b[..10], &[0xAA; 10]);
    assert_eq!(s2.va().unwrap().as_ptr() as usize % 2, 0);
}

#[test]
fn get_reference_is_the_same_view() {
    let t = Tensor::allocate_host(16, Some("r")).unwrap();
    let r = t.clone();
    assert!(r.same_view(&t));
    assert_eq!(t.view_ref_count(), 2);
    assert_eq!(t.storage_ref_count(), 1, "a reference is not a slice");
    r.completion().record().unwrap();
    assert_eq!(t.completion().count().unwrap(), 1);
    drop(t);
    assert_eq!(r.view_ref_count(), 1);
    assert_eq!(r.name(), "r");
}

#[test]
fn memset_and_copy() {
    let a = Tensor::allocate_host(256, None).unwrap();
    let b = Tensor::allocate_host(256, None).unwrap();
    a.memset(10, 0x5A, 20).unwrap();
    let v = a.to_vec().unwrap();
    assert!(v[..10].iter().all(|&x| x == 0));
    assert!(v[10..30].iter().all(|&x| x == 0x5A));
    assert!(v[30..].iter().all(|&x| x == 0));

    a.write(0, &pattern(256, 9)).unwrap();
    Tensor::copy(&a, 16, &b, 32, 64).unwrap();
    let v = b.to_vec().unwrap();
    assert_eq!(v[32..96], pattern(256, 9)[16..80]);
    assert!(v[..32].iter().chain(&v[96..]).all(|&x| x == 0));

    // Overlapping ranges of one storage behave like memmove.
    let src = pattern(256, 1);
    a.write(0, &src).unwrap();
    Tensor::copy(&a, 0, &a, 8, 100).unwrap();
    let v = a.to_vec().unwrap();
    assert_eq!(v[8..108], src[0..100]);
    let s1 = a.slice(0, 128, None).unwrap();
    let s2 = a.slice(64, 128, None).unwrap();
    a.write(0, &src).unwrap();
    Tensor::copy(&s2, 0, &s1, 10, 100).unwrap();
    assert_eq!(a.to_vec().unwrap()[10..110], src[64..164]);
}

#[test]
fn fake_tensors_have_no_bytes() {
    let f = Tensor::allocate_fake(1 << 40, Some("fake")).unwrap();
    assert_eq!(f.kind(), Some(StorageKind::Fake));
    assert_eq!(f.size(), 1 << 40);
    assert!(f.va().is_none());
    let mut buf = [7u8; 8];
    f.read(0, &mut buf).unwrap();
    assert_eq!(buf, [0; 8], "a fake tensor reads as zeros");
    f.write(8, &[7; 8]).unwrap();
    f.read(8, &mut buf).unwrap();
    assert_eq!(buf, [0; 8], "writes to a fake tensor are discarded");
    let mut a = [5u8; 4];
    let mut b = [6u8; 4];
    f.read_batch(
        &mut [
            ReadOp {
                offset: 0,
                buf: &mut a,
            },
            ReadOp {
                offset: 100,
                buf: &mut b,
            },
        ],
        Fencing::Wait,
    )
    .unwrap();
    assert_eq!((a, b), ([0; 4], [0; 4]), "every op of a batch is filled");
    f.memset(0, 1, 1 << 39).unwrap();
    assert!(
        f.read((1 << 40) - 4, &mut buf).is_err(),
        "bounds still apply"
    );
    let s = f.slice(1 << 30, 100, None).unwrap();
    assert_eq!(s.kind(), Some(StorageKind::Fake));
    let h = Tensor::allocate_host(16, None).unwrap();
    h.write(0, &[3; 16]).unwrap();
    Tensor::copy(&h, 0, &f, 0, 16).unwrap();
    assert_eq!(
        h.to_vec().unwrap(),
        [3; 16],
        "a copy into fake moves nothing"
    );
    Tensor::copy(&f, 0, &h, 4, 8).unwrap();
    assert_eq!(
        h.to_vec().unwrap(),
        [3, 3, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 3],
        "a copy from fake zero-fills its destination range"
    );
    assert!(f.pa().is_err());
}

#[test]
fn attached_buffers_are_never_freed_by_the_library() {
    let mut mem = vec![0u8; 128];
    {
        // SAFETY: `mem` outlives the tensor and its slice, and is not used
        // while they are.
        let t =
            unsafe { Tensor::from_user_buffer(mem.as_mut_ptr(), mem.len(), Some("user")) }.unwrap();
        assert_eq!(t.kind(), Some(StorageKind::User));
        assert_eq!(t.va().unwrap().as_ptr(), mem.as_mut_ptr());
        t.write(4, &[1, 2, 3]).unwrap();
        let s = t.slice(64, 64, None).unwrap();
        s.memset(0, 9, 64).unwrap();
        drop(t);
        s.write(0, &[8]).unwrap();
    }
    // The tensors are gone; the caller's memory is intact and still ours.
    assert_eq!(&mem[4..7], &[1, 2, 3]);
    assert_eq!(mem[64], 8);
    assert!(mem[65..].iter().all(|&x| x == 9));
    mem.push(1);
}

#[test]
fn attach_replaces_storage() {
    let mut t = Tensor::allocate_host(32, Some("x")).unwrap();
    t.write(0, &[5; 32]).unwrap();
    let old_slice = t.slice(0, 32, None).unwrap();
    let mut mem = [0u8; 8];
    // SAFETY: `mem` outlives `t`, which is dropped below before `mem` is read.
    unsafe { t.attach_buffer(mem.as_mut_ptr(), mem.len()) }.unwrap();
    assert_eq!(
        (t.size(), t.offset(), t.kind()),
        (8, 0, Some(StorageKind::User))
    );
    assert_eq!(t.name(), "x");
    assert_eq!(
        old_slice.storage_ref_count(),
        1,
        "the view let go of the old storage"
    );
    assert_eq!(old_slice.to_vec().unwrap(), vec![5; 32]);
    t.write(0, &[6; 8]).unwrap();
    drop(t);
    assert_eq!(mem, [6; 8]);

    // A shared view cannot be rebound under its other handles.
    let mut e = Tensor::allocate_empty(Some("e")).unwrap();
    let r = e.clone();
    let mut m2 = [0u8; 4];
    // SAFETY: not reached with a dangling buffer: the call fails.
    let err = unsafe { e.attach_buffer(m2.as_mut_ptr(), 4) }.unwrap_err();
    assert!(matches!(err, Error::SharedView(_)));
    drop(r);
    // SAFETY: `m2` outlives `e`.
    unsafe { e.attach_buffer(m2.as_mut_ptr(), 4) }.unwrap();
    // SAFETY: a null buffer with a non-zero size is refused, not used.
    assert!(unsafe { e.attach_buffer(std::ptr::null_mut(), 4) }.is_err());
}

#[test]
fn empty_tensors_have_no_storage() {
    let e = Tensor::allocate_empty(None).unwrap();
    assert_eq!((e.size(), e.kind(), e.name()), (0, None, "_unknown_"));
    assert!(e.va().is_none());
    assert!(matches!(e.read(0, &mut []), Err(Error::NoStorage { .. })));
    assert!(matches!(e.write(0, &[]), Err(Error::NoStorage { .. })));
    assert!(matches!(e.slice(0, 0, None), Err(Error::NoStorage { .. })));
    assert!(e.memset(0, 0, 0).is_err());
    assert!(e
        .completion()
        .wait(0, Some(std::time::Duration::ZERO))
        .is_err());
    let h = Tensor::allocate_host(4, None).unwrap();
    assert!(Tensor::copy(&e, 0, &h, 0, 0).is_err());
}

#[test]
fn zero_sized_host_tensors() {
    let t = Tensor::allocate_host(0, None).unwrap();
    assert_eq!(t.size(), 0);
    t.read(0, &mut []).unwrap();
    assert!(t.read(0, &mut [0]).is_err());
    assert!(t.va().is_some());
    let s = t.slice(0, 0, None).unwrap();
    assert_eq!(s.size(), 0);
}

#[test]
fn batches() {
    let t = Tensor::allocate_host(1024, Some("batch")).unwrap();
    let a = pattern(100, 1);
    let b = pattern(50, 2);
    let c = pattern(10, 3);
    t.write_batch(
        &[
            WriteOp { offset: 0, buf: &a },
            WriteOp {
                offset: 500,
                buf: &b,
            },
            WriteOp {
                offset: 1014,
                buf: &c,
            },
        ],
        Fencing::Wait,
    )
    .unwrap();
    let (mut ra, mut rb, mut rc) = (vec![0; 100], vec![0; 50], vec![0; 10]);
    t.read_batch(
        &mut [
            ReadOp {
                offset: 0,
                buf: &mut ra,
            },
            ReadOp {
                offset: 500,
                buf: &mut rb,
            },
            ReadOp {
                offset: 1014,
                buf: &mut rc,
            },
        ],
        Fencing::Skip,
    )
    .unwrap();
    assert_eq!((ra, rb, rc), (a.clone(), b.clone(), c.clone()));

    // One bad range fails the batch before any byte moves.
    let err = t
        .write_batch(
            &[
                WriteOp {
                    offset: 200,
                    buf: &a,
                },
                WriteOp {
                    offset: 1000,
                    buf: &b,
                },
            ],
            Fencing::Wait,
        )
        .unwrap_err();
    assert!(matches!(
        err,
        Error::OutOfBounds {
            op: "write_batch",
            ..
        }
    ));
    let mut check = vec![0; 100];
    t.read(200, &mut check).unwrap();
    assert_eq!(check, vec![0; 100]);
    let mut r = vec![0; 8];
    assert!(t
        .read_batch(
            &mut [ReadOp {
                offset: usize::MAX,
                buf: &mut r
            }],
            Fencing::Wait
        )
        .is_err());
    // An empty batch is fine.
    t.read_batch(&mut [], Fencing::Wait).unwrap();
    t.write_batch(&[], Fencing::Wait).unwrap();
}

#[test]
fn tensor_sets() {
    let mut set = TensorSet::new();
    let a = Tensor::allocate_host(8, Some("a")).unwrap();
    let b = Tensor::allocate_fake(8, Some("b")).unwrap();
    assert!(set.add("input", a.clone()).is_none());
    assert!(set.add("output", b).is_none());
    assert_eq!(set.len(), 2);
    assert!(set.get("input").unwrap().same_view(&a));
    assert!(set.get("missing").is_none());
    // The set holds a reference: dropping ours leaves the tensor valid.
    let replaced = set.add("input", Tensor::allocate_host(4, None).unwrap());
    assert!(replaced.unwrap().same_view(&a));
    drop(a);
    let mut names: Vec<_> = set.iter().map(|(n, _)| n.to_owned()).collect();
    names.sort();
    assert_eq!(names, ["input", "output"]);
    assert!(set.remove("output").is_some());
    assert_eq!(set.len(), 1);
}

#[test]
fn input_dump_writes_one_file_per_tensor() {
    let dir = std::env::temp_dir().join(format!("tdrv-dump-{}", std::process::id()));
    let a = Tensor::allocate_host(16, Some("in/put a")).unwrap();
    a.write(0, &pattern(16, 4)).unwrap();
    let b = Tensor::allocate_fake(16, Some("fake_in")).unwrap();
    let files = tdrv::dump::dump_tensors(&dir, "job7_", &[a.clone(), b]).unwrap();
    let names: Vec<_> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        names,
        ["job7_input0_in_put_a.bin", "job7_input1_fake_in.bin"]
    );
    assert_eq!(std::fs::read(&files[0]).unwrap(), pattern(16, 4));
    assert_eq!(std::fs::read(&files[1]).unwrap(), Vec::<u8>::new());
    std::fs::remove_dir_all(&dir).unwrap();

    assert_eq!(tdrv::dump::sanitize_name(""), "_unknown_");
    assert_eq!(tdrv::dump::sanitize_name(".."), "_unknown_");
    tdrv::dump::set_input_dump_directory(Some(dir.clone()));
    assert_eq!(tdrv::dump::input_dump_directory(), Some(dir));
    tdrv::dump::set_input_dump_directory(None);
}

#[test]
fn device_placement_without_a_device_is_an_error() {
    // The default node, where the host has none (unless the module is
    // loaded here); the explicit one below is checked everywhere.
    if !std::path::Path::new(tdrv::DEFAULT_DEVICE_PATH).exists() {
        let err = Tensor::allocate(Placement::Device, 0, 64, None).unwrap_err();
        assert!(
            matches!(err, Error::Sys(tdrv::SysError::Open { .. })),
            "{err}"
        );
    }
    // The node is set by the program (nrt: from TDRV_DEVICE), not read
    // from the environment by the crate.
    tdrv::set_default_device_path(Some("/nonexistent/tdrv7".into()));
    let err = Tensor::builder()
        .placement(Placement::Device)
        .zeroed(64)
        .unwrap_err();
    tdrv::set_default_device_path(None);
    match err {
        Error::Sys(tdrv::SysError::Open { path, errno }) => {
            assert_eq!(
                (path.to_str(), errno),
                (Some("/nonexistent/tdrv7"), libc::ENOENT)
            );
        }
        other => panic!("{other}"),
    }
}

#[test]
fn export_dmabuf_needs_a_device_tensor() {
    let t = tdrv::Tensor::allocate_host(64, Some("h")).unwrap();
    match t.export_dmabuf() {
        Err(tdrv::Error::Unsupported { op, .. }) => assert_eq!(op, "export_dmabuf"),
        other => panic!("export of host memory: {other:?}"),
    }
}
