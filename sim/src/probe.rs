//! Host memcpy probes: the host's own copy rate, timed by the simulator
//! while a guest runs, as the baseline of `make bench`'s figure 9s (the
//! device's DMA against a plain memcpy on the same host at the same
//! time). A probe runs when the driver asks for it (the `MEMCPY_PROBE`
//! command of `inject[q]`, debugfs `inject memcpy_probe`), on the queue
//! thread, before the queue's next descriptor: a guest brackets its probe
//! with a job, so that it runs between the rows it measures, never
//! during one.

use std::time::Instant;

/// Bytes a probe copies: a copy that does not fit the host's caches, as
/// the DMA rows of 16 MiB do not.
pub const PROBE_BYTES: usize = 16 << 20;

/// Probe results a queue keeps; later probes are counted but not kept
/// (the guest decides how many it asks for).
pub const PROBES_KEPT: usize = 4096;

/// Two buffers of `PROBE_BYTES` and the probes timed with them. The
/// buffers are allocated and faulted in by the first probe.
#[derive(Default)]
pub struct MemcpyProbe {
    bufs: Option<(Vec<u8>, Vec<u8>)>,
}

impl MemcpyProbe {
    /// Host nanoseconds of one copy of `PROBE_BYTES` between the two
    /// buffers.
    pub fn run(&mut self) -> u64 {
        let (src, dst) = self.bufs.get_or_insert_with(|| {
            let src = vec![0x5au8; PROBE_BYTES];
            let mut dst = vec![0u8; PROBE_BYTES];
            // Faults `dst`'s pages in, outside the timed copy.
            dst.copy_from_slice(&src);
            (src, dst)
        });
        copy_ns(src, dst)
    }
}

/// Host nanoseconds of one copy of `src` into `dst`.
fn copy_ns(src: &[u8], dst: &mut [u8]) -> u64 {
    let t = Instant::now();
    dst.copy_from_slice(std::hint::black_box(src));
    std::hint::black_box(&mut *dst);
    t.elapsed().as_nanos() as u64
}

/// Median host nanoseconds of `rounds` copies of `bytes` between two
/// buffers of this process (after one copy that faults their pages in).
pub fn host_memcpy_ns(bytes: usize, rounds: usize) -> u64 {
    let src = vec![0x5au8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let mut ns: Vec<u64> = (0..rounds).map(|_| copy_ns(&src, &mut dst)).collect();
    ns.sort_unstable();
    ns[rounds / 2]
}
