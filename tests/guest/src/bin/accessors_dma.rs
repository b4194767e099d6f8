//! Accessors and `neuron_memcpy` methods on `Dma` tensors (issue 6): each
//! memcpy method byte-exact in both directions, DMA really using the
//! engine (SUBMIT + wait) and ordered against in-flight jobs, and every
//! accessor kind working on device memory under each method.
//!
//! usage: accessors_dma [/dev/tdrvN]

use std::sync::Arc;

use tdrv::accessor::{ReadWrite, TensorAccessor, TensorAccessors};
use tdrv::coherency::{CoherenceError, Policy};
use tdrv::memcpy::{
    neuron_get_memcpy_method, neuron_memcpy_from_tensor_with, neuron_memcpy_read_with,
    neuron_memcpy_to_tensor_with, neuron_memcpy_write_with, neuron_set_memcpy_method,
    vec_memcpy_kernel, LocalBuffer, NeuronMemcpyMethod, DEFAULT_METHOD,
};
use tdrv::{Device, Job, Tensor};
use tdrv_guest_tests::{expect_eq, Tap, KSFT_SKIP};
use tdrv_uapi::{TDRV_FEAT_MMAP, TDRV_FEAT_SUBMIT};

use NeuronMemcpyMethod::{CMemcpy, Dma, VecMemcpy};

type R = Result<(), String>;

struct Ctx {
    dev: Arc<Device>,
    /// The device runs asynchronous jobs, so the DMA method can be used.
    engine: bool,
}

/// Formats an error with what was being done.
fn err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| ((i * 7 + i / 251) as u8) ^ seed).collect()
}

fn dma_tensor(ctx: &Ctx, channel: u32, bytes: &[u8]) -> Result<Tensor, String> {
    let t = Tensor::allocate_on(&ctx.dev, channel, bytes.len(), Some("accessors_dma"))
        .map_err(err("allocate"))?;
    t.write(0, bytes).map_err(err("write"))?;
    Ok(t)
}

fn same_bytes(what: &str, got: &[u8], want: &[u8]) -> R {
    if got == want {
        return Ok(());
    }
    if got.len() != want.len() {
        return Err(format!("{what}: {} bytes, want {}", got.len(), want.len()));
    }
    let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
    Err(format!(
        "{what}: first difference at byte {i}: {:#04x}, want {:#04x}",
        got[i], want[i]
    ))
}

/// The method a copy between a Dma tensor and device staging should use.
fn expected(ctx: &Ctx, m: NeuronMemcpyMethod) -> NeuronMemcpyMethod {
    match m {
        Dma if !ctx.engine => VecMemcpy,
        m => m,
    }
}

/// One method, both directions, device staging and host slices, at odd
/// offsets and lengths across 4 KiB boundaries.
fn method_is_byte_exact(ctx: &Ctx, m: NeuronMemcpyMethod) -> R {
    let size = 3 * 4096 + 77;
    let src = pattern(size, m as u8);
    for (off, len) in [(0, size), (1, 4096), (4095, 4097), (size - 1, 1)] {
        let t = dma_tensor(ctx, 0, &src)?;
        let mut staging = LocalBuffer::device(&ctx.dev, 0, len + 10).map_err(err("staging"))?;
        let used = neuron_memcpy_from_tensor_with(m, &mut staging, 5, &t, off, len)
            .map_err(err("from tensor"))?;
        expect_eq("method used (from tensor)", used, expected(ctx, m))?;
        let local = staging.as_slice();
        same_bytes("from tensor", &local[5..5 + len], &src[off..off + len])?;
        if local[..5].iter().chain(&local[5 + len..]).any(|&b| b != 0) {
            return Err("from tensor: staging bytes outside the range changed".into());
        }

        let fresh = pattern(len + 10, 0x5A ^ m as u8);
        staging.as_mut_slice().copy_from_slice(&fresh);
        let used =
            neuron_memcpy_to_tensor_with(m, &t, off, &staging, 5, len).map_err(err("to tensor"))?;
        expect_eq("method used (to tensor)", used, expected(ctx, m))?;
        let mut want = src.clone();
        want[off..off + len].copy_from_slice(&fresh[5..5 + len]);
        same_bytes("to tensor", &t.to_vec().map_err(err("read"))?, &want)?;

        // Plain host memory is out of the engine's reach: DMA falls back.
        let mut out = vec![0; len];
        let used = neuron_memcpy_read_with(m, &mut out, &t, off).map_err(err("read slice"))?;
        expect_eq(
            "method used (host slice)",
            used,
            if m == Dma { VecMemcpy } else { m },
        )?;
        same_bytes("read slice", &out, &want[off..off + len])?;
        let back = pattern(len, 0xC3);
        neuron_memcpy_write_with(m, &t, off, &back).map_err(err("write slice"))?;
        want[off..off + len].copy_from_slice(&back);
        same_bytes("write slice", &t.to_vec().map_err(err("read"))?, &want)?;
    }
    Ok(())
}

