// SPDX-License-Identifier: GPL-2.0

//! Kernel mirror of `uapi/tdrv.h`, the ioctl ABI.
//!
//! Every struct is `#[repr(C)]` with the header's field order; the
//! `const_assert_layout!` blocks pin sizes and offsets at compile time, and
//! userspace tests pin the same numbers against the C compiler, so the two
//! sides cannot drift apart silently.
//!
//! [`ArgBuf`] implements the header's growth rule: the caller's struct size
//! (from the request number) may be larger than ours as long as the bytes we
//! do not know are zero.

use kernel::{
    ioctl::{
        _IOC_DIR,
        _IOC_NR,
        _IOC_SIZE,
        _IOC_TYPE,
        _IOR,
        _IOW,
        _IOWR, //
    },
    prelude::*,
    transmute::{
        AsBytes,
        FromBytes, //
    },
    uaccess::{
        UserPtr,
        UserSlice, //
    }, //
};

use crate::glue;

pub(crate) const ABI_MAJOR: u32 = 1;
pub(crate) const ABI_MINOR: u32 = 6;

pub(crate) const FEAT_MMAP: u64 = 1 << 0;
pub(crate) const FEAT_SUBMIT: u64 = 1 << 1;
pub(crate) const FEAT_COMPLETION: u64 = 1 << 2;
pub(crate) const FEAT_IRQ: u64 = 1 << 3;
pub(crate) const FEAT_ERROR_LATCH: u64 = 1 << 4;
pub(crate) const FEAT_DMABUF: u64 = 1 << 5;
pub(crate) const FEAT_FENCE_FD: u64 = 1 << 6;
pub(crate) const FEAT_BUF_ID: u64 = 1 << 7;
pub(crate) const FEAT_EVENTS: u64 = 1 << 8;
pub(crate) const FEAT_IMPLICIT_SYNC: u64 = 1 << 9;
pub(crate) const FEAT_SUBMIT_NOTIFY: u64 = 1 << 10;

/// Jobs of a file whose outcome `TDRV_IOC_JOB_WAIT` can still report:
/// `TDRV_JOB_WINDOW`. Older ids get ESTALE.
pub(crate) const JOB_WINDOW: u64 = 4096;

pub(crate) const MAX_EVENTS: u32 = 65536;
pub(crate) const EVENT_JOB_DONE: u32 = 1;

pub(crate) const SUBMIT_OUT_FENCE: u32 = 1 << 0;
pub(crate) const SUBMIT_NOTIFY: u32 = 1 << 1;
pub(crate) const MAX_IN_FENCES: u32 = 64;

pub(crate) const DEVICE_SOFT: u32 = 1;
pub(crate) const DEVICE_EDU: u32 = 2;
pub(crate) const DEVICE_SIM: u32 = 3;

pub(crate) const MAX_BUFFER_SIZE: u64 = 1 << 30;
pub(crate) const MAX_JOB_DESCS: u32 = 1024;
pub(crate) const MAX_JOB_BYTES: u64 = 1 << 32;

pub(crate) const JOB_PENDING: u32 = 1;
pub(crate) const JOB_DONE: u32 = 2;

pub(crate) const FENCE_READS: u32 = 1 << 0;
pub(crate) const FENCE_WRITES: u32 = 1 << 1;
pub(crate) const FENCE_ALL: u32 = FENCE_READS | FENCE_WRITES;

/// Largest argument struct a caller may send: anything bigger is surely a
/// bug, and bounding it bounds the zero-check of unknown trailing bytes.
const MAX_ARG_SIZE: usize = 4096;

macro_rules! uapi_struct {
    ($(#[$doc:meta])* $name:ident { $($field:ident: $ty:ty),* $(,)? }) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        pub(crate) struct $name {
            $(pub(crate) $field: $ty,)*
        }
        // SAFETY: `repr(C)` with integer fields only, laid out without
        // padding (checked by the layout asserts below): every bit pattern
        // is valid and no byte is uninitialised.
        unsafe impl FromBytes for $name {}
        // SAFETY: as above.
        unsafe impl AsBytes for $name {}
    };
}

