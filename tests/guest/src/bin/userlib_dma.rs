//! The tdrv tensor library (`userlib/`) on a real device: Dma storage,
//! kernel fences, jobs and completion counts, cross-checked against the
//! driver's own accounting.
//!
//! usage: userlib_dma [/dev/tdrvN]   (default /dev/tdrv0)

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use tdrv::compat::TensorCompat;
use tdrv::ops::TensorOps;
use tdrv::sys::FenceKind;
use tdrv::{
    sys::DeviceKind, Access, Device, Error, Fencing, Job, Placement, ReadOp, StorageKind, SysError,
    Tensor, WriteOp,
};
use tdrv_guest_tests::{expect_eq, failure_injection, inject, Tap};

type R = Result<(), String>;
/// A named check of this program.
type Test = (&'static str, fn(&Ctx) -> R);

/// Bound of the fence waits: only turns a hang into a failure.
const FENCE_WAIT: Duration = Duration::from_secs(60);
/// How long a job may take (the edu engine moves one 4 KiB chunk per
/// interrupt).
const JOB_WAIT: Duration = Duration::from_secs(60);

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 13 + i / 509) as u8) ^ seed)
        .collect()
}

fn e<T>(what: &str, r: tdrv::Result<T>) -> Result<T, String> {
    r.map_err(|err| format!("{what}: {err}"))
}

fn same(what: &str, got: &[u8], want: &[u8]) -> R {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} != {}", got.len(), want.len()));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: first difference at byte {i}: {:#04x} != {:#04x}",
            got[i], want[i]
        )),
    }
}

fn read_all(t: &Tensor) -> Result<Vec<u8>, String> {
    e("read", t.to_vec())
}

/// Bytes and buffers the driver accounts to a channel.
fn usage(dev: &Device, channel: u32) -> Result<(u64, u64), String> {
    let i = dev
        .channel_info(channel)
        .map_err(|err| format!("CHANNEL_INFO: {err}"))?;
    Ok((i.used_bytes, i.buffers))
}

struct Ctx {
    path: String,
    dev: Arc<Device>,
}

impl Ctx {
    fn alloc(&self, size: usize, name: &str) -> Result<Tensor, String> {
        e(
            "allocate_on",
            Tensor::allocate_on(&self.dev, 0, size, Some(name)),
        )
    }
}

fn allocate_device_placement(c: &Ctx) -> R {
    // Placement::Device goes through the lazily opened process-wide
    // device, which set_default_device_path points at this program's device.
    let t = e(
        "allocate",
        Tensor::allocate(Placement::Device, 0, 65536, Some("dev_tensor")),
    )?;
    expect_eq("kind", t.kind(), Some(StorageKind::Dma))?;
    expect_eq("size", t.size(), 65536)?;
    expect_eq("channel", t.channel(), Some(0))?;
    expect_eq("name", t.name(), "dev_tensor")?;
    let d = t.device().ok_or("no device")?;
    expect_eq("device path", d.path().to_str(), Some(c.path.as_str()))?;
    if t.va().is_none() {
        return Err("a Dma tensor has no mapping".into());
    }
    let zero = read_all(&t)?;
    if zero.iter().any(|&b| b != 0) {
        return Err("a new buffer is not zeroed".into());
    }
    Ok(())
}

fn drop_frees(c: &Ctx) -> R {
    let before = usage(&c.dev, 0)?;
    let t = c.alloc(1 << 20, "accounted")?;
    let s = e("slice", t.slice(4096, 4096, None))?;
    let during = usage(&c.dev, 0)?;
    if during.0 < before.0 + (1 << 20) || during.1 != before.1 + 1 {
        return Err(format!("after ALLOC: {during:?}, before {before:?}"));
    }
    drop(t);
    // The slice still holds the storage.
    expect_eq(
        "buffers with a slice alive",
        usage(&c.dev, 0)?.1,
        before.1 + 1,
    )?;
    drop(s);
    expect_eq(
        "usage after the last view dropped",
        usage(&c.dev, 0)?,
        before,
    )
}

fn write_read_exact(c: &Ctx) -> R {
    let t = c.alloc(300_001, "rw")?;
    let data = pattern(300_001, 0x5c);
    e("write", t.write(0, &data))?;
    same("whole read", &read_all(&t)?, &data)?;
    let odd = pattern(10_007, 0x11);
    e("odd write", t.write(3, &odd))?;
    let mut back = vec![0; 10_007];
    e("odd read", t.read(3, &mut back))?;
    same("odd range", &back, &odd)?;
    // The kernel sees the same bytes (COPY_OUT bypasses our mapping).
    let h = t.dma_handle().ok_or("no handle")?;
    let mut k = vec![0; 10_010];
    c.dev
        .copy_out(h, 0, &mut k)
        .map_err(|err| format!("COPY_OUT: {err}"))?;
    same("kernel view", &k[3..], &odd)?;
    same("kernel view head", &k[..3], &data[..3])?;
    // Caller mistakes are errors.
    let mut one = [0u8; 2];
    match t.read(300_000, &mut one) {
        Err(Error::OutOfBounds { .. }) => {}
        other => return Err(format!("read past the end: {other:?}")),
    }
    match t.write(usize::MAX, &one) {
        Err(Error::Overflow { .. }) => Ok(()),
        other => Err(format!("overflowing write: {other:?}")),
    }
}

