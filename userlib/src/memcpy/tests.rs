use super::*;
use crate::compat::TensorCompat;
use crate::ops::TensorOps;

use NeuronMemcpyMethod::{CMemcpy, Dma, VecMemcpy};

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

fn host_tensor(bytes: &[u8]) -> Tensor {
    let t = Tensor::allocate_host(bytes.len(), Some("memcpy test")).unwrap();
    t.write(0, bytes).unwrap();
    t
}

#[test]
fn enum_values_are_the_seed() {
    assert_eq!(CMemcpy as u32, 0);
    assert_eq!(VecMemcpy as u32, 1);
    assert_eq!(Dma as u32, 2);
    assert_eq!(MAX_METHODS, 3);
    assert_eq!(DEFAULT_METHOD, Dma);
    assert_eq!(NeuronMemcpyMethod::from_raw(MAX_METHODS), None);
    for m in NeuronMemcpyMethod::ALL {
        assert_eq!(NeuronMemcpyMethod::from_raw(m as u32), Some(m));
    }
}

/// The only test that changes the process-wide method: it checks the
/// default, switches through every method and puts the default back.
#[test]
fn method_is_switchable_at_run_time() {
    assert_eq!(neuron_get_memcpy_method(), DEFAULT_METHOD);
    let src = pattern(1000, 3);
    let t = host_tensor(&src);
    for m in NeuronMemcpyMethod::ALL {
        neuron_set_memcpy_method(m);
        assert_eq!(neuron_get_memcpy_method(), m);
        let mut dst = vec![0; src.len()];
        let used = neuron_memcpy_read(&mut dst, &t, 0).unwrap();
        // DMA cannot reach host memory: the fallback is the vector copy.
        assert_eq!(used, if m == Dma { VecMemcpy } else { m });
        assert_eq!(dst, src);
    }
    neuron_set_memcpy_method(DEFAULT_METHOD);
}

/// Each method, both directions, on Malloc tensors, at odd offsets and
/// lengths: the bytes arrive exactly and nothing around them changes.
#[test]
fn every_method_is_byte_exact_on_malloc_tensors() {
    let size = 3 * 4096 + 77;
    let src = pattern(size, 11);
    for m in NeuronMemcpyMethod::ALL {
        for (off, len) in [(0, size), (1, 4096), (4095, 4097), (size - 1, 1), (17, 0)] {
            let t = host_tensor(&src);
            // Tensor to local buffer, at local offset 5.
            let mut local = LocalBuffer::host(len + 10).unwrap();
            assert!(!local.is_device());
            let used = neuron_memcpy_from_tensor_with(m, &mut local, 5, &t, off, len).unwrap();
            assert_eq!(used, if m == Dma { VecMemcpy } else { m });
            assert_eq!(&local.as_slice()[5..5 + len], &src[off..off + len], "{m:?}");
            assert!(local.as_slice()[..5].iter().all(|&b| b == 0));
            assert!(local.as_slice()[5 + len..].iter().all(|&b| b == 0));

            // Local buffer to tensor.
            let fresh = pattern(len + 10, 200);
            local.as_mut_slice().copy_from_slice(&fresh);
            neuron_memcpy_to_tensor_with(m, &t, off, &local, 5, len).unwrap();
            let mut want = src.clone();
            want[off..off + len].copy_from_slice(&fresh[5..5 + len]);
            assert_eq!(t.to_vec().unwrap(), want, "{m:?} {off} {len}");

            // Plain slices.
            let mut out = vec![0; len];
            neuron_memcpy_read_with(m, &mut out, &t, off).unwrap();
            assert_eq!(out, want[off..off + len]);
            let back = pattern(len, 99);
            neuron_memcpy_write_with(m, &t, off, &back).unwrap();
            want[off..off + len].copy_from_slice(&back);
            assert_eq!(t.to_vec().unwrap(), want);
        }
    }
}

#[test]
fn slices_of_a_tensor_are_addressed_from_their_own_start() {
    let src = pattern(8192, 1);
    let whole = host_tensor(&src);
    let part = whole.slice(1000, 3000, None).unwrap();
    for m in NeuronMemcpyMethod::ALL {
        let mut out = vec![0; 100];
        neuron_memcpy_read_with(m, &mut out, &part, 2900).unwrap();
        assert_eq!(out, src[3900..4000]);
        // The slice's end is the limit, not the storage's.
        assert!(matches!(
            neuron_memcpy_read_with(m, &mut out, &part, 2901),
            Err(Error::OutOfBounds { .. })
        ));
    }
}

#[test]
fn ranges_are_checked_on_both_sides() {
    let t = host_tensor(&pattern(100, 0));
    let mut local = LocalBuffer::host(50).unwrap();
    for m in NeuronMemcpyMethod::ALL {
        assert!(matches!(
            neuron_memcpy_from_tensor_with(m, &mut local, 0, &t, 60, 50),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            neuron_memcpy_from_tensor_with(m, &mut local, 1, &t, 0, 50),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            neuron_memcpy_to_tensor_with(m, &t, usize::MAX, &local, 0, 2),
            Err(Error::Overflow { .. })
        ));
        assert!(matches!(
            neuron_memcpy_to_tensor_with(m, &t, 0, &local, usize::MAX, 2),
            Err(Error::Overflow { .. })
        ));
    }
    assert!(matches!(
        neuron_memcpy_read(&mut [0; 4], &Tensor::allocate_empty(None).unwrap(), 0),
        Err(Error::NoStorage { .. })
    ));
}

