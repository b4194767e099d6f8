//! Tracing of tensor operations.
//!
//! Every operation emits a begin and an end event to the installed
//! [`TraceSink`]. The event ids of the original runtime are kept (read 9,
//! write 10, read_batch 11, write_batch 12, alloc 27, free 28); operations
//! the seed does not number use ids of their own from 100 up.
//!
//! A [`ChromeTraceSink`] writes Chrome trace-event JSON to a file; open it
//! in a browser's trace viewer (chrome://tracing or Perfetto). The crate
//! reads no environment variable and registers no exit hook: `libnrt.so.1`
//! installs one from `TDRV_TRACE_FILE` and finishes it at exit.
//!
//! With no sink installed, an operation pays one relaxed atomic load.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

/// A traced operation. The discriminant is the event id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum TraceOp {
    /// `read` (seed id 9).
    Read = 9,
    /// `write` (seed id 10).
    Write = 10,
    /// `read_batch` (seed id 11).
    ReadBatch = 11,
    /// `write_batch` (seed id 12).
    WriteBatch = 12,
    /// Allocation (seed id 27).
    Alloc = 27,
    /// Free of a handle (seed id 28).
    Free = 28,
    /// tdrv's own id (the seed does not trace memset).
    Memset = 100,
    /// tdrv's own id (the seed does not trace copies).
    Copy = 101,
    /// tdrv's own id: submission of an asynchronous job.
    Submit = 102,
}

impl TraceOp {
    /// The numeric event id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// A short name.
    pub fn name(self) -> &'static str {
        match self {
            TraceOp::Read => "read",
            TraceOp::Write => "write",
            TraceOp::ReadBatch => "read_batch",
            TraceOp::WriteBatch => "write_batch",
            TraceOp::Alloc => "alloc",
            TraceOp::Free => "free",
            TraceOp::Memset => "memset",
            TraceOp::Copy => "copy",
            TraceOp::Submit => "submit",
        }
    }
}

/// Begin or end of an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The operation starts.
    Begin,
    /// The operation ended.
    End,
}

/// One trace event.
#[derive(Debug, Clone, Copy)]
pub struct TraceEvent<'a> {
    /// The operation.
    pub op: TraceOp,
    /// Begin or end.
    pub phase: Phase,
    /// Name of the tensor the operation is about.
    pub tensor: &'a str,
    /// Bytes the operation covers.
    pub size: u64,
    /// Time since the first traced event of the process.
    pub timestamp: Duration,
    /// Kernel thread id of the caller.
    pub thread_id: u64,
    /// Free events: handles to the view before this one went (the seed's
    /// `ref_count` payload; 1 means the view itself is freed). 0 for other
    /// operations.
    pub ref_count: u64,
    /// Free events: the HBM channel of a `Dma` storage, -1 for host
    /// storage (the seed's `vtpb_idx` slot). -1 for other operations.
    pub hbm_index: i64,
}

/// Receives trace events; called on the operation's thread.
pub trait TraceSink: Send + Sync {
    /// Receives one event.
    fn record(&self, event: &TraceEvent<'_>);
    /// Writes out anything buffered.
    fn flush(&self) {}
}

static ENABLED: AtomicBool = AtomicBool::new(false);
/// 1 while tracing is off, 0 while it is on: the handle count (flags
/// included) a `Tensor` drop compares with to take its fast path, which
/// tests "untraced" and "last handle of a plain view" in one compare (a
/// live view's count is never 0).
static UNTRACED_LAST: AtomicUsize = AtomicUsize::new(1);
static SINK: RwLock<Option<Arc<dyn TraceSink>>> = RwLock::new(None);
/// Installs `sink` (or, with `None`, disables tracing).
pub fn set_sink(sink: Option<Arc<dyn TraceSink>>) {
    let on = sink.is_some();
    *SINK.write().unwrap_or_else(|e| e.into_inner()) = sink;
    ENABLED.store(on, Ordering::Release);
    UNTRACED_LAST.store(usize::from(!on), Ordering::Release);
}

/// See `UNTRACED_LAST`.
#[inline(always)]
pub(crate) fn untraced_last() -> usize {
    UNTRACED_LAST.load(Ordering::Relaxed)
}

/// Flushes the installed sink.
pub fn flush() {
    if let Some(s) = current() {
        s.flush();
    }
}

fn current() -> Option<Arc<dyn TraceSink>> {
    if !ENABLED.load(Ordering::Relaxed) {
        return None;
    }
    SINK.read().unwrap_or_else(|e| e.into_inner()).clone()
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

#[cfg(miri)]
fn thread_id() -> u64 {
    // Miri has no gettid syscall: a per-thread counter stands in.
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static TID: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    TID.with(|t| *t)
}

#[cfg(not(miri))]
fn thread_id() -> u64 {
    thread_local! {
        // SAFETY: gettid has no memory-safety requirements.
        static TID: u64 = unsafe { libc::syscall(libc::SYS_gettid) } as u64;
    }
    TID.with(|t| *t)
}

fn emit(sink: &dyn TraceSink, phase: Phase, scope: &Scope<'_>) {
    sink.record(&TraceEvent {
        op: scope.op,
        phase,
        tensor: scope.tensor,
        size: scope.size,
        timestamp: epoch().elapsed(),
        thread_id: thread_id(),
        ref_count: scope.ref_count,
        hbm_index: scope.hbm_index,
    });
}

/// Emits the begin event now and the end event when dropped.
pub(crate) struct Scope<'a> {
    /// With the `tracing` feature, the operation is a span too.
    #[cfg(feature = "tracing")]
    _span: tracing::span::EnteredSpan,
    sink: Option<Arc<dyn TraceSink>>,
    op: TraceOp,
    tensor: &'a str,
    size: u64,
    ref_count: u64,
    hbm_index: i64,
}

pub(crate) fn scope(op: TraceOp, tensor: &str, size: usize) -> Scope<'_> {
    scope_with(op, tensor, size, 0, -1)
}