fn va_through_mapping(c: &Ctx) -> R {
    let t = c.alloc(8192, "va")?;
    let s = e("slice", t.slice(4000, 100, None))?;
    let data = pattern(100, 0x33);
    e("write", s.write(0, &data))?;
    let va = s.va().ok_or("no va")?;
    expect_eq(
        "slice va",
        va.as_ptr() as usize,
        t.va().ok_or("no va")?.as_ptr() as usize + 4000,
    )?;
    // SAFETY: the mapping is live while `t` is, and nothing else touches
    // these bytes now.
    let via_va = unsafe { std::slice::from_raw_parts(va.as_ptr(), 100) };
    same("bytes seen through the va", via_va, &data)?;
    // Direct writes through the mapping, after the fence, are what the
    // device sees.
    e("fence", s.wait_device_idle(Access::Write, Some(FENCE_WAIT)))?;
    // SAFETY: as above; the fence says no device access is in flight.
    unsafe { std::ptr::write_bytes(va.as_ptr(), 0xA5, 100) };
    let h = t.dma_handle().ok_or("no handle")?;
    let mut k = [0u8; 100];
    c.dev
        .copy_out(h, 4000, &mut k)
        .map_err(|err| format!("COPY_OUT: {err}"))?;
    same("kernel view of va writes", &k, &[0xA5; 100])
}

/// Mappings of the device node in this process (lines of /proc/self/maps).
fn device_mappings(path: &str) -> Result<usize, String> {
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(|err| err.to_string())?;
    Ok(maps.lines().filter(|l| l.ends_with(path)).count())
}

fn mapped_on_first_host_access(c: &Ctx) -> R {
    let before = device_mappings(&c.path)?;
    let ts = (0..50)
        .map(|_| c.alloc(4096, "lazy"))
        .collect::<Result<Vec<_>, _>>()?;
    expect_eq(
        "mappings after 50 allocations",
        device_mappings(&c.path)?,
        before,
    )?;
    let data = pattern(4096, 0x5C);
    e("write", ts[7].write(0, &data))?;
    expect_eq(
        "mappings after one write",
        device_mappings(&c.path)?,
        before + 1,
    )?;
    same("read back", &read_all(&ts[7])?, &data)?;
    // A slice of the same storage shares the one mapping.
    let s = e("slice", ts[7].slice(100, 10, None))?;
    same("slice read", &read_all(&s)?, &data[100..110])?;
    expect_eq(
        "mappings after a slice read",
        device_mappings(&c.path)?,
        before + 1,
    )?;
    drop((s, ts));
    expect_eq("mappings after drop", device_mappings(&c.path)?, before)
}

/// Restores `vm.max_map_count` when dropped.
struct MapCountLimit(String);

impl Drop for MapCountLimit {
    fn drop(&mut self) {
        let _ = std::fs::write("/proc/sys/vm/max_map_count", &self.0);
    }
}

fn host_access_past_map_count(c: &Ctx) -> R {
    let ts = (0..60)
        .map(|_| c.alloc(4096, "maplimit"))
        .collect::<Result<Vec<_>, _>>()?;
    let data: Vec<Vec<u8>> = (0..60).map(|i| pattern(4096, i as u8)).collect();
    let mut got = vec![0u8; 4096];
    let old =
        std::fs::read_to_string("/proc/sys/vm/max_map_count").map_err(|err| err.to_string())?;
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(|err| err.to_string())?;
    // Room for 20 more mappings: the other 40 tensors cannot be mapped.
    let limit = maps.lines().count() + 20;
    let _restore = MapCountLimit(old);
    std::fs::write("/proc/sys/vm/max_map_count", limit.to_string())
        .map_err(|err| err.to_string())?;
    for (t, d) in ts.iter().zip(&data) {
        e("write", t.write(0, d))?;
    }
    for (i, (t, d)) in ts.iter().zip(&data).enumerate() {
        e("read", t.read(0, &mut got))?;
        same(&format!("tensor {i}"), &got, d)?;
    }
    let mapped = device_mappings(&c.path)?;
    if mapped >= 60 {
        return Err(format!("{mapped} mappings: the limit did not bite"));
    }
    Ok(())
}

fn pa_and_device_info(c: &Ctx) -> R {
    let t = c.alloc(16384, "pa")?;
    let h = t.dma_handle().ok_or("no handle")?;
    let info = c
        .dev
        .buf_info(h)
        .map_err(|err| format!("BUF_INFO: {err}"))?;
    expect_eq("pa", e("pa", t.pa())?, info.dma_addr)?;
    let s = e("slice", t.slice(1000, 2000, None))?;
    let s2 = e("slice", s.slice(24, 100, None))?;
    let d = e("device_allocation_info", s2.device_allocation_info())?;
    expect_eq("slice pa", d.physical_address, info.dma_addr + 1024)?;
    expect_eq("slice size", d.size, 100)?;
    expect_eq("hbm index", d.hbm_index, info.channel)?;
    let h = Tensor::allocate_host(16, None).map_err(|err| err.to_string())?;
    match h.pa() {
        Err(Error::Unsupported { .. }) => Ok(()),
        other => Err(format!("pa of a host tensor: {other:?}")),
    }
}

fn slices(c: &Ctx) -> R {
    let parent = c.alloc(65536, "parent")?;
    let data = pattern(65536, 7);
    e("write", parent.write(0, &data))?;
    let s1 = e("slice", parent.slice(1000, 30000, Some("s1")))?;
    let s2 = e("slice", s1.slice(500, 1000, None))?;
    expect_eq("composed offset", s2.offset(), 1500)?;
    expect_eq("storage refs", parent.storage_ref_count(), 3)?;
    same("slice bytes", &read_all(&s2)?, &data[1500..2500])?;
    match s2.slice(900, 101, None) {
        Err(Error::OutOfBounds { .. }) => {}
        other => return Err(format!("slice past its parent view: {other:?}")),
    }
    e("write via slice", s2.write(10, &[0xEE; 20]))?;
    let mut p = [0u8; 20];
    e("read parent", parent.read(1510, &mut p))?;
    same("write through a slice seen by the parent", &p, &[0xEE; 20])?;
    drop(parent);
    drop(s1);
    let mut q = [0u8; 20];
    e("read orphan slice", s2.read(10, &mut q))?;
    same("slice outlives its parents", &q, &[0xEE; 20])
}