/// Slices: offsets compose and the slice's end bounds the copy.
fn methods_on_slices(ctx: &Ctx) -> R {
    let src = pattern(64 * 1024, 9);
    let whole = dma_tensor(ctx, 0, &src)?;
    let part = whole.slice(4097, 20_000, None).map_err(err("slice"))?;
    for m in NeuronMemcpyMethod::ALL {
        let mut staging = LocalBuffer::device(&ctx.dev, 0, 5000).map_err(err("staging"))?;
        neuron_memcpy_from_tensor_with(m, &mut staging, 0, &part, 15_000, 5000)
            .map_err(err("from slice"))?;
        same_bytes(
            &format!("{m:?} from slice"),
            staging.as_slice(),
            &src[4097 + 15_000..4097 + 20_000],
        )?;
        if neuron_memcpy_from_tensor_with(m, &mut staging, 0, &part, 15_001, 5000).is_ok() {
            return Err(format!("{m:?}: a copy past the slice's end was accepted"));
        }
    }
    Ok(())
}

/// Staging on another HBM channel is out of one job's reach: DMA falls
/// back to a CPU copy and stays exact.
fn dma_across_channels_falls_back(ctx: &Ctx) -> R {
    let src = pattern(10_000, 1);
    let t = dma_tensor(ctx, 1, &src)?;
    let mut staging = LocalBuffer::device(&ctx.dev, 0, src.len()).map_err(err("staging"))?;
    let used = neuron_memcpy_from_tensor_with(Dma, &mut staging, 0, &t, 0, src.len())
        .map_err(err("from tensor"))?;
    expect_eq("method used", used, VecMemcpy)?;
    same_bytes("from tensor", staging.as_slice(), &src)
}

/// A copy out of a tensor that an in-flight job is writing sees the job's
/// data (the tensor's write fence is waited out first), for every method.
fn copies_wait_for_inflight_jobs(ctx: &Ctx) -> R {
    // The job must still be running when the CPU copy starts. The edu
    // engine moves 4 KiB per 100 ms of guest time, which is host time when
    // the guest runs without -icount (with the sim device): 64 KiB keeps
    // its job busy for 1.6 s, where 1 MiB would take 26 s per job.
    let len = if ctx.dev.kind() == tdrv::DeviceKind::Edu {
        64 << 10
    } else {
        1 << 20
    };
    for m in NeuronMemcpyMethod::ALL {
        let data = pattern(len, 0x11 ^ m as u8);
        let src = dma_tensor(ctx, 0, &data)?;
        let dst = dma_tensor(ctx, 0, &vec![0; len])?;
        let mut job = Job::new();
        job.copy(&src, 0, &dst, 0, len).map_err(err("job copy"))?;
        let running = job.submit().map_err(err("submit"))?;
        let mut staging = LocalBuffer::device(&ctx.dev, 0, len).map_err(err("staging"))?;
        neuron_memcpy_from_tensor_with(m, &mut staging, 0, &dst, 0, len)
            .map_err(err("from tensor"))?;
        same_bytes(&format!("{m:?} after a job"), staging.as_slice(), &data)?;
        running.wait().map_err(err("job"))?;

        // And a copy into a tensor a job is still reading waits for it: the
        // job copies the old bytes.
        let copy = dma_tensor(ctx, 0, &vec![0; len])?;
        let mut job = Job::new();
        job.copy(&src, 0, &copy, 0, len).map_err(err("job copy"))?;
        let running = job.submit().map_err(err("submit"))?;
        staging.as_mut_slice().fill(0xEE);
        neuron_memcpy_to_tensor_with(m, &src, 0, &staging, 0, len).map_err(err("to tensor"))?;
        running.wait().map_err(err("job"))?;
        same_bytes(
            &format!("{m:?} job input"),
            &copy.to_vec().map_err(err("read"))?,
            &data,
        )?;
    }
    Ok(())
}