uapi_struct!(
    /// `struct tdrv_version`
    Version {
        abi_major: u32,
        abi_minor: u32,
        features: u64,
        device_kind: u32,
        num_channels: u32,
        max_buffer_size: u64,
        reserved: [u64; 4],
    }
);
uapi_struct!(
    /// `struct tdrv_channel_info`
    ChannelInfo {
        channel: u32,
        pad: u32,
        limit_bytes: u64,
        used_bytes: u64,
        peak_bytes: u64,
        buffers: u64,
        failed_allocs: u64,
        reserved: [u64; 2],
    }
);
uapi_struct!(
    /// `struct tdrv_alloc`
    Alloc {
        size: u64,
        channel: u32,
        flags: u32,
        handle: u64,
        dma_addr: u64,
        mmap_offset: u64,
        reserved: [u64; 2],
    }
);
uapi_struct!(
    /// `struct tdrv_free`
    Free { handle: u64, reserved: u64 }
);
uapi_struct!(
    /// `struct tdrv_buf_info`
    BufInfo {
        handle: u64,
        size: u64,
        dma_addr: u64,
        mmap_offset: u64,
        pending_reads: u64,
        pending_writes: u64,
        completion_count: u64,
        channel: u32,
        pad: u32,
        error: i32,
        pad2: u32,
        buf_id: u64,
    }
);
uapi_struct!(
    /// `struct tdrv_xfer`
    Xfer {
        handle: u64,
        offset: u64,
        size: u64,
        user_ptr: u64,
        reserved: [u64; 2],
    }
);
uapi_struct!(
    /// `struct tdrv_memset`
    Memset {
        handle: u64,
        offset: u64,
        size: u64,
        value: u32,
        pad: u32,
        reserved: [u64; 2],
    }
);
uapi_struct!(
    /// `struct tdrv_copy_desc`
    CopyDesc {
        src_handle: u64,
        src_offset: u64,
        dst_handle: u64,
        dst_offset: u64,
        size: u64,
    }
);
uapi_struct!(
    /// `struct tdrv_copy`
    Copy { desc: CopyDesc, reserved: [u64; 2] }
);
uapi_struct!(
    /// `struct tdrv_submit`
    Submit {
        descs: u64,
        desc_count: u32,
        desc_size: u32,
        flags: u32,
        pad: u32,
        job_id: u64,
        reserved: [u64; 2],
        in_fences: u64,
        in_fence_count: u32,
        out_fence: i32,
        user_data: u64,
    }
);
uapi_struct!(
    /// `struct tdrv_job_wait`
    JobWait {
        job_id: u64,
        timeout_us: i64,
        state: u32,
        status: i32,
        reserved: [u64; 2],
    }
);
uapi_struct!(
    /// `struct tdrv_fence_wait`
    FenceWait {
        handle: u64,
        timeout_us: i64,
        kind: u32,
        pad: u32,
        reserved: [u64; 2],
    }
);
uapi_struct!(
    /// `struct tdrv_completion_wait`
    CompletionWait {
        handle: u64,
        expected: u64,
        timeout_us: i64,
        count: u64,
        reserved: [u64; 2],
    }
);
uapi_struct!(
    /// `struct tdrv_completion_reset`
    CompletionReset { handle: u64, reserved: u64 }
);
uapi_struct!(
    /// `struct tdrv_export`
    Export {
        handle: u64,
        flags: u32,
        fd: i32,
        pad: u32,
        pad2: u32,
        reserved: [u64; 2],
    }
);
uapi_struct!(
    /// `struct tdrv_import`
    Import {
        fd: i32,
        channel: u32,
        flags: u32,
        pad: u32,
        handle: u64,
        size: u64,
        mmap_offset: u64,
        reserved: [u64; 2],
    }
);
uapi_struct!(
    /// `struct tdrv_job_notify`
    JobNotify {
        job_id: u64,
        user_data: u64,
        reserved: [u64; 2],
    }
);
uapi_struct!(
    /// `struct tdrv_event`
    Event {
        kind: u32,
        status: i32,
        job_id: u64,
        user_data: u64,
    }
);

macro_rules! const_assert_layout {
    ($ty:ident, $size:expr, { $($field:ident @ $off:expr),* $(,)? }) => {
        const _: () = {
            assert!(core::mem::size_of::<$ty>() == $size);
            $(assert!(core::mem::offset_of!($ty, $field) == $off);)*
        };
    };
}

