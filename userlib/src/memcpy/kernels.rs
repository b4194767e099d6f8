//! The CPU copy kernels behind C_MEMCPY and VEC_MEMCPY.

/// C_MEMCPY: a plain copy through the mapping (the C library's memcpy).
///
/// # Safety
/// `src` is readable and `dst` writable for `n` bytes, and they do not overlap.
pub(crate) unsafe fn c_memcpy(dst: *mut u8, src: *const u8, n: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) }
}

/// VEC_MEMCPY: an explicitly vectorised copy. On x86_64 it moves 128 bytes
/// per iteration with AVX2 when the CPU has it (detected once, at run
/// time) and with SSE2 otherwise (always present on x86_64); elsewhere it
/// moves 16-byte `u128` words. Loads and stores are unaligned, so any
/// offsets work.
///
/// # Safety
/// As [`c_memcpy`].
pub(crate) unsafe fn vec_memcpy(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked above); the pointers are
            // valid for `n` bytes (caller).
            return unsafe { x86::copy_avx2(dst, src, n) };
        }
        // SAFETY: SSE2 is part of the x86_64 baseline; pointers as above.
        unsafe { x86::copy_sse2(dst, src, n) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // SAFETY: forwarded from the caller.
        unsafe { copy_words(dst, src, n) }
    }
}

/// Which kernel [`vec_memcpy`] runs on this CPU.
pub(crate) fn vec_kernel_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            "avx2"
        } else {
            "sse2"
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        "u128"
    }
}

/// Portable wide copy: 16-byte words, then the tail byte by byte.
///
/// # Safety
/// As [`c_memcpy`].
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
pub(crate) unsafe fn copy_words(dst: *mut u8, src: *const u8, n: usize) {
    const W: usize = std::mem::size_of::<u128>();
    let mut i = 0;
    while i + W <= n {
        // SAFETY: `i + W <= n`, so both ranges are in bounds (caller);
        // unaligned accesses make any offset valid.
        unsafe {
            let v = src.add(i).cast::<u128>().read_unaligned();
            dst.add(i).cast::<u128>().write_unaligned(v);
        }
        i += W;
    }
    while i < n {
        // SAFETY: `i < n`, in bounds (caller).
        unsafe { *dst.add(i) = *src.add(i) };
        i += 1;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256i, _mm256_loadu_si256, _mm256_storeu_si256, _mm_loadu_si128,
        _mm_storeu_si128,
    };

    /// # Safety
    /// The CPU supports AVX2; pointers as in `c_memcpy`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn copy_avx2(dst: *mut u8, src: *const u8, n: usize) {
        let mut i = 0;
        while i + 128 <= n {
            // SAFETY: bytes i..i+128 are in bounds of both (caller); the
            // intrinsics take unaligned pointers.
            unsafe {
                let s = src.add(i).cast::<__m256i>();
                let d = dst.add(i).cast::<__m256i>();
                let a = _mm256_loadu_si256(s);
                let b = _mm256_loadu_si256(s.add(1));
                let c = _mm256_loadu_si256(s.add(2));
                let e = _mm256_loadu_si256(s.add(3));
                _mm256_storeu_si256(d, a);
                _mm256_storeu_si256(d.add(1), b);
                _mm256_storeu_si256(d.add(2), c);
                _mm256_storeu_si256(d.add(3), e);
            }
            i += 128;
        }
        while i + 32 <= n {
            // SAFETY: bytes i..i+32 are in bounds (caller).
            unsafe {
                let v = _mm256_loadu_si256(src.add(i).cast());
                _mm256_storeu_si256(dst.add(i).cast(), v);
            }
            i += 32;
        }
        // SAFETY: the rest, i..n, is in bounds (caller).
        unsafe { copy_tail(dst.add(i), src.add(i), n - i) }
    }

    /// # Safety
    /// Pointers as in `c_memcpy` (SSE2 is baseline on x86_64).
    pub(super) unsafe fn copy_sse2(dst: *mut u8, src: *const u8, n: usize) {
        let mut i = 0;
        while i + 64 <= n {
            // SAFETY: bytes i..i+64 are in bounds of both (caller); the
            // intrinsics take unaligned pointers.
            unsafe {
                let s = src.add(i).cast::<__m128i>();
                let d = dst.add(i).cast::<__m128i>();
                let a = _mm_loadu_si128(s);
                let b = _mm_loadu_si128(s.add(1));
                let c = _mm_loadu_si128(s.add(2));
                let e = _mm_loadu_si128(s.add(3));
                _mm_storeu_si128(d, a);
                _mm_storeu_si128(d.add(1), b);
                _mm_storeu_si128(d.add(2), c);
                _mm_storeu_si128(d.add(3), e);
            }
            i += 64;
        }
        // SAFETY: the rest, i..n, is in bounds (caller).
        unsafe { copy_tail(dst.add(i), src.add(i), n - i) }
    }

    /// Fewer than 64 bytes: 16-byte SSE2 words, then single bytes.
    ///
    /// # Safety
    /// Pointers as in `c_memcpy`.
    unsafe fn copy_tail(dst: *mut u8, src: *const u8, n: usize) {
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: bytes i..i+16 are in bounds (caller).
            unsafe {
                let v = _mm_loadu_si128(src.add(i).cast());
                _mm_storeu_si128(dst.add(i).cast(), v);
            }
            i += 16;
        }
        while i < n {
            // SAFETY: `i < n`, in bounds (caller).
            unsafe { *dst.add(i) = *src.add(i) };
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// Every kernel, every length around its block sizes, every source and
    /// destination misalignment: the copied range matches and the bytes
    /// around it are untouched.
    #[test]
    fn kernels_are_byte_exact_at_any_length_and_offset() {
        type Kernel = unsafe fn(*mut u8, *const u8, usize);
        let mut kernels: Vec<(&str, Kernel)> =
            vec![("c", c_memcpy), ("vec", vec_memcpy), ("words", copy_words)];
        #[cfg(target_arch = "x86_64")]
        {
            kernels.push(("sse2", x86::copy_sse2));
            if std::is_x86_feature_detected!("avx2") {
                kernels.push(("avx2", x86::copy_avx2));
            }
        }
        let src = pattern(1024, 7);
        for (name, kernel) in kernels {
            // Under Miri: the lengths around each kernel's word sizes only.
            let lens: Vec<usize> = if cfg!(miri) {
                vec![0, 1, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 513]
            } else {
                (0..300).chain([511, 512, 513, 1000]).collect()
            };
            let offsets: &[usize] = if cfg!(miri) { &[0, 3] } else { &[0, 1, 2, 3] };
            for &n in &lens {
                for &so in offsets {
                    for d_off in [0, 1, 3, 17] {
                        let mut dst = vec![0xAAu8; n + 64];
                        // SAFETY: src has >= so+n bytes, dst >= d_off+n,
                        // distinct allocations.
                        unsafe { kernel(dst.as_mut_ptr().add(d_off), src.as_ptr().add(so), n) };
                        assert_eq!(&dst[d_off..d_off + n], &src[so..so + n], "{name} n={n}");
                        assert!(dst[..d_off].iter().all(|&b| b == 0xAA), "{name} n={n}");
                        assert!(dst[d_off + n..].iter().all(|&b| b == 0xAA), "{name} n={n}");
                    }
                }
            }
        }
        assert!(!vec_kernel_name().is_empty());
    }
}
