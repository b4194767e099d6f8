//! `make bench`, host part (issue 7): the pure-userspace figures, timed
//! with criterion on the host.
//!
//! - Figure 1: slice create + drop against `Arc::clone` + drop and against
//!   a `Box` of a view's heap size (one allocation of the same bytes), on
//!   a `Malloc` tensor.
//! - C handle lookup (with figure 1): what the C ABI's table of live
//!   handles (`tdrv::handles`) adds to every `nrt_tensor_*` call, a lookup
//!   among 10,000 live handles plus the quiet clone, against the clone
//!   alone.
//! - Figure 7 (host half): heap bytes per view with 1 million slices, and
//!   per storage (with its first view) with 1 million `Fake` tensors,
//!   against 1 million `Box`es of a view's heap size.
//!
//! Besides criterion's own report, every figure is printed as one line
//! `BENCH {json}` (median, quartiles, minimum and maximum of criterion's
//! samples, in ns per operation), which scripts/bench-report merges with
//! the guest's figures. Run it with `cargo bench -p tdrv --bench host`;
//! `TDRV_BENCH_QUICK=1` shortens the measurement for a smoke run.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use criterion::Criterion;
use tdrv::handles::HandleTable;
use tdrv::{Tensor, VIEW_HEAP_SIZE};

/// Where criterion keeps its results (`$TDRV_BENCH_CRITERION`, else the
/// workspace's `target/criterion`).
fn criterion_dir() -> PathBuf {
    std::env::var_os("TDRV_BENCH_CRITERION")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/criterion"))
}

struct Summary {
    median: f64,
    p25: f64,
    p75: f64,
    min: f64,
    max: f64,
    n: usize,
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

fn summarize(mut v: Vec<f64>) -> Summary {
    v.sort_by(f64::total_cmp);
    Summary {
        median: quantile(&v, 0.5),
        p25: quantile(&v, 0.25),
        p75: quantile(&v, 0.75),
        min: v[0],
        max: v[v.len() - 1],
        n: v.len(),
    }
}

fn emit(fig: &str, case: &str, method: &str, unit: &str, s: &Summary) {
    let line = serde_json::json!({
        "fig": fig,
        "case": case,
        "method": method,
        "unit": unit,
        "median": s.median,
        "p25": s.p25,
        "p75": s.p75,
        "min": s.min,
        "max": s.max,
        "n": s.n,
    });
    println!("BENCH {line}");
}

/// Per-iteration times (ns) of criterion's samples of `group/id`.
fn criterion_samples(group: &str, id: &str) -> Option<Vec<f64>> {
    let path = criterion_dir()
        .join(group)
        .join(id)
        .join("new")
        .join("sample.json");
    let text = std::fs::read_to_string(&path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let iters = v["iters"].as_array()?;
    let times = v["times"].as_array()?;
    Some(
        iters
            .iter()
            .zip(times)
            .filter_map(|(i, t)| Some(t.as_f64()? / i.as_f64()?))
            .collect(),
    )
}

fn fig1(c: &mut Criterion) {
    let t = Tensor::allocate_host(4096, Some("fig1")).expect("allocate_host");
    let arc = Arc::new([0u8; 64]);
    let mut g = c.benchmark_group("fig1");
    g.bench_function("slice", |b| {
        b.iter(|| black_box(t.slice(black_box(64), 128, None).expect("slice")))
    });
    g.bench_function("arc_clone", |b| b.iter(|| black_box(Arc::clone(&arc))));
    g.bench_function("box", |b| {
        b.iter(|| black_box(Box::new([0u8; VIEW_HEAP_SIZE])))
    });
    g.finish();
}

fn registry(c: &mut Criterion) {
    let t = Tensor::allocate_host(4096, Some("registry")).expect("allocate_host");
    let table = HandleTable::new();
    let others: Vec<usize> = (0..10_000)
        .map(|_| table.insert(t.clone_quiet()).expect("insert"))
        .collect();
    let h = others[others.len() / 2];
    let mut g = c.benchmark_group("registry");
    g.bench_function("lookup", |b| {
        b.iter(|| black_box(table.get(black_box(h), Tensor::clone_quiet)))
    });
    g.bench_function("direct", |b| b.iter(|| black_box(t.clone_quiet())));
    g.finish();
}

/// Bytes the C allocator hands out now (arena plus mmapped chunks).
fn heap_in_use() -> usize {
    // SAFETY: mallinfo2 only reads the allocator's statistics.
    let m = unsafe { libc::mallinfo2() };
    m.uordblks + m.hblkhd
}

/// Heap bytes per element of `n` values made by `make`, all kept alive.
fn bytes_each<T>(n: usize, mut make: impl FnMut(usize) -> T) -> f64 {
    let mut v: Vec<T> = Vec::with_capacity(n);
    let before = heap_in_use();
    for i in 0..n {
        v.push(make(i));
    }
    let bytes = heap_in_use() - before;
    drop(black_box(v));
    bytes as f64 / n as f64
}

fn fig7_memory() {
    const N: usize = 1_000_000;
    let t = Tensor::allocate_host(4096, Some("fig7")).expect("allocate_host");
    let (mut view, mut boxed, mut fake) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        view.push(bytes_each(N, |i| {
            t.slice((i % 64) * 64, 64, None).expect("slice")
        }));
        boxed.push(bytes_each(N, |_| {
            black_box(Box::new([0u8; VIEW_HEAP_SIZE]))
        }));
        fake.push(bytes_each(N, |_| {
            Tensor::allocate_fake(4096, None).expect("fake")
        }));
    }
    emit("7", "view_host", "tensor_slice", "B", &summarize(view));
    emit("7", "view_host", "box", "B", &summarize(boxed));
    emit("7", "storage_host", "fake_tensor", "B", &summarize(fake));
}

fn main() {
    let quick = std::env::var_os("TDRV_BENCH_QUICK").is_some_and(|v| !v.is_empty());
    let (warm, measure) = if quick {
        (Duration::from_millis(200), Duration::from_millis(500))
    } else {
        (Duration::from_secs(1), Duration::from_secs(3))
    };
    let mut c = Criterion::default()
        .output_directory(&criterion_dir())
        .warm_up_time(warm)
        .measurement_time(measure)
        .sample_size(60)
        .configure_from_args();
    fig1(&mut c);
    registry(&mut c);
    c.final_summary();
    for id in ["slice", "arc_clone", "box"] {
        match criterion_samples("fig1", id) {
            Some(s) if !s.is_empty() => emit("1", "host", id, "ns", &summarize(s)),
            _ => eprintln!("no criterion samples for fig1/{id} (filtered out?)"),
        }
    }
    for id in ["lookup", "direct"] {
        match criterion_samples("registry", id) {
            Some(s) if !s.is_empty() => emit("1", "registry", id, "ns", &summarize(s)),
            _ => eprintln!("no criterion samples for registry/{id} (filtered out?)"),
        }
    }
    fig7_memory();
}