fn indexed_accessor(ctx: &Ctx) -> R {
    let mut t = dma_tensor(ctx, 0, &vec![0; 64 * 48 * 4])?;
    {
        let mut a: TensorAccessor<'_, u32, 2, ReadWrite> =
            t.accessor_mut([64, 48]).map_err(err("accessor_mut"))?;
        for i in 0..64 {
            for j in 0..48 {
                a.set([i, j], (i * 1000 + j) as u32).map_err(err("set"))?;
            }
        }
    }
    let bytes = t.to_vec().map_err(err("read"))?;
    let want: Vec<u8> = (0..64u32)
        .flat_map(|i| (0..48u32).flat_map(move |j| (i * 1000 + j).to_le_bytes()))
        .collect();
    same_bytes("tensor after set", &bytes, &want)?;
    let a = t.accessor::<u32, 2>([48, 64]).map_err(err("accessor"))?;
    // Read through transposed strides.
    let tr = TensorAccessor::<u32, 2>::with_strides(&t, [48, 64], [1, 48])
        .map_err(err("strided accessor"))?;
    expect_eq("get", tr.get([47, 63]).map_err(err("get"))?, 63 * 1000 + 47)?;
    expect_eq(
        "get",
        a.select(1)
            .and_then(|r| r.get(&[0]))
            .map_err(err("select"))?,
        1000 + 16,
    )?;
    expect_eq(
        "unbuffered count",
        t.coherency_enforcer().counts().unbuffered_accessors,
        2,
    )
}

/// Runs `f` with the process-wide method set to `m`, then restores it.
fn with_method(m: NeuronMemcpyMethod, f: impl FnOnce() -> R) -> R {
    neuron_set_memcpy_method(m);
    let r = f();
    neuron_set_memcpy_method(DEFAULT_METHOD);
    r
}

fn read_stream(ctx: &Ctx, m: NeuronMemcpyMethod) -> R {
    with_method(m, || {
        let n = 3 * 1024 + 5;
        let bytes: Vec<u8> = (0..n as u32)
            .flat_map(|i| (i ^ 0xABCD).to_le_bytes())
            .collect();
        let t = dma_tensor(ctx, 0, &bytes)?;
        let mut s = t.read_stream_accessor::<u32>().map_err(err("open"))?;
        expect_eq(
            "staging is device memory",
            s.staging_is_device(),
            expected(ctx, m) == Dma,
        )?;
        let mut i = 0u32;
        while let Some(v) = s.next_element().map_err(err("next"))? {
            expect_eq("element", v, i ^ 0xABCD)?;
            i += 1;
        }
        expect_eq("elements", i as usize, n)?;
        expect_eq("refills", s.refills(), 4)
    })
}