const_assert_layout!(Version, 64, {
    abi_major @ 0, abi_minor @ 4, features @ 8, device_kind @ 16,
    num_channels @ 20, max_buffer_size @ 24, reserved @ 32,
});
const_assert_layout!(ChannelInfo, 64, {
    channel @ 0, pad @ 4, limit_bytes @ 8, used_bytes @ 16, peak_bytes @ 24,
    buffers @ 32, failed_allocs @ 40, reserved @ 48,
});
const_assert_layout!(Alloc, 56, {
    size @ 0, channel @ 8, flags @ 12, handle @ 16, dma_addr @ 24,
    mmap_offset @ 32, reserved @ 40,
});
const_assert_layout!(Free, 16, { handle @ 0, reserved @ 8 });
const_assert_layout!(BufInfo, 80, {
    handle @ 0, size @ 8, dma_addr @ 16, mmap_offset @ 24, pending_reads @ 32,
    pending_writes @ 40, completion_count @ 48, channel @ 56, pad @ 60, error @ 64,
    pad2 @ 68, buf_id @ 72,
});
const_assert_layout!(Xfer, 48, {
    handle @ 0, offset @ 8, size @ 16, user_ptr @ 24, reserved @ 32,
});
const_assert_layout!(Memset, 48, {
    handle @ 0, offset @ 8, size @ 16, value @ 24, pad @ 28, reserved @ 32,
});
const_assert_layout!(CopyDesc, 40, {
    src_handle @ 0, src_offset @ 8, dst_handle @ 16, dst_offset @ 24, size @ 32,
});
const_assert_layout!(Copy, 56, { desc @ 0, reserved @ 40 });
const_assert_layout!(Submit, 72, {
    descs @ 0, desc_count @ 8, desc_size @ 12, flags @ 16, pad @ 20, job_id @ 24,
    reserved @ 32, in_fences @ 48, in_fence_count @ 56, out_fence @ 60, user_data @ 64,
});
const_assert_layout!(JobWait, 40, {
    job_id @ 0, timeout_us @ 8, state @ 16, status @ 20, reserved @ 24,
});
const_assert_layout!(FenceWait, 40, {
    handle @ 0, timeout_us @ 8, kind @ 16, pad @ 20, reserved @ 24,
});
const_assert_layout!(CompletionWait, 48, {
    handle @ 0, expected @ 8, timeout_us @ 16, count @ 24, reserved @ 32,
});
const_assert_layout!(CompletionReset, 16, { handle @ 0, reserved @ 8 });
const_assert_layout!(Export, 40, {
    handle @ 0, flags @ 8, fd @ 12, pad @ 16, pad2 @ 20, reserved @ 24,
});
const_assert_layout!(Import, 56, {
    fd @ 0, channel @ 4, flags @ 8, pad @ 12, handle @ 16, size @ 24,
    mmap_offset @ 32, reserved @ 40,
});
const_assert_layout!(JobNotify, 32, { job_id @ 0, user_data @ 8, reserved @ 16 });
const_assert_layout!(Event, 24, { kind @ 0, status @ 4, job_id @ 8, user_data @ 16 });

pub(crate) const MAGIC: u32 = 0xD7;

pub(crate) const IOC_VERSION: u32 = _IOR::<Version>(MAGIC, 0x00);
pub(crate) const IOC_CHANNEL_INFO: u32 = _IOWR::<ChannelInfo>(MAGIC, 0x01);
pub(crate) const IOC_ALLOC: u32 = _IOWR::<Alloc>(MAGIC, 0x02);
pub(crate) const IOC_FREE: u32 = _IOW::<Free>(MAGIC, 0x03);
pub(crate) const IOC_BUF_INFO: u32 = _IOWR::<BufInfo>(MAGIC, 0x04);
pub(crate) const IOC_COPY_IN: u32 = _IOW::<Xfer>(MAGIC, 0x05);
pub(crate) const IOC_COPY_OUT: u32 = _IOW::<Xfer>(MAGIC, 0x06);
pub(crate) const IOC_MEMSET: u32 = _IOW::<Memset>(MAGIC, 0x07);
pub(crate) const IOC_COPY: u32 = _IOW::<Copy>(MAGIC, 0x08);
pub(crate) const IOC_SUBMIT: u32 = _IOWR::<Submit>(MAGIC, 0x09);
pub(crate) const IOC_JOB_WAIT: u32 = _IOWR::<JobWait>(MAGIC, 0x0A);
pub(crate) const IOC_FENCE_WAIT: u32 = _IOW::<FenceWait>(MAGIC, 0x0B);
pub(crate) const IOC_COMPLETION_WAIT: u32 = _IOWR::<CompletionWait>(MAGIC, 0x0C);
pub(crate) const IOC_COMPLETION_RESET: u32 = _IOW::<CompletionReset>(MAGIC, 0x0D);
pub(crate) const IOC_EXPORT: u32 = _IOWR::<Export>(MAGIC, 0x0E);
pub(crate) const IOC_IMPORT: u32 = _IOWR::<Import>(MAGIC, 0x0F);
pub(crate) const IOC_JOB_NOTIFY: u32 = _IOW::<JobNotify>(MAGIC, 0x10);