fn memset(c: &Ctx) -> R {
    let t = c.alloc(10000, "memset")?;
    e("write", t.write(0, &[1; 10000]))?;
    e("memset", t.memset(123, 0x7F, 4567))?;
    let v = read_all(&t)?;
    let mut want = vec![1u8; 10000];
    want[123..123 + 4567].fill(0x7F);
    same("after memset", &v, &want)?;
    match t.memset(9000, 0, 1001) {
        Err(Error::OutOfBounds { .. }) => Ok(()),
        other => Err(format!("memset past the end: {other:?}")),
    }
}

fn copy_same_channel(c: &Ctx) -> R {
    let a = c.alloc(50000, "copy_a")?;
    let b = c.alloc(50000, "copy_b")?;
    let data = pattern(50000, 9);
    e("write", a.write(0, &data))?;
    e("copy", Tensor::copy(&a, 17, &b, 33, 40000))?;
    let v = read_all(&b)?;
    same("copied range", &v[33..40033], &data[17..40017])?;
    if v[..33].iter().chain(&v[40033..]).any(|&x| x != 0) {
        return Err("bytes outside the copy changed".into());
    }
    // Overlapping ranges of one buffer: memmove semantics.
    e("overlapping copy", Tensor::copy(&a, 0, &a, 100, 1000))?;
    let mut w = vec![0; 1000];
    e("read", a.read(100, &mut w))?;
    same("overlapping copy", &w, &data[..1000])?;
    match Tensor::copy(&a, 49990, &b, 0, 11) {
        Err(Error::OutOfBounds { .. }) => Ok(()),
        other => Err(format!("copy past the end: {other:?}")),
    }
}

fn copy_host_round_trip(c: &Ctx) -> R {
    let d = c.alloc(4096, "rt_dev")?;
    let h = Tensor::allocate_host(4096, Some("rt_host")).map_err(|err| err.to_string())?;
    let data = pattern(4096, 0x42);
    e("host write", h.write(0, &data))?;
    e("host -> device", Tensor::copy(&h, 0, &d, 0, 4096))?;
    same("device after host->device", &read_all(&d)?, &data)?;
    e("device memset", d.memset(0, 0x99, 100))?;
    e("device -> host", Tensor::copy(&d, 0, &h, 1000, 100))?;
    let v = read_all(&h)?;
    same("host after device->host", &v[1000..1100], &[0x99; 100])?;
    // A fake destination discards the bytes; a fake source reads as
    // zeros (issue 24 item 15).
    let f = e("fake", Tensor::allocate_fake(4096, None))?;
    e("device -> fake", Tensor::copy(&d, 0, &f, 0, 4096))?;
    expect_eq("device byte after a copy into fake", read_all(&d)?[0], 0x99)?;
    e("fake -> device", Tensor::copy(&f, 0, &d, 0, 50))?;
    let v = read_all(&d)?;
    same(
        "device bytes after a copy from fake",
        &v[..51],
        &[[0; 50].as_slice(), &[0x99]].concat(),
    )
}