fn write_stream(ctx: &Ctx, m: NeuronMemcpyMethod) -> R {
    with_method(m, || {
        let n = 2 * 1024 + 300;
        let mut t = dma_tensor(ctx, 0, &vec![0; n * 4])?;
        let observer = t.clone();
        let mut w = t.write_stream_accessor::<u32>().map_err(err("open"))?;
        expect_eq(
            "staging is device memory",
            w.staging_is_device(),
            expected(ctx, m) == Dma,
        )?;
        for i in 0..n as u32 {
            w.write(i.wrapping_mul(2_654_435_761))
                .map_err(err("write"))?;
        }
        expect_eq("flushes before close", w.flushes(), 2)?;
        match observer.read_stream_accessor::<u32>() {
            Err(tdrv::Error::Coherence(CoherenceError::Incoherent { .. })) => {}
            Ok(_) => return Err("a reader opened next to the writer".into()),
            Err(e) => return Err(format!("open reader: {e}")),
        }
        w.close().map_err(err("close"))?;
        drop(w);
        let want: Vec<u8> = (0..n as u32)
            .flat_map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes())
            .collect();
        same_bytes("tensor", &observer.to_vec().map_err(err("read"))?, &want)?;
        let s = observer
            .read_stream_accessor::<u32>()
            .map_err(err("reader after close"))?;
        expect_eq("reader elements", s.len(), n)
    })
}

fn tcm_accessor(ctx: &Ctx, m: NeuronMemcpyMethod) -> R {
    with_method(m, || {
        let src = pattern(40_000, 3);
        let mut t = dma_tensor(ctx, 0, &src)?;
        let mut tcm = t.tcm_accessor_mut().map_err(err("open"))?;
        let mut scratch = tcm.alloc_tcm::<u8>(10_000).map_err(err("alloc_tcm"))?;
        expect_eq(
            "scratch is device memory",
            scratch.is_device(),
            expected(ctx, m) == Dma,
        )?;
        tcm.tensor_to_tcm(&mut scratch, 12_345, 10_000)
            .map_err(err("tensor_to_tcm"))?;
        same_bytes("tensor_to_tcm", &scratch, &src[12_345..22_345])?;
        scratch.iter_mut().for_each(|b| *b = !*b);
        tcm.tcm_to_tensor(&scratch, 1, 9_999)
            .map_err(err("tcm_to_tensor"))?;
        drop(tcm);
        let mut want = src.clone();
        for (i, b) in want[1..10_000].iter_mut().enumerate() {
            *b = !src[12_345 + i];
        }
        same_bytes("tcm_to_tensor", &t.to_vec().map_err(err("read"))?, &want)
    })
}

/// The policies on a Dma tensor: COHERENT refuses, the others allow.
fn policies(ctx: &Ctx) -> R {
    let t = dma_tensor(ctx, 0, &[0; 4096])?;
    let reader = t.read_stream_accessor::<u8>().map_err(err("reader"))?;
    match t.accessor::<u8, 1>([16]) {
        Err(tdrv::Error::Coherence(CoherenceError::Incoherent { .. })) => {}
        other => {
            return Err(format!(
                "COHERENT: indexed next to a reader: {:?}",
                other.err()
            ))
        }
    }
    if t.tcm_accessor().is_ok() {
        return Err("COHERENT: TCM accessor next to a reader was allowed".into());
    }
    for p in [Policy::IncoherentVerbose, Policy::IncoherentQuiet] {
        t.set_accessor_coherence_policy(p);
        let a = t
            .accessor::<u8, 1>([16])
            .map_err(err("incoherent accessor"))?;
        expect_eq(
            "counts",
            t.coherency_enforcer().counts().unbuffered_accessors,
            1,
        )?;
        drop(a);
    }
    drop(reader);
    expect_eq(
        "all released",
        t.coherency_enforcer().counts(),
        Default::default(),
    )
}

