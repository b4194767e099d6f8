// SPDX-License-Identifier: GPL-2.0

//! Bounds arithmetic for `(offset, size)` ranges inside a buffer.
//!
//! Every ioctl that touches buffer bytes goes through [`checked_range`], so
//! the overflow rule lives in one place: the original driver did not check
//! `offset + size` for overflow at all.

use kernel::prelude::*;

/// A validated byte range `[start, start + len)` inside a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ByteRange {
    pub(crate) start: usize,
    pub(crate) len: usize,
}

/// Checks that `offset + size` neither overflows nor passes `buf_len`.
///
/// Returns `ERANGE` for both, so userspace can tell a bounds error from a
/// malformed argument (`EINVAL`).
pub(crate) fn checked_range(offset: u64, size: u64, buf_len: usize) -> Result<ByteRange> {
    let end = offset.checked_add(size).ok_or(ERANGE)?;
    if end > buf_len as u64 {
        return Err(ERANGE);
    }
    // Both fit in usize: they are bounded by `buf_len`.
    Ok(ByteRange {
        start: offset as usize,
        len: size as usize,
    })
}

/// Returns true if two ranges share at least one byte.
pub(crate) fn overlaps(a: ByteRange, b: ByteRange) -> bool {
    a.len != 0 && b.len != 0 && a.start < b.start + b.len && b.start < a.start + a.len
}

#[kunit_tests(tdrv_range)]
mod tests {
    use super::*;

    #[test]
    fn inside_and_edges() {
        assert_eq!(
            checked_range(0, 4096, 4096),
            Ok(ByteRange {
                start: 0,
                len: 4096
            })
        );
        assert_eq!(
            checked_range(4096, 0, 4096),
            Ok(ByteRange {
                start: 4096,
                len: 0
            })
        );
        assert_eq!(
            checked_range(4095, 1, 4096),
            Ok(ByteRange {
                start: 4095,
                len: 1
            })
        );
        assert_eq!(checked_range(4095, 2, 4096), Err(ERANGE));
        assert_eq!(checked_range(4097, 0, 4096), Err(ERANGE));
    }

    #[test]
    fn overflow_is_rejected() {
        assert_eq!(checked_range(u64::MAX, 1, 4096), Err(ERANGE));
        assert_eq!(checked_range(1, u64::MAX, 4096), Err(ERANGE));
        assert_eq!(checked_range(u64::MAX, u64::MAX, usize::MAX), Err(ERANGE));
        assert_eq!(checked_range(u64::MAX - 1, 2, usize::MAX), Err(ERANGE));
        assert_eq!(
            checked_range(u64::MAX - 1, 1, usize::MAX),
            Ok(ByteRange {
                start: usize::MAX - 1,
                len: 1
            })
        );
    }

    #[test]
    fn overlap() {
        let r = |start, len| ByteRange { start, len };
        assert!(overlaps(r(0, 10), r(9, 1)));
        assert!(!overlaps(r(0, 10), r(10, 1)));
        assert!(!overlaps(r(0, 0), r(0, 10)));
        assert!(overlaps(r(5, 1), r(0, 10)));
    }
}