/// A job that fails (an injected edu stall: the watchdog fails it with
/// ETIMEDOUT) cannot be missed through the tensor API: its handle, the
/// completion wait, fences, reads and copies of its output all report it,
/// none waits for ever or returns stale bytes; a write clears it.
fn failed_job(c: &Ctx, t: &mut Tap) {
    const NAME: &str = "a failed job is an error for every reader and waiter";
    let edu = c.dev.kind() == tdrv::DeviceKind::Edu;
    let (fault, want) = failure_injection(edu);
    let node = c.path.trim_start_matches("/dev/").to_string();
    let body = || -> R {
        let size = 8192;
        let src = c.alloc(size, "failed_src")?;
        let dst = c.alloc(size, "failed_dst")?;
        let data = pattern(size, 0x17);
        e("write", src.write(0, &data))?;
        e("write", dst.write(0, &[0xEE; 8192]))?;
        inject(&node, fault)?;
        let h = e(
            "submit",
            Job::new().copy_all(&src, &dst).and_then(|j| j.submit()),
        )?;
        let failed = |what: &str, r: tdrv::Result<()>| -> R {
            match r {
                Err(tdrv::Error::DeviceWriteFailed { errno, .. }) if errno == want => Ok(()),
                other => Err(format!("{what}: {other:?}, want DeviceWriteFailed({want})")),
            }
        };
        // Waited for before the job's own outcome: ends, with the error.
        failed(
            "completion wait (no time limit)",
            dst.completion().wait(1, None),
        )?;
        match h.wait() {
            Err(tdrv::Error::JobFailed { errno, .. }) if errno == want => {}
            other => return Err(format!("job wait: {other:?}, want JobFailed({want})")),
        }
        match h.try_wait() {
            Err(tdrv::Error::JobFailed { .. }) => {}
            other => return Err(format!("try_wait: {other:?}")),
        }
        failed("to_vec", dst.to_vec().map(drop))?;
        let mut buf = [0u8; 16];
        failed(
            "read of a slice",
            dst.slice(4096, 16, None).and_then(|s| s.read(0, &mut buf)),
        )?;
        let mut ops = [ReadOp {
            offset: 0,
            buf: &mut buf,
        }];
        failed(
            "unfenced batch read",
            dst.read_batch(&mut ops, Fencing::Skip),
        )?;
        failed(
            "fence",
            dst.wait_device_idle(Access::Read, Some(FENCE_WAIT)),
        )?;
        let host = e("allocate_host", Tensor::allocate_host(size, None))?;
        failed("copy to host", Tensor::copy(&dst, 0, &host, 0, size))?;
        let other = c.alloc(size, "failed_other")?;
        failed(
            "device copy from it",
            Tensor::copy(&dst, 0, &other, 0, size),
        )?;
        let io: std::io::Error = dst.to_vec().map(drop).unwrap_err().into();
        if edu {
            expect_eq("io error kind", io.kind(), std::io::ErrorKind::TimedOut)?;
        }
        // The source was only read: intact.
        same("source", &read_all(&src)?, &data)?;
        // A write through the library clears the latch (through the
        // kernel, as a write through the mapping would not).
        e("write after the failure", dst.write(0, &data))?;
        same("read after the write", &read_all(&dst)?, &data)?;
        let info = c
            .dev
            .buf_info(dst.dma_handle().ok_or("no handle")?)
            .map_err(|err| format!("BUF_INFO: {err}"))?;
        expect_eq("latch after the write", info.error, 0)?;
        Ok(())
    };
    t.run(NAME, || -> R {
        let checks = body();
        // The engine recovers (it refuses jobs with EIO until the device
        // lets go of the stuck transfer, and keeps the job's buffers until
        // then); wait for that whatever the checks said, so that later
        // tests and the final accounting see a working engine.
        let src = c.alloc(4096, "recovery_src")?;
        let dst = c.alloc(4096, "recovery_dst")?;
        let mut tries = 0;
        let h = loop {
            match Job::new().copy_all(&src, &dst).and_then(|j| j.submit()) {
                Ok(h) => break h,
                Err(Error::Sys(err)) if err.errno() == libc::EIO && tries < 120 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(err) => return Err(format!("submit after recovery: {err}")),
            }
        };
        checks?;
        e("job after recovery", h.wait_timeout(JOB_WAIT))?;
        e("completion", dst.completion().wait(1, Some(JOB_WAIT)))
    });
}

fn cross_channel(c: &Ctx, t: &mut Tap) {
    const NAME: &str = "copy across HBM channels is refused";
    if c.dev.num_channels() < 2 {
        t.skip(NAME, "the device has one HBM channel");
        return;
    }
    let r: R = (|| {
        let a = c.alloc(4096, "ch0")?;
        let b = e(
            "alloc ch1",
            Tensor::allocate_on(&c.dev, 1, 4096, Some("ch1")),
        )?;
        expect_eq("channel", b.channel(), Some(1))?;
        match Tensor::copy(&a, 0, &b, 0, 64) {
            Err(Error::CrossChannel { src: 0, dst: 1 }) => {}
            other => return Err(format!("Tensor::copy: {other:?}")),
        }
        match Job::new().copy(&a, 0, &b, 0, 64) {
            Err(Error::CrossChannel { .. }) => {}
            other => return Err(format!("Job::copy: {:?}", other.map(|_| ()))),
        }
        // And the kernel itself says EXDEV.
        let desc = tdrv::sys::tdrv_copy_desc {
            src_handle: a.dma_handle().ok_or("no handle")?,
            src_offset: 0,
            dst_handle: b.dma_handle().ok_or("no handle")?,
            dst_offset: 0,
            size: 64,
        };
        match c.dev.copy(&desc) {
            Err(Error::Sys(SysError::CrossChannel { .. })) => Ok(()),
            other => Err(format!("COPY ioctl: {other:?}")),
        }
    })();
    t.check(NAME, r);
}