// The numbers userspace pins (uapi/src/tests.rs), checked here as well.
const _: () = {
    assert!(IOC_VERSION == 0x8040_D700);
    assert!(IOC_ALLOC == 0xC038_D702);
    assert!(IOC_FREE == 0x4010_D703);
    assert!(IOC_COMPLETION_RESET == 0x4010_D70D);
    assert!(IOC_JOB_NOTIFY == 0x4020_D710);
};

/// ECANCELED: a job of a closed file that did not run (to its end).
/// (7.2 names no constant for it.)
pub(crate) fn ecanceled() -> Error {
    Error::from_errno(-(kernel::bindings::ECANCELED as i32))
}

/// EOPNOTSUPP: fence fds on a kernel without `sync_file`.
pub(crate) fn eopnotsupp() -> Error {
    Error::from_errno(-(kernel::bindings::EOPNOTSUPP as i32))
}

/// ESTALE: JOB_WAIT on an id older than the retained window.
pub(crate) fn estale() -> Error {
    Error::from_errno(-(kernel::bindings::ESTALE as i32))
}

/// Returns true if any of `words` is non-zero (reserved-field check).
pub(crate) fn any_nonzero(words: &[u64]) -> bool {
    words.iter().any(|w| *w != 0)
}

/// The argument of one ioctl call: its user address and the size the
/// caller's request number declares.
///
/// The growth rule of `tdrv.h`: a caller's struct may be smaller than ours
/// (an older binary, down to the first published size, which for every
/// struct of ABI 1.0 is its current size) or larger (a newer one, whose
/// extra bytes must be zero on input). Input copies the smaller of the two
/// sizes and zero-extends; output writes back the smaller of the two.
pub(crate) struct ArgBuf {
    addr: usize,
    size: usize,
}

/// Sizes of the first published version of each argument struct.
pub(crate) trait FirstSize {
    /// The struct's size in ABI 1.0.
    const FIRST_SIZE: usize;
}

macro_rules! first_size {
    ($($ty:ident),* $(,)?) => {
        $(impl FirstSize for $ty {
            const FIRST_SIZE: usize = core::mem::size_of::<$ty>();
        })*
    };
}
first_size!(
    Version,
    ChannelInfo,
    Alloc,
    Free,
    BufInfo,
    Xfer,
    Memset,
    Copy,
    JobWait,
    FenceWait,
    CompletionWait,
    CompletionReset,
    Export,
    Import,
    JobNotify,
);

// `struct tdrv_submit` grew in ABI 1.2 (fence fds); 1.0 callers send 48
// bytes.
impl FirstSize for Submit {
    const FIRST_SIZE: usize = 48;
}

/// Largest argument struct of this ABI (bounds the stack copy below).
const MAX_OUR_SIZE: usize = 128;

impl ArgBuf {
    /// Matches `cmd` against the canonical request `known` by type, number
    /// and direction; the size may differ (see [`ArgBuf::read`]).
    pub(crate) fn matches(cmd: u32, known: u32) -> bool {
        _IOC_TYPE(cmd) == _IOC_TYPE(known)
            && _IOC_NR(cmd) == _IOC_NR(known)
            && _IOC_DIR(cmd) == _IOC_DIR(known)
    }

    pub(crate) fn new(cmd: u32, addr: usize) -> Self {
        Self {
            addr,
            size: _IOC_SIZE(cmd),
        }
    }