/// A scope with the free payload.
pub(crate) fn scope_with(
    op: TraceOp,
    tensor: &str,
    size: usize,
    ref_count: u64,
    hbm_index: i64,
) -> Scope<'_> {
    let s = Scope {
        #[cfg(feature = "tracing")]
        _span: tracing::debug_span!(target: "tdrv", "tdrv", op = ?op, tensor, size).entered(),
        sink: current(),
        op,
        tensor,
        size: size as u64,
        ref_count,
        hbm_index,
    };
    if let Some(sink) = &s.sink {
        emit(sink.as_ref(), Phase::Begin, &s);
    }
    s
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        if let Some(s) = &self.sink {
            emit(s.as_ref(), Phase::End, self);
        }
    }
}

/// Whether a sink is (or was just) installed, to skip work only tracing
/// needs; the scope itself checks for the sink again. One relaxed load: it
/// is on every handle's drop.
#[inline(always)]
pub(crate) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Writes Chrome trace-event JSON (the "JSON array" format) to a file.
pub struct ChromeTraceSink {
    inner: Mutex<ChromeInner>,
    pid: u32,
}

struct ChromeInner {
    out: Option<BufWriter<File>>,
    first: bool,
}

impl ChromeTraceSink {
    /// Creates (truncates) the trace file.
    pub fn create(path: impl AsRef<Path>) -> io::Result<Self> {
        let mut out = BufWriter::new(File::create(path)?);
        out.write_all(b"[\n")?;
        Ok(ChromeTraceSink {
            inner: Mutex::new(ChromeInner {
                out: Some(out),
                first: true,
            }),
            pid: std::process::id(),
        })
    }

    /// Closes the JSON array and the file; later events are dropped.
    pub fn finish(&self) -> io::Result<()> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match inner.out.take() {
            Some(mut out) => {
                out.write_all(b"\n]\n")?;
                out.flush()
            }
            None => Ok(()),
        }
    }

    fn format(&self, e: &TraceEvent<'_>) -> String {
        let ph = match e.phase {
            Phase::Begin => "B",
            Phase::End => "E",
        };
        let ts = e.timestamp.as_nanos() as f64 / 1000.0;
        let mut s = format!(
            "{{\"name\":\"{}\",\"cat\":\"tdrv\",\"ph\":\"{ph}\",\"ts\":{ts:.3},\"pid\":{},\"tid\":{},\"args\":{{\"event_id\":{},\"tensor\":\"",
            e.op.name(),
            self.pid,
            e.thread_id,
            e.op.id(),
        );
        json_escape_into(&mut s, e.tensor);
        if e.op == TraceOp::Free {
            s.push_str(&format!(
                "\",\"size\":{},\"ref_count\":{},\"hbm_index\":{}}}}}",
                e.size, e.ref_count, e.hbm_index
            ));
        } else {
            s.push_str(&format!("\",\"size\":{}}}}}", e.size));
        }
        s
    }
}

fn json_escape_into(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
}

impl TraceSink for ChromeTraceSink {
    fn record(&self, event: &TraceEvent<'_>) {
        let line = self.format(event);
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let sep: &[u8] = if inner.first { b"" } else { b",\n" };
        inner.first = false;
        if let Some(out) = inner.out.as_mut() {
            // Trace output is best effort: an I/O error must not fail the
            // traced operation.
            let _ = out
                .write_all(sep)
                .and_then(|_| out.write_all(line.as_bytes()));
        }
    }

    fn flush(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(out) = inner.out.as_mut() {
            let _ = out.flush();
        }
    }
}

impl Drop for ChromeTraceSink {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_json_strings() {
        let mut s = String::new();
        json_escape_into(&mut s, "a\"b\\c\n\u{1}é");
        assert_eq!(s, "a\\\"b\\\\c\\n\\u0001é");
    }

    #[test]
    fn ids_match_the_seed() {
        assert_eq!(TraceOp::Read.id(), 9);
        assert_eq!(TraceOp::Write.id(), 10);
        assert_eq!(TraceOp::ReadBatch.id(), 11);
        assert_eq!(TraceOp::WriteBatch.id(), 12);
        assert_eq!(TraceOp::Alloc.id(), 27);
        assert_eq!(TraceOp::Free.id(), 28);
    }
}