#[test]
fn fake_tensors_read_as_zeros_and_discard_writes() {
    let t = Tensor::allocate_fake(64, None).unwrap();
    for m in NeuronMemcpyMethod::ALL {
        let mut out = [7u8; 8];
        neuron_memcpy_write_with(m, &t, 8, &out).unwrap();
        neuron_memcpy_read_with(m, &mut out, &t, 8).unwrap();
        assert_eq!(out, [0; 8], "{m:?}: a fake tensor reads as zeros");
    }
}

/// Without a device the staging buffer is host memory, whatever the method.
#[test]
fn staging_for_a_host_tensor_is_host_memory() {
    let t = host_tensor(&[0; 16]);
    let b = LocalBuffer::staging_for(&t, 4096).unwrap();
    assert!(!b.is_device());
    assert_eq!(b.len(), 4096);
    assert_eq!(b.as_ptr() as usize % HOST_ALIGN, 0);
    assert!(LocalBuffer::host(0).unwrap().is_empty());
    assert!(!vec_memcpy_kernel().is_empty());
}

/// A copy waits for in-flight device writes of a host tensor (the fences
/// of the tensor layer apply to every method).
#[test]
fn copies_wait_for_async_writers() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let t = host_tensor(&[1; 64]);
    t.mark_async_start(crate::Access::Write).unwrap();
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let (t2, done2) = (t.clone(), done.clone());
    let reader = std::thread::spawn(move || {
        let mut out = [0; 64];
        neuron_memcpy_read_with(VecMemcpy, &mut out, &t2, 0).unwrap();
        done2.store(true, Ordering::SeqCst);
        out
    });
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(
        !done.load(Ordering::SeqCst),
        "read did not wait for the writer"
    );
    // Stand in for the device's write: through the host address.
    let data = [9u8; 64];
    {
        let ptr = t.va().unwrap().as_ptr();
        // SAFETY: 64 bytes of the tensor's own allocation; the only other
        // access (the reader) is blocked on the fence until the finish mark.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, 64) };
    }
    t.mark_async_finish(crate::Access::Write).unwrap();
    assert_eq!(reader.join().unwrap(), data);
}

/// A device staging buffer lends its bytes (`as_slice`, and `TcmBuffer`'s
/// deref over it) while the safe raw calls take any handle, also one found
/// by probing `buf_info`: the buffer is pinned for its life, so every one
/// of them is refused and the lent bytes do not change. Its own DMA copies
/// still go through. (Before the pin, MEMSET changed the bytes under the
/// live slice, and Miri reported the write through the fake device's
/// block as undefined behaviour.)
#[test]
fn a_device_staging_buffer_refuses_raw_writes_while_it_lends_bytes() {
    let (dev, fake) = Device::fake();
    let t = Tensor::allocate_on(&dev, 0, 64, Some("src")).unwrap();
    t.write(0, &pattern(64, 4)).unwrap();
    let th = t.dma_handle().unwrap();
    let mut local = LocalBuffer::device(&dev, 0, 64).unwrap();
    assert!(local.is_device());
    {
        let lent = local.as_slice();
        // Probe the file's handles as any code of the process could.
        let probed: Vec<u64> = (1..64).filter(|&h| dev.buf_info(h).is_ok()).collect();
        assert_eq!(probed.len(), 2, "the tensor and the staging buffer");
        let h = probed.into_iter().find(|&h| h != th).unwrap();
        let pinned = |r: std::result::Result<(), crate::Error>| {
            matches!(r, Err(crate::Error::Sys(SysError::Pinned { .. })))
        };
        assert!(pinned(dev.memset(h, 0, 64, 0xff)), "MEMSET");
        assert!(pinned(dev.copy_in(h, 0, &[0xee; 64])), "COPY_IN");
        let desc = tdrv_copy_desc {
            src_handle: th,
            src_offset: 0,
            dst_handle: h,
            dst_offset: 0,
            size: 64,
        };
        assert!(pinned(dev.copy(&desc)), "COPY");
        assert!(pinned(dev.submit(&[desc]).map(drop)), "SUBMIT");
        assert!(pinned(dev.export(h).map(drop)), "EXPORT");
        assert_eq!(lent, [0; 64], "the lent bytes did not change");
        // Reading it is no write: allowed.
        let mut out = [1u8; 64];
        dev.copy_out(h, 0, &mut out).unwrap();
        assert_eq!(out, [0; 64]);
    }
    // The buffer's own copies, made while it is borrowed `&mut`, go.
    let used = neuron_memcpy_from_tensor_with(Dma, &mut local, 0, &t, 0, 64).unwrap();
    assert_eq!(used, Dma);
    assert_eq!(local.as_slice(), pattern(64, 4));
    local.as_mut_slice().fill(3);
    assert_eq!(
        neuron_memcpy_to_tensor_with(Dma, &t, 8, &local, 0, 8).unwrap(),
        Dma
    );
    assert_eq!(
        t.to_vec().unwrap()[6..18],
        [
            pattern(64, 4)[6],
            pattern(64, 4)[7],
            3,
            3,
            3,
            3,
            3,
            3,
            3,
            3,
            pattern(64, 4)[16],
            pattern(64, 4)[17]
        ]
    );
    // Dropping it unpins and frees it: the handle is gone, and the
    // tensor's own buffer was never pinned by it.
    drop(local);
    assert_eq!(fake.live_handles(), 1);
    t.memset(0, 1, 64).unwrap();
}