    /// Checks the caller's size for `T`: EINVAL below the first published
    /// size or above `MAX_ARG_SIZE`. All an output-only struct needs.
    pub(crate) fn check_size<T: FirstSize>(&self) -> Result {
        if self.size < T::FIRST_SIZE || self.size > MAX_ARG_SIZE {
            return Err(EINVAL);
        }
        Ok(())
    }

    /// Whether the caller's struct reaches byte `end` of ours: a field
    /// added after the caller's version is neither read nor written back.
    pub(crate) fn reaches(&self, end: usize) -> bool {
        self.size >= end
    }

    /// Reads a `T` under the growth rule: E2BIG if bytes past ours are not
    /// zero; fields the caller's (older) struct lacks read as zero.
    pub(crate) fn read<T: FromBytes + FirstSize>(&self) -> Result<T> {
        const { assert!(core::mem::size_of::<T>() <= MAX_OUR_SIZE) };
        self.check_size::<T>()?;
        let ours = core::mem::size_of::<T>();
        let mut reader = UserSlice::new(UserPtr::from_addr(self.addr), self.size).reader();
        if self.size == ours {
            // The usual case, a caller of our ABI version: one copy.
            return reader.read();
        }
        let mut bytes = [0u8; MAX_OUR_SIZE];
        reader.read_slice(&mut bytes[..ours.min(self.size)])?;
        let mut rest = [0u8; 64];
        while !reader.is_empty() {
            let n = reader.len().min(rest.len());
            reader.read_slice(&mut rest[..n])?;
            if rest[..n].iter().any(|b| *b != 0) {
                return Err(E2BIG);
            }
        }
        T::from_bytes_copy(&bytes[..ours]).ok_or(EINVAL)
    }

    /// Whether the caller's struct has exactly the size of our `T`: then a
    /// handler may use [`ArgBuf::read_words`] and [`ArgBuf::write_words`],
    /// with the result [`ArgBuf::read`] and [`ArgBuf::write`] would give.
    pub(crate) fn is_exactly<T>(&self) -> bool {
        self.size == core::mem::size_of::<T>()
    }

    /// Reads the caller's struct, of exactly our size, a 64-bit word at a
    /// time ([`glue::get_user_words`]): for small, hot ioctls.
    pub(crate) fn read_words<T: FromBytes>(&self) -> Result<T> {
        if !self.is_exactly::<T>() {
            return Err(EINVAL);
        }
        glue::get_user_words(self.addr)
    }

    /// Writes the 64-bit words `words` of `value` over the caller's struct,
    /// of exactly our size, a word at a time ([`glue::put_user_words`]).
    pub(crate) fn write_words<T: AsBytes>(
        &self,
        value: &T,
        words: core::ops::Range<usize>,
    ) -> Result {
        if !self.is_exactly::<T>() {
            return Err(EINVAL);
        }
        glue::put_user_words(self.addr, value, words)
    }

    /// [`ArgBuf::read`], a word at a time ([`ArgBuf::read_words`]) for a
    /// caller of exactly our size: for the hot ioctls.
    pub(crate) fn read_fast<T: FromBytes + FirstSize>(&self) -> Result<T> {
        if self.is_exactly::<T>() {
            self.read_words()
        } else {
            self.read()
        }
    }

    /// Writes `value` back: for a caller of exactly our size only its
    /// words `out` (those of the out fields; the others still hold what
    /// the caller passed), a word at a time ([`ArgBuf::write_words`]),
    /// else as [`ArgBuf::write`]. The result is the same.
    pub(crate) fn write_fast<T: AsBytes>(&self, value: &T, out: core::ops::Range<usize>) -> Result {
        if self.is_exactly::<T>() {
            self.write_words(value, out)
        } else {
            self.write(value)
        }
    }

    /// Writes `value` back over the first `min(size_of::<T>(), caller's
    /// size)` bytes of the caller's struct; the caller's further bytes are
    /// left alone (they are ours to ignore, not to define).
    pub(crate) fn write<T: AsBytes>(&self, value: &T) -> Result {
        let n = core::mem::size_of::<T>().min(self.size);
        UserSlice::new(UserPtr::from_addr(self.addr), n)
            .writer()
            .write_slice(&value.as_bytes()[..n])
    }
}
