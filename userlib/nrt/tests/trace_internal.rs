// SPDX-License-Identifier: MIT OR Apache-2.0
//! Issue 11, hole 4: the library's own handles (the C handle table's
//! lookups, a set's reference) emit no trace events; only the user's
//! actions do, and the free event carries the seed's payload.

use std::ffi::CString;
use std::ptr::null_mut;
use std::sync::{Arc, Mutex};

use nrt::*;
use tdrv::trace::{self, Phase, TraceEvent, TraceOp, TraceSink};

type Seen = (TraceOp, Phase, String, u64, i64);

#[derive(Default)]
struct Collect(Mutex<Vec<Seen>>);

impl TraceSink for Collect {
    fn record(&self, e: &TraceEvent<'_>) {
        self.0
            .lock()
            .unwrap()
            .push((e.op, e.phase, e.tensor.to_owned(), e.ref_count, e.hbm_index));
    }
}

#[test]
fn only_user_actions_are_traced() {
    let sink = Arc::new(Collect::default());
    trace::set_sink(Some(sink.clone()));
    let name = CString::new("traced").unwrap();
    let key = CString::new("k").unwrap();
    let (mut t, mut set) = (null_mut(), null_mut());
    // SAFETY: valid pointers throughout.
    unsafe {
        assert_eq!(
            nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_HOST, -1, 8, name.as_ptr(), &mut t),
            NRT_SUCCESS
        );
        assert_eq!(nrt_allocate_tensor_set(&mut set), NRT_SUCCESS);
        assert_eq!(
            nrt_add_tensor_to_tensor_set(set, key.as_ptr(), t),
            NRT_SUCCESS
        );
        assert_eq!(nrt_tensor_get_size(t), 8);
        assert_eq!(nrt_tensor_memset(t, 0, 1, 8), NRT_SUCCESS);
        nrt_destroy_tensor_set(&mut set);
        nrt_tensor_free(&mut t);
    }
    trace::set_sink(None);
    let seen = sink.0.lock().unwrap().clone();
    let ops: Vec<(TraceOp, Phase)> = seen.iter().map(|e| (e.0, e.1)).collect();
    assert_eq!(
        ops,
        [
            (TraceOp::Alloc, Phase::Begin),
            (TraceOp::Alloc, Phase::End),
            (TraceOp::Memset, Phase::Begin),
            (TraceOp::Memset, Phase::End),
            (TraceOp::Free, Phase::Begin),
            (TraceOp::Free, Phase::End),
        ],
        "{seen:?}"
    );
    // The free payload: the last reference, of host memory.
    assert_eq!(
        seen[4],
        (TraceOp::Free, Phase::Begin, "traced".into(), 1, -1)
    );
}
