//! With the `tracing` feature, every traced operation is a span
//! (`cargo test -p tdrv --features tracing`).
#![cfg(feature = "tracing")]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

#[derive(Default)]
struct Spans {
    next: AtomicU64,
    seen: Mutex<Vec<String>>,
}

impl Subscriber for Spans {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        self.seen
            .lock()
            .unwrap()
            .push(format!("{} {:?}", span.metadata().target(), span.values()));
        Id::from_u64(self.next.fetch_add(1, Ordering::Relaxed) + 1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[test]
fn operations_are_spans() {
    let spans = std::sync::Arc::new(Spans::default());
    tracing::subscriber::with_default(spans.clone(), || {
        let t = tdrv::Tensor::allocate_host(16, Some("spanned")).unwrap();
        t.write(0, &[1; 4]).unwrap();
    });
    let seen = spans.seen.lock().unwrap();
    assert!(
        seen.iter()
            .any(|s| s.starts_with("tdrv") && s.contains("Alloc") && s.contains("spanned")),
        "{seen:?}"
    );
    assert!(seen.iter().any(|s| s.contains("Write")), "{seen:?}");
}