/// Several threads stream one Dma tensor at once (readers coexist).
fn concurrent_readers(ctx: &Ctx) -> R {
    let bytes = pattern(5 * 4096 + 3, 77);
    let t = dma_tensor(ctx, 0, &bytes)?;
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let t = t.clone();
            std::thread::spawn(move || -> Result<Vec<u8>, String> {
                let s = t.read_stream_accessor::<u8>().map_err(err("open"))?;
                s.collect::<Result<Vec<u8>, _>>().map_err(err("read"))
            })
        })
        .collect();
    for h in handles {
        let got = h.join().map_err(|_| "a reader panicked".to_string())??;
        same_bytes("reader", &got, &bytes)?;
    }
    expect_eq(
        "all released",
        t.coherency_enforcer().counts(),
        Default::default(),
    )
}

type Check = (&'static str, Box<dyn Fn(&Ctx) -> R>);

fn main() {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "/dev/tdrv0".into());
    let dev = match Device::open(&path) {
        Ok(d) => d,
        Err(e) => {
            println!("TAP version 13\n1..0 # SKIP cannot open {path}: {e}");
            std::process::exit(KSFT_SKIP);
        }
    };
    if !dev.has_features(TDRV_FEAT_MMAP.into()) {
        println!("TAP version 13\n1..0 # SKIP {path} cannot map buffers");
        std::process::exit(KSFT_SKIP);
    }
    let ctx = Ctx {
        engine: dev.has_features(TDRV_FEAT_SUBMIT.into()),
        dev,
    };
    let mut checks: Vec<Check> = vec![
        (
            "default method is DMA",
            Box::new(|_| expect_eq("method", neuron_get_memcpy_method(), Dma)),
        ),
        (
            "C_MEMCPY byte-exact on Dma tensors",
            Box::new(|c| method_is_byte_exact(c, CMemcpy)),
        ),
        (
            "VEC_MEMCPY byte-exact on Dma tensors",
            Box::new(|c| method_is_byte_exact(c, VecMemcpy)),
        ),
        (
            "DMA byte-exact on Dma tensors (SUBMIT + wait)",
            Box::new(|c| method_is_byte_exact(c, Dma)),
        ),
        ("every method on slices", Box::new(methods_on_slices)),
        (
            "copies are ordered against in-flight jobs",
            Box::new(copies_wait_for_inflight_jobs),
        ),
        (
            "TensorAccessor set/get on a Dma tensor",
            Box::new(indexed_accessor),
        ),
        ("coherence policies on a Dma tensor", Box::new(policies)),
        (
            "concurrent read streams on a Dma tensor",
            Box::new(concurrent_readers),
        ),
    ];
    for m in NeuronMemcpyMethod::ALL {
        checks.push((
            [
                "read stream across 4 KiB (C_MEMCPY)",
                "read stream across 4 KiB (VEC_MEMCPY)",
                "read stream across 4 KiB (DMA)",
            ][m as usize],
            Box::new(move |c| read_stream(c, m)),
        ));
        checks.push((
            [
                "write stream flush and close (C_MEMCPY)",
                "write stream flush and close (VEC_MEMCPY)",
                "write stream flush and close (DMA)",
            ][m as usize],
            Box::new(move |c| write_stream(c, m)),
        ));
        checks.push((
            [
                "TCM accessor both ways (C_MEMCPY)",
                "TCM accessor both ways (VEC_MEMCPY)",
                "TCM accessor both ways (DMA)",
            ][m as usize],
            Box::new(move |c| tcm_accessor(c, m)),
        ));
    }
    let cross = "DMA across HBM channels falls back to VEC_MEMCPY";
    let mut tap = Tap::new(checks.len() + 1);
    tap.note(format!(
        "{path}: {} device, {} channel(s), engine {}, VEC_MEMCPY kernel {}",
        ctx.dev.kind(),
        ctx.dev.num_channels(),
        if ctx.engine { "yes" } else { "no" },
        vec_memcpy_kernel()
    ));
    for (name, f) in &checks {
        tap.check(name, f(&ctx));
    }
    if ctx.dev.num_channels() > 1 {
        tap.check(cross, dma_across_channels_falls_back(&ctx));
    } else {
        tap.skip(cross, "one HBM channel");
    }
    tap.finish()
}