/// The other tdrv device nodes of this guest, sorted.
fn other_devices(path: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
                .filter(|p| {
                    p.strip_prefix("/dev/tdrv")
                        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                        && p != path
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// `Tensor::share_to` another device: the view there reads and writes
/// this device's bytes, and a job on the other device copies out of it
/// and into it (host memory of soft and edu, also into sim). From the sim
/// device (its HBM has no peer-to-peer path) the share is EOPNOTSUPP.
fn share_to_another_device(c: &Ctx, t: &mut Tap) {
    const NAME: &str = "share_to another device: the same bytes, for copies and that device's jobs";
    let mut others = Vec::new();
    for o in other_devices(&c.path) {
        match Device::open(&o) {
            Ok(d) => others.push(d),
            Err(err) => {
                t.check(NAME, Err::<(), String>(format!("opening {o}: {err}")));
                return;
            }
        }
    }
    let mine = c.dev.kind();
    // Another kind first: two devices of one kind add nothing here.
    let Some(other) = others.iter().find(|d| d.kind() != mine).or(others.first()) else {
        t.skip(NAME, "no other tdrv device in this guest");
        return;
    };
    let r: R = (|| {
        let len = job_size(c, 64 << 10).max(16 << 10);
        let a = c.alloc(len, "shared")?;
        let p: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        e("write", a.write(0, &p))?;
        let part = e("slice", a.slice(4096, len - 8192, None))?;
        if mine == DeviceKind::Sim {
            return match part.share_to(other, 0) {
                Err(err) if err.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
                other => Err(format!(
                    "share_to of sim HBM: {:?}, want EOPNOTSUPP",
                    other.map(|_| ())
                )),
            };
        }
        let s = e("share_to", part.share_to(other, 0))?;
        expect_eq(
            "the view there (offset, size, device)",
            (
                s.offset(),
                s.size(),
                s.device().map(|d| d.path().to_owned()),
            ),
            (4096, len - 8192, Some(other.path().to_owned())),
        )?;
        expect_eq(
            "bytes read there",
            e("to_vec", s.to_vec())?,
            p[4096..len - 4096].to_vec(),
        )?;
        // The other device's job copies out of the shared view and back in.
        let dst = e(
            "alloc there",
            Tensor::allocate_on(other, 0, len - 8192, Some("there")),
        )?;
        let h = e(
            "job there",
            Job::new().copy_all(&s, &dst).and_then(|j| j.submit()),
        )?;
        e("job wait", h.wait_timeout(JOB_WAIT))?;
        expect_eq(
            "bytes the other device's job read",
            e("to_vec", dst.to_vec())?,
            p[4096..len - 4096].to_vec(),
        )?;
        e("fill there", dst.write(0, &vec![0xA7; len - 8192]))?;
        let h = e(
            "job back",
            Job::new().copy_all(&dst, &s).and_then(|j| j.submit()),
        )?;
        e("job wait", h.wait_timeout(JOB_WAIT))?;
        let back = e("to_vec", a.to_vec())?;
        expect_eq("head untouched", back[..4096].to_vec(), p[..4096].to_vec())?;
        expect_eq(
            "what the other device's job wrote, seen here",
            back[4096..len - 4096].iter().all(|&b| b == 0xA7),
            true,
        )?;
        expect_eq(
            "tail untouched",
            back[len - 4096..].to_vec(),
            p[len - 4096..].to_vec(),
        )
    })();
    t.check(NAME, r);
}

/// Bytes of a job that moves `full` bytes elsewhere: the edu engine moves
/// 4 KiB per 100 ms timer tick, so 64 KiB there (what these checks need
/// of a job is that it runs for a while, not its size).
fn job_size(c: &Ctx, full: usize) -> usize {
    if c.dev.kind() == tdrv::DeviceKind::Edu {
        full.min(64 << 10)
    } else {
        full
    }
}

fn job_and_completion(c: &Ctx) -> R {
    let size = job_size(c, 1 << 20);
    let src = c.alloc(size, "job_src")?;
    let dst = c.alloc(size, "job_dst")?;
    let early = e("slice before the job", dst.slice(0, 4096, None))?;
    let data = pattern(size, 0x21);
    e("write", src.write(0, &data))?;
    match dst.completion().wait(1, Some(std::time::Duration::ZERO)) {
        Err(err) if err.is_timeout() => {}
        other => return Err(format!("poll before any job: {other:?}")),
    }
    let mut job = Job::new();
    e("job copy", job.copy(&src, 0, &dst, 0, size / 2))?;
    e(
        "job copy",
        job.copy(&src, size / 2, &dst, size / 2, size / 2),
    )?;
    expect_eq("job length", job.len(), 2)?;
    let h = e("submit", job.submit())?;
    e(
        "check_output_completion",
        dst.completion().wait(1, Some(JOB_WAIT)),
    )?;
    e("job wait", h.wait_timeout(JOB_WAIT))?;
    expect_eq("count", e("count", dst.completion().count())?, 1)?;
    expect_eq(
        "count of a slice made before the job",
        e("count", early.completion().count())?,
        1,
    )?;
    let late = e("slice after the job", dst.slice(0, 4096, None))?;
    expect_eq(
        "count of a slice made after the job",
        e("count", late.completion().count())?,
        0,
    )?;
    match late.completion().wait(1, Some(std::time::Duration::ZERO)) {
        Err(err) if err.is_timeout() => {}
        other => return Err(format!("a new slice starts at 0: {other:?}")),
    }
    same("job output", &read_all(&dst)?, &data)?;

    // Reset is per view; the next job counts from 0 again.
    e("reset", dst.completion().reset())?;
    expect_eq(
        "count after reset",
        e("count", dst.completion().count())?,
        0,
    )?;
    expect_eq(
        "other view keeps its count",
        e("count", early.completion().count())?,
        1,
    )?;
    let mut job = Job::new();
    e("job copy", job.copy(&src, 0, &late, 0, 4096))?;
    let h = e("submit", job.submit())?;
    e("wait forever", dst.completion().wait(1, None))?;
    e("job wait", h.wait())?;
    expect_eq(
        "late slice count",
        e("count", late.completion().count())?,
        1,
    )?;
    expect_eq(
        "early slice count",
        e("count", early.completion().count())?,
        2,
    )?;
    let p = e("pending", dst.pending_async())?;
    expect_eq(
        "nothing pending after the jobs",
        (p.reads, p.writes),
        (0, 0),
    )
}

fn read_fenced_behind_job(c: &Ctx) -> R {
    // A host read right after submitting must wait for the job's writes.
    let size = job_size(c, 4 << 20);
    let src = c.alloc(size, "big_src")?;
    let dst = c.alloc(size, "big_dst")?;
    let data = pattern(size, 0x6b);
    e("write", src.write(0, &data))?;
    let mut job = Job::new();
    e("job copy", job.copy(&src, 0, &dst, 0, size))?;
    let h = e("submit", job.submit())?;
    let mut tail = vec![0u8; 4096];
    e("read", dst.read(size - 4096, &mut tail))?;
    same("tail read right after submit", &tail, &data[size - 4096..])?;
    // And a host write to the source right after submitting waits for the
    // job's reads.
    let mut job = Job::new();
    e("job copy", job.copy(&src, 0, &dst, 0, size))?;
    let h2 = e("submit", job.submit())?;
    e("overwrite source", src.write(0, &vec![0u8; size]))?;
    e("job wait", h.wait_timeout(JOB_WAIT))?;
    e("job wait", h2.wait_timeout(JOB_WAIT))?;
    same("second job copied the old source", &read_all(&dst)?, &data)
}

fn batches(c: &Ctx) -> R {
    let t = c.alloc(100_000, "batch")?;
    let a = pattern(1000, 1);
    let b = pattern(3000, 2);
    e(
        "write_batch",
        t.write_batch(
            &[
                WriteOp { offset: 0, buf: &a },
                WriteOp {
                    offset: 97_000,
                    buf: &b,
                },
            ],
            Fencing::Wait,
        ),
    )?;
    let (mut ra, mut rb) = (vec![0; 1000], vec![0; 3000]);
    e(
        "read_batch",
        t.read_batch(
            &mut [
                ReadOp {
                    offset: 0,
                    buf: &mut ra,
                },
                ReadOp {
                    offset: 97_000,
                    buf: &mut rb,
                },
            ],
            Fencing::Skip,
        ),
    )?;
    same("batch a", &ra, &a)?;
    same("batch b", &rb, &b)?;
    match t.write_batch(
        &[
            WriteOp {
                offset: 2000,
                buf: &a,
            },
            WriteOp {
                offset: 99_999,
                buf: &b,
            },
        ],
        Fencing::Wait,
    ) {
        Err(Error::OutOfBounds { .. }) => {}
        other => return Err(format!("bad batch: {other:?}")),
    }
    let mut z = vec![1u8; 1000];
    e("read", t.read(2000, &mut z))?;
    same("a failed batch wrote nothing", &z, &[0; 1000])
}

fn threads_on_disjoint_slices(c: &Ctx) -> R {
    const THREADS: usize = 8;
    const CHUNK: usize = 64 * 1024;
    let whole = c.alloc(THREADS * CHUNK, "threads")?;
    let results: Vec<R> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..THREADS)
            .map(|i| {
                let slice = whole.slice(i * CHUNK, CHUNK, None);
                s.spawn(move || -> R {
                    let slice = e("slice", slice)?;
                    for round in 0..20u8 {
                        let data = pattern(CHUNK, i as u8 ^ round);
                        e("write", slice.write(0, &data))?;
                        same("thread read back", &read_all(&slice)?, &data)?;
                        e("memset", slice.memset(0, i as u8, CHUNK))?;
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into())))
            .collect()
    });
    for r in results {
        r?;
    }
    let all = read_all(&whole)?;
    for i in 0..THREADS {
        if all[i * CHUNK..(i + 1) * CHUNK]
            .iter()
            .any(|&b| b != i as u8)
        {
            return Err(format!("chunk {i} has foreign bytes"));
        }
    }
    Ok(())
}

fn input_dump(c: &Ctx) -> R {
    let dir = std::env::temp_dir().join(format!("tdrv-dump-{}", std::process::id()));
    tdrv::dump::set_input_dump_directory(Some(dir.clone()));
    let r = (|| {
        let src = c.alloc(5000, "dump me")?;
        let dst = c.alloc(5000, "dump_out")?;
        let data = pattern(5000, 0x71);
        e("write", src.write(0, &data))?;
        let mut job = Job::new();
        e("job copy", job.copy(&src, 0, &dst, 0, 5000))?;
        e(
            "job wait",
            e("submit", job.submit())?.wait_timeout(JOB_WAIT),
        )?;
        let files: Vec<_> = std::fs::read_dir(&dir)
            .map_err(|err| format!("{}: {err}", dir.display()))?
            .filter_map(|f| f.ok())
            .map(|f| f.path())
            .collect();
        expect_eq("dumped files", files.len(), 1)?;
        let name = files[0].file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !name.ends_with("_input0_dump_me.bin") {
            return Err(format!("dump file name {name:?}"));
        }
        let bytes = std::fs::read(&files[0]).map_err(|err| err.to_string())?;
        same("dumped bytes", &bytes, &data)
    })();
    tdrv::dump::set_input_dump_directory(None);
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// `map_read`/`map_write` lend a device buffer's mapping: a guard waits
/// for the job writing the buffer, and while it lives device writes to the
/// buffer are refused (the tensor layer's and the raw ioctls alike).
fn mapping_guards(c: &Ctx) -> R {
    let size = 8192;
    let src = c.alloc(size, "guard_src")?;
    let t = c.alloc(size, "guard_t")?;
    let data = pattern(size, 0x5a);
    e("write", src.write(0, &data))?;
    let h = e(
        "submit",
        Job::new().copy_all(&src, &t).and_then(|j| j.submit()),
    )?;
    {
        // Waits for the job in flight: sees its bytes.
        let g = e("map_read", t.map_read(..4096))?;
        same("guarded bytes", &g, &data[..4096])?;
        let pinned = |what: &str, r: tdrv::Result<()>| -> R {
            match r {
                Err(Error::Sys(SysError::Pinned { .. })) => Ok(()),
                other => Err(format!("{what}: {other:?}, want Pinned")),
            }
        };
        pinned(
            "job writing the guarded buffer",
            Job::new()
                .copy_all(&src, &t)
                .and_then(|j| j.submit())
                .map(drop),
        )?;
        pinned("memset elsewhere in it", t.memset(4096, 0, 16))?;
        let raw = t.dma_handle().ok_or("no handle")?;
        pinned("raw COPY_IN", c.dev.copy_in(raw, 0, &[1]))?;
        match t.write(0, &[1]) {
            Err(Error::Busy { .. }) => {}
            other => return Err(format!("write under the guard: {other:?}")),
        }
        // Reading it, and writing other buffers, are fine.
        let mut b = [0u8; 4];
        e("read under the guard", t.read(100, &mut b))?;
        e("write another buffer", src.write(0, &[3; 16]))?;
    }
    e("job", h.wait_timeout(JOB_WAIT))?;
    {
        let mut w = e("map_write", t.map_write(4096..))?;
        w.fill(0xC3);
    }
    let out = c.alloc(size, "guard_out")?;
    e(
        "job after the guards",
        Job::new()
            .copy_all(&t, &out)
            .and_then(|j| j.submit())
            .and_then(|h| h.wait_timeout(JOB_WAIT)),
    )?;
    let back = read_all(&out)?;
    same("first half", &back[..4096], &data[..4096])?;
    same("second half", &back[4096..], &[0xC3; 4096])
}

/// The owned guards the Python module's views hold (buffer protocol,
/// DLPack, `tdrv.Mapping`): they keep the buffer alive after every handle
/// is gone, pin it against device writes like `map_read`, and release the
/// pin from whichever thread drops them.
fn owned_mapping_guards(c: &Ctx) -> R {
    let size = 8192;
    let before = usage(&c.dev, 0)?;
    let src = c.alloc(size, "owned_src")?;
    let t = c.alloc(size, "owned_t")?;
    let data = pattern(size, 0x3c);
    e("write", src.write(0, &data))?;
    let h = e(
        "submit",
        Job::new().copy_all(&src, &t).and_then(|j| j.submit()),
    )?;
    // Waits for the job in flight, like `map_read`.
    let g = e("map_read_owned", t.map_read_owned(..))?;
    same("owned bytes", &g, &data)?;
    let again = t.clone();
    drop(t);
    match Job::new().copy_all(&src, &again).and_then(|j| j.submit()) {
        Err(Error::Sys(SysError::Pinned { .. })) => {}
        other => return Err(format!("job into the pinned buffer: {:?}", other.map(drop))),
    }
    e("job", h.wait_timeout(JOB_WAIT))?;
    // Released on another thread: device writes are allowed again.
    std::thread::spawn(move || drop(g))
        .join()
        .map_err(|_| "guard drop panicked")?;
    e(
        "job after the guard",
        Job::new()
            .copy_all(&src, &again)
            .and_then(|j| j.submit())
            .and_then(|h| h.wait_timeout(JOB_WAIT)),
    )?;
    let mut w = e("map_write_owned", again.map_write_owned(4096..))?;
    match again.write(5000, &[1]) {
        Err(Error::Busy { .. }) => {}
        other => return Err(format!("write under the owned guard: {other:?}")),
    }
    w.fill(0x11);
    // The last handles go (the job's too); the guard alone keeps the
    // buffer.
    drop((again, src, h));
    let held = usage(&c.dev, 0)?;
    if held.1 != before.1 + 1 {
        return Err(format!(
            "buffers with only the guard left: {held:?}, before {before:?}"
        ));
    }
    same("the guard's bytes", &w[..], &[0x11; 4096])?;
    drop(w);
    expect_eq("channel usage after the guard", usage(&c.dev, 0)?, before)
}

fn device_fences_and_misuse(c: &Ctx) -> R {
    let t = c.alloc(4096, "fences")?;
    e(
        "wait_device_idle read",
        t.wait_device_idle(Access::Read, Some(std::time::Duration::ZERO)),
    )?;
    e(
        "wait_device_idle write",
        t.wait_device_idle(Access::Write, Some(FENCE_WAIT)),
    )?;
    let h = t.dma_handle().ok_or("no handle")?;
    c.dev
        .fence_wait(h, FenceKind::All, 0)
        .map_err(|err| format!("FENCE_WAIT: {err}"))?;
    match t.mark_async_start(Access::Write) {
        Err(Error::Unsupported { .. }) => {}
        other => return Err(format!("async marks on Dma: {other:?}")),
    }
    match t.completion().record() {
        Err(Error::Unsupported { .. }) => {}
        other => return Err(format!("host completion on Dma: {other:?}")),
    }
    let host = Tensor::allocate_host(64, None).map_err(|err| err.to_string())?;
    match Job::new().copy(&host, 0, &t, 0, 64) {
        Err(Error::Unsupported { .. }) => {}
        other => return Err(format!("job with a host tensor: {:?}", other.map(|_| ()))),
    }
    match Job::new().copy(&t, 0, &t, 0, 0) {
        Err(Error::InvalidArgument(_)) => {}
        other => return Err(format!("zero-sized job copy: {:?}", other.map(|_| ()))),
    }
    match Tensor::allocate_on(&c.dev, c.dev.num_channels(), 64, None) {
        Err(Error::InvalidArgument(_)) => {}
        other => return Err(format!("allocation on a missing channel: {other:?}")),
    }
    // Past the channel's limit: ENOSPC, with the device, channel and size.
    let limit = c
        .dev
        .channel_info(0)
        .map_err(|err| format!("CHANNEL_INFO: {err}"))?
        .limit_bytes;
    let over = limit + 4096;
    if over <= c.dev.max_buffer_size() {
        match Tensor::allocate_on(&c.dev, 0, over as usize, None) {
            Err(
                err @ Error::DeviceAlloc {
                    channel: 0,
                    size,
                    source: SysError::NoSpace { .. },
                    ..
                },
            ) if size == over as usize => {
                let msg = err.to_string();
                if !msg.contains(&c.path) || !msg.contains("channel_mib") {
                    return Err(format!("message without context: {msg}"));
                }
            }
            other => return Err(format!("allocation past the channel limit: {other:?}")),
        }
    }
    match Tensor::allocate_on(&c.dev, 0, 0, None) {
        Err(Error::Sys(SysError::InvalidArgument { .. })) => Ok(()),
        other => Err(format!("zero-sized device allocation: {other:?}")),
    }
}

/// Issue 24 item 13: an import of this process's own export is the same
/// storage (one host exclusion per buffer), from the exporting file and
/// from another file of the device; a shared buffer is not lent as a
/// reference by the safe guards.
fn dmabuf_import_is_the_same_storage(c: &Ctx) -> R {
    let size = 8192;
    let t = c.alloc(size, "dmabuf_t")?;
    let data = pattern(size, 0x5a);
    e("write", t.write(0, &data))?;
    let fd = e("export_dmabuf", t.export_dmabuf())?;
    let alias = e("from_dmabuf", Tensor::from_dmabuf(&c.dev, &fd))?;
    expect_eq("alias handle", alias.dma_handle(), t.dma_handle())?;
    let other = Device::open(&c.path).map_err(|err| format!("second open: {err}"))?;
    let alias2 = e(
        "from_dmabuf (second file)",
        Tensor::from_dmabuf(&other, &fd),
    )?;
    expect_eq(
        "second file's alias handle",
        alias2.dma_handle(),
        t.dma_handle(),
    )?;
    match t.map_read(..) {
        Err(Error::SharedBuffer { .. }) => {}
        other => {
            return Err(format!(
                "safe map_read of an exported buffer: {:?}",
                other.map(drop)
            ))
        }
    }
    // SAFETY: the dma-buf never leaves this process.
    let g = e("map_read_shared", unsafe { t.map_read_shared(..) })?;
    for (name, a) in [("alias", &alias), ("second file's alias", &alias2)] {
        match a.write(0, &[0xee; 64]) {
            Err(Error::Busy { .. }) => {}
            other => return Err(format!("write through the {name} under a guard: {other:?}")),
        }
        match a.memset(100, 0xee, 64) {
            Err(Error::Busy { .. }) | Err(Error::Sys(SysError::Pinned { .. })) => {}
            other => {
                return Err(format!(
                    "memset through the {name} under a guard: {other:?}"
                ))
            }
        }
    }
    same("bytes under the guard", &g, &data)?;
    drop(g);
    same("bytes after the guard", &e("read back", t.to_vec())?, &data)?;
    e(
        "write through the alias after the guard",
        alias.write(0, &[7; 8]),
    )?;
    let mut b = [0u8; 8];
    e("read", t.read(0, &mut b))?;
    expect_eq("alias write seen by the exporter", b, [7; 8])?;
    Ok(())
}

fn main() {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "/dev/tdrv0".to_owned());
    // Before anything opens the process-wide device.
    tdrv::set_default_device_path(Some(path.clone().into()));
    tdrv::set_heartbeat_interval(Duration::from_secs(30));

    let tests: &[Test] = &[
        ("allocate with DEVICE placement", allocate_device_placement),
        ("dropping the last view frees the buffer", drop_frees),
        ("write and read back byte-exact", write_read_exact),
        ("va addresses the mapping", va_through_mapping),
        (
            "device tensors are mapped at the first host access",
            mapped_on_first_host_access,
        ),
        (
            "host access past vm.max_map_count falls back to copies",
            host_access_past_map_count,
        ),
        ("pa and device allocation info", pa_and_device_info),
        (
            "slices share storage, compose offsets, outlive parents",
            slices,
        ),
        ("memset", memset),
        ("device copy on one channel", copy_same_channel),
        (
            "host round trip copies; fake reads zeros, discards writes",
            copy_host_round_trip,
        ),
        (
            "submitted job reaches an output completion",
            job_and_completion,
        ),
        (
            "host access is fenced behind in-flight jobs",
            read_fenced_behind_job,
        ),
        ("read_batch and write_batch", batches),
        (
            "threads on disjoint slices of one buffer",
            threads_on_disjoint_slices,
        ),
        ("job inputs are dumped", input_dump),
        ("kernel fences and misuse errors", device_fences_and_misuse),
        (
            "map_read and map_write guards on a device buffer",
            mapping_guards,
        ),
        (
            "owned guards (Python views) keep and pin a device buffer",
            owned_mapping_guards,
        ),
        (
            "a dma-buf import of our own export is the same storage",
            dmabuf_import_is_the_same_storage,
        ),
    ];
    // Opening the device is a precondition, not a check.
    let dev = tdrv_guest_tests::bail::require(&format!("opening {path}"), Device::open(&path));
    // +1 cross channel, +1 failed job, +1 sharing, +1 final accounting.
    let mut t = Tap::new(tests.len() + 4);
    t.note(format!(
        "{}: {} device, ABI {}.{}, {} channels, features {:#x}",
        path,
        dev.kind(),
        dev.info().abi_major,
        dev.info().abi_minor,
        dev.num_channels(),
        dev.info().features
    ));
    let c = Ctx { path, dev };
    let baseline: Vec<_> = (0..c.dev.num_channels())
        .map(|ch| usage(&c.dev, ch))
        .collect();

    for (name, f) in tests {
        let r =
            catch_unwind(AssertUnwindSafe(|| f(&c))).unwrap_or_else(|_| Err("panicked".to_owned()));
        t.check(name, r);
    }
    cross_channel(&c, &mut t);
    failed_job(&c, &mut t);
    share_to_another_device(&c, &mut t);

    let now: Vec<_> = (0..c.dev.num_channels())
        .map(|ch| usage(&c.dev, ch))
        .collect();
    t.check(
        "every buffer was freed",
        expect_eq("channel usage (bytes, buffers)", now, baseline),
    );
    t.finish();
}
