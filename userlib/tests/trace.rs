//! Tracing: event ids, begin/end pairing, the pluggable sink and the Chrome
//! trace file named by TDRV_TRACE_FILE.

use std::process::Command;
use std::sync::{Arc, Mutex};

use tdrv::trace::{self, ChromeTraceSink, Phase, TraceEvent, TraceSink};
use tdrv::{Fencing, ReadOp, Tensor, WriteOp};

#[derive(Default)]
struct Collect(Mutex<Vec<(u32, Phase, String, u64)>>);

/// The sink is process-wide: tests that install one take turns.
static SINK_TURN: Mutex<()> = Mutex::new(());

impl TraceSink for Collect {
    fn record(&self, e: &TraceEvent<'_>) {
        self.0
            .lock()
            .unwrap()
            .push((e.op.id(), e.phase, e.tensor.to_owned(), e.size));
    }
}

/// Runs the traced workload of both tests.
fn workload(name: &str) {
    let t = Tensor::allocate_host(64, Some(name)).unwrap();
    t.write(0, &[1; 16]).unwrap();
    let mut b = [0; 16];
    t.read(0, &mut b).unwrap();
    t.write_batch(&[WriteOp { offset: 0, buf: &b }], Fencing::Wait)
        .unwrap();
    t.read_batch(
        &mut [ReadOp {
            offset: 16,
            buf: &mut b,
        }],
        Fencing::Wait,
    )
    .unwrap();
    drop(t);
}

#[test]
fn sink_gets_begin_end_pairs_with_the_seed_ids() {
    let _turn = SINK_TURN.lock().unwrap_or_else(|e| e.into_inner());
    let sink = Arc::new(Collect::default());
    trace::set_sink(Some(sink.clone()));
    workload("traced");
    trace::set_sink(None);
    let events: Vec<_> = sink
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.2 == "traced")
        .cloned()
        .collect();
    let ids: Vec<_> = events.iter().map(|e| (e.0, e.1)).collect();
    use Phase::{Begin as B, End as E};
    assert_eq!(
        ids,
        [
            (27, B),
            (27, E),
            (10, B),
            (10, E),
            (9, B),
            (9, E),
            (12, B),
            (12, E),
            (11, B),
            (11, E),
            (28, B),
            (28, E)
        ]
    );
    assert_eq!(events[0].3, 64, "alloc carries the size");
    assert_eq!(events[2].3, 16);
}

#[test]
fn unnamed_slices_and_clones_are_traced_when_dropped() {
    // An unnamed slice's last handle is dropped by the inlined fast path,
    // which must still see that tracing is on (and its clones, which are
    // not last, too); a quiet handle's drop is never traced.
    let _turn = SINK_TURN.lock().unwrap_or_else(|e| e.into_inner());
    let t = Tensor::allocate_host(4096, None).unwrap();
    // A block in this thread's pool slot, so the fast path would be taken.
    drop(t.slice(0, 8, None).unwrap());
    let sink = Arc::new(Collect::default());
    trace::set_sink(Some(sink.clone()));
    let s = t.slice(0, 77, None).unwrap();
    let c = s.clone();
    drop(s);
    drop(c);
    drop(t.slice(1, 77, None).unwrap().clone_quiet());
    trace::set_sink(None);
    drop(t.slice(2, 77, None).unwrap());
    let frees: Vec<_> = sink
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.0 == 28 && e.3 == 77)
        .map(|e| (e.1, e.2.clone()))
        .collect();
    use Phase::{Begin as B, End as E};
    let u = || tdrv::DEFAULT_NAME.to_owned();
    // Two traced drops of `s`/`c`, and the quiet handle's user original.
    assert_eq!(
        frees,
        [(B, u()), (E, u()), (B, u()), (E, u()), (B, u()), (E, u())]
    );
}

#[test]
fn chrome_sink_writes_valid_json() {
    let path = std::env::temp_dir().join(format!("tdrv-trace-{}.json", std::process::id()));
    let sink = Arc::new(ChromeTraceSink::create(&path).unwrap());
    let collect = Arc::new(Collect::default());
    // One sink at a time: check the JSON form directly.
    sink.record(&TraceEvent {
        op: trace::TraceOp::Read,
        phase: Phase::Begin,
        tensor: "a \"quoted\" name",
        size: 5,
        timestamp: std::time::Duration::from_micros(1500),
        thread_id: 42,
        ref_count: 0,
        hbm_index: -1,
    });
    sink.record(&TraceEvent {
        op: trace::TraceOp::Read,
        phase: Phase::End,
        tensor: "a \"quoted\" name",
        size: 5,
        timestamp: std::time::Duration::from_micros(1600),
        thread_id: 42,
        ref_count: 0,
        hbm_index: -1,
    });
    sink.finish().unwrap();
    drop(collect);
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let arr = v.as_array().unwrap();
    assert_eq!(arr.len(), 2);
    assert_eq!(arr[0]["name"], "read");
    assert_eq!(arr[0]["ph"], "B");
    assert_eq!(arr[1]["ph"], "E");
    assert_eq!(arr[0]["ts"], 1500.0);
    assert_eq!(arr[0]["tid"], 42);
    assert_eq!(arr[0]["args"]["event_id"], 9);
    assert_eq!(arr[0]["args"]["tensor"], "a \"quoted\" name");
}

/// The child half of `the_crate_reads_no_trace_file_env_var`.
/// Ignored, so that it is not counted as a test of its own: the parent
/// runs it with `--ignored`, in a process of its own.
#[test]
#[ignore = "the child half of another test; runs only in the process it starts"]
fn env_trace_child() {
    assert!(
        std::env::var_os("TDRV_TRACE_TEST_CHILD").is_some(),
        "run only as the child of its parent test"
    );
    workload("from_env");
}

/// `TDRV_TRACE_FILE` is the C library's (nrt/tests/trace_env.rs): the
/// crate reads no environment variable and registers no exit hook.
#[test]
#[cfg_attr(miri, ignore = "re-runs the test binary; Miri cannot run processes")]
fn the_crate_reads_no_trace_file_env_var() {
    let path = std::env::temp_dir().join(format!("tdrv-envtrace-{}.json", std::process::id()));
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "env_trace_child",
            "--ignored",
            "--test-threads=1",
        ])
        .env("TDRV_TRACE_FILE", &path)
        .env("TDRV_TRACE_TEST_CHILD", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The child really ran its half (a filter that matched nothing would
    // pass too).
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("test result: ok. 1 passed"),
        "the child did not run env_trace_child: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!path.exists(), "{} was written", path.display());
}
