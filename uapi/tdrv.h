/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * tdrv: ioctl ABI of the tdrv accelerator driver (/dev/tdrv<N>).
 *
 * This header is the single source of truth for the ABI. The kernel module
 * mirrors it in driver/uapi.rs (with compile-time size and offset asserts);
 * userspace Rust bindings are generated from it by bindgen.
 *
 * Rules every struct follows:
 *  - fixed-width __u types, explicit padding, 8-byte aligned sizes;
 *  - user pointers are passed as __u64;
 *  - fields named "reserved" or "pad" must be zero on input (else EINVAL)
 *    and are zeroed on output;
 *  - structs may grow at the end. The size encoded in the ioctl number is
 *    the caller's struct size: the driver accepts any size from the first
 *    published one (the sizes below: ABI 1.0, or the minor version that
 *    introduced the struct; struct tdrv_submit was 48 bytes in 1.0) up to
 *    4096 bytes. Input
 *    copies the smaller of the caller's and the driver's size and reads
 *    missing fields as zero; bytes the driver does not know must be zero
 *    (else E2BIG). Output is written back up to the smaller of the two
 *    sizes. Output-only structs (TDRV_IOC_VERSION) are not read at all.
 *    TDRV_IOC_VERSION reports the ABI version and feature bits.
 *
 * Errors are negative errno values from ioctl(2) (errno in userspace):
 *  EINVAL   malformed argument (reserved bits, bad flags, zero size,
 *           overlapping source and destination ranges in one buffer, a job
 *           moving more than TDRV_MAX_JOB_BYTES, ...)
 *  E2BIG    unknown trailing struct bytes are non-zero
 *  ENOENT   no such buffer handle in this open file (or it was freed)
 *  ERANGE   offset + size outside the buffer, or overflows 64 bits
 *  EFAULT   a user pointer cannot be read or written
 *  EXDEV    a copy between buffers on different HBM channels
 *  EBADF    IMPORT of an fd, or SUBMIT of an in-fence, that is not open
 *  EOPNOTSUPP IMPORT of a dma-buf tdrv cannot map (see struct tdrv_import);
 *           SUBMIT with fence fds on a kernel without CONFIG_SYNC_FILE
 *  EMFILE   (SUBMIT) no free fd for the out-fence
 *  ENOMEM   no memory; on a device with its own memory (TDRV_DEVICE_SIM),
 *           no free range of device memory is large enough (fragmentation)
 *  ENOSPC   the channel's byte limit, or this file's buffer or byte limit
 *           (module parameters file_max_buffers, file_max_mib), or the
 *           limit of foreign dma-buf imports (file_max_imports,
 *           device_max_imports), or of completion events
 *           (file_max_events, device_max_events), would be exceeded
 *  EAGAIN   this file has too many unfinished jobs, or they would move too
 *           many bytes (file_max_jobs, file_max_inflight_mib): wait for
 *           some to finish and submit again
 *  ETIMEDOUT a timed wait expired, or (as a job status) the device did not
 *           finish the job in time
 *  EINTR    a signal interrupted a timed wait. Waits without a timeout are
 *           restarted after a handler installed with SA_RESTART, and
 *           return EINTR otherwise.
 *  ESTALE   TDRV_IOC_JOB_WAIT or TDRV_IOC_JOB_NOTIFY on a job older than
 *           this file's last TDRV_JOB_WINDOW jobs: its status is no longer
 *           kept
 *  EIO      (job status, or SUBMIT) the device failed and is recovering;
 *           (COPY_IN, COPY_OUT, MEMSET, COPY on TDRV_DEVICE_SIM) the
 *           device's DMA failed the transfer: COPY_IN, MEMSET and COPY
 *           then latch the error in the buffer they wrote (its bytes are
 *           undefined; the same for ETIMEDOUT from the device's watchdog),
 *           COPY_OUT leaves the buffer as it was;
 *           (COPY_OUT, COPY from, FENCE_WAIT, COMPLETION_WAIT) the buffer's
 *           error latch is set: a job or synchronous write that wrote it
 *           failed, so its bytes are undefined, and no write that could
 *           still fix them is pending.
 *           tdrv_buf_info.error tells which errno the job ended with;
 *           (FENCE_WAIT, COMPLETION_WAIT, COPY_IN, COPY_OUT, MEMSET, COPY
 *           on TDRV_DEVICE_SIM) what the call waits for is held up only by
 *           jobs the device abandoned (a queue that ignored its reset, such
 *           as a killed simulator's): they failed, but the device may still
 *           access their buffers, which stay reserved until it lets go or
 *           the device is unbound.
 *  ECANCELED (job status) the job's file was closed before it ended
 *  ENODEV   the device was removed (unbind, hot-unplug). Its open files
 *           then support close(2), read(2) and poll(2) of completion
 *           events (see struct tdrv_job_notify) and TDRV_IOC_VERSION,
 *           which still describes the device it was; every other ioctl
 *           (TDRV_IOC_CHANNEL_INFO included) and mmap(2) fail with ENODEV.
 *           Also (as a job status too): an imported buffer of the call or
 *           job was revoked by its exporter (see struct tdrv_import)
 *  EINTR    (COPY_IN, COPY_OUT on TDRV_DEVICE_SIM) the caller was killed
 *           between two DMA chunks
 *
 * Memory: buffers are charged to their channel (and to the allocating
 * process's memory cgroup) at their size rounded up to pages. A buffer
 * may be made of several DMA-contiguous pieces; buffers up to 4 MiB are
 * one piece when memory allows. dma_addr is the bus address of byte 0 and
 * covers the first piece only. On a device with its own memory
 * (TDRV_DEVICE_SIM) a buffer is one contiguous range of that memory
 * (HBM), dma_addr is its device address, mmap maps it write-combined, and
 * COPY_IN/COPY_OUT move the bytes by the device's DMA straight from and
 * to the caller's pages. Bus addresses are reported only to openers
 * with CAP_SYS_RAWIO; others see 0.
 *
 * Lifetime: a file's mapping keeps the module loaded (rmmod fails while a
 * file is open or a buffer mapped). Closing a file (also by exit or
 * SIGKILL) cancels its jobs: queued ones end with ECANCELED, a running one
 * after the chunk in flight. A chunk is at most 64 MiB: what the engine was
 * already given of the job (TDRV_DEVICE_SIM keeps a job at most 64 MiB
 * ahead of its completions) or is copying (soft, edu).
 */
#ifndef _UAPI_TDRV_H
#define _UAPI_TDRV_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define TDRV_ABI_MAJOR 1
#define TDRV_ABI_MINOR 6

/* Bits of tdrv_version.features. */
#define TDRV_FEAT_MMAP		(1ULL << 0) /* mmap of whole buffers */
#define TDRV_FEAT_SUBMIT	(1ULL << 1) /* asynchronous copy jobs */
#define TDRV_FEAT_COMPLETION	(1ULL << 2) /* completion counters */
#define TDRV_FEAT_IRQ		(1ULL << 3) /* completions signalled by interrupt */
#define TDRV_FEAT_ERROR_LATCH	(1ULL << 4) /* failed jobs latch tdrv_buf_info.error (1.1) */
#define TDRV_FEAT_DMABUF	(1ULL << 5) /* TDRV_IOC_EXPORT and TDRV_IOC_IMPORT (1.2) */
#define TDRV_FEAT_FENCE_FD	(1ULL << 6) /* SUBMIT takes and returns sync_file fds (1.2);
					     * absent on kernels without CONFIG_SYNC_FILE */
#define TDRV_FEAT_BUF_ID	(1ULL << 7) /* tdrv_buf_info.buf_id (1.3) */
#define TDRV_FEAT_EVENTS	(1ULL << 8) /* TDRV_IOC_JOB_NOTIFY, and read(2) and
					     * poll(2) of completion events (1.4);
					     * on every kernel */
#define TDRV_FEAT_IMPLICIT_SYNC	(1ULL << 9) /* jobs take part in their dma-bufs'
					     * reservation objects (1.5; see
					     * struct tdrv_export); on every kernel */
#define TDRV_FEAT_SUBMIT_NOTIFY	(1ULL << 10) /* TDRV_SUBMIT_NOTIFY: SUBMIT asks for
					     * the job's completion event itself
					     * (1.6); on every kernel */

/* tdrv_version.device_kind */
#define TDRV_DEVICE_SOFT	1 /* software device: CPU copy engine */
#define TDRV_DEVICE_EDU		2 /* QEMU edu PCI device: its DMA engine + MSI */
/*
 * TDRV_DEVICE_SIM: the tdrv sim device (QEMU ivshmem-doorbell served by
 * the tdrv-sim process): buffers in device memory (HBM channels behind
 * a BAR), copy jobs run by several DMA queues with per-queue MSI-X
 * completion interrupts. See docs/sim-device.md.
 */
#define TDRV_DEVICE_SIM		3

/* Largest buffer one TDRV_IOC_ALLOC may request. */
#define TDRV_MAX_BUFFER_SIZE	(1ULL << 30)
/* Most descriptors one TDRV_IOC_SUBMIT may carry. */
#define TDRV_MAX_JOB_DESCS	1024
/* Most bytes one job may move (sum of its descriptors' sizes). */
#define TDRV_MAX_JOB_BYTES	(1ULL << 32)
/* Jobs per file whose status TDRV_IOC_JOB_WAIT keeps (older: ESTALE). */
#define TDRV_JOB_WINDOW		4096
/* Most in-fence fds one TDRV_IOC_SUBMIT may carry. */
#define TDRV_MAX_IN_FENCES	64

/* Timeouts are in microseconds: 0 polls, negative waits without limit. */
#define TDRV_TIMEOUT_INFINITE	(-1LL)

/*
 * TDRV_IOC_VERSION: ABI version, features and device description. It is the
 * one ioctl that still works after the device was removed: it then reports
 * what it did before (the same kind, channels and features), so a caller
 * can tell what its file was for.
 */
struct tdrv_version {
	__u32 abi_major;	/* out: TDRV_ABI_MAJOR */
	__u32 abi_minor;	/* out: TDRV_ABI_MINOR */
	__u64 features;		/* out: TDRV_FEAT_* */
	__u32 device_kind;	/* out: TDRV_DEVICE_* */
	__u32 num_channels;	/* out: HBM channels; valid channel < this */
	__u64 max_buffer_size;	/* out: largest ALLOC size accepted */
	__u64 reserved[4];	/* out: zero */
};

/* TDRV_IOC_CHANNEL_INFO: memory accounting of one HBM channel. EINVAL for a
 * channel >= num_channels; ENODEV once the device was removed. */
struct tdrv_channel_info {
	__u32 channel;		/* in */
	__u32 pad;		/* in: zero */
	__u64 limit_bytes;	/* out: byte limit of the channel */
	__u64 used_bytes;	/* out: bytes allocated now (all files) */
	__u64 peak_bytes;	/* out: highest used_bytes seen */
	__u64 buffers;		/* out: live buffers on the channel */
	__u64 failed_allocs;	/* out: allocations refused for lack of space */
	__u64 reserved[2];	/* out: zero */
};

/* TDRV_IOC_ALLOC: allocate a zeroed DMA-coherent buffer. */
struct tdrv_alloc {
	__u64 size;		/* in: bytes, 1..max_buffer_size */
	__u32 channel;		/* in: HBM channel index */
	__u32 flags;		/* in: zero (no flags defined yet) */
	__u64 handle;		/* out: buffer handle, valid in this file only */
	__u64 dma_addr;		/* out: bus address of byte 0 (0 without CAP_SYS_RAWIO) */
	__u64 mmap_offset;	/* out: offset to pass to mmap(2) */
	__u64 reserved[2];	/* in: zero */
};

/* TDRV_IOC_FREE: drop the handle. The memory is released when the last
 * mapping and the last in-flight job using it are gone. */
struct tdrv_free {
	__u64 handle;		/* in */
	__u64 reserved;		/* in: zero */
};

/* TDRV_IOC_BUF_INFO: describe a buffer and its fence state. */
struct tdrv_buf_info {
	__u64 handle;		/* in */
	__u64 size;		/* out */
	__u64 dma_addr;		/* out */
	__u64 mmap_offset;	/* out */
	__u64 pending_reads;	/* out: in-flight device reads of the buffer */
	__u64 pending_writes;	/* out: in-flight device writes to the buffer */
	__u64 completion_count;	/* out: jobs that finished writing it */
	__u32 channel;		/* out */
	__u32 pad;		/* in: zero */
	__s32 error;		/* out: the buffer's error latch (ABI 1.1): the
				 * negative errno of the last job that failed
				 * writing it, or of a COPY_IN, MEMSET or COPY
				 * into it that the device's DMA failed (EIO,
				 * ETIMEDOUT; TDRV_DEVICE_SIM), or 0. Cleared by a successful
				 * write (job, COPY_IN, MEMSET, COPY) and by
				 * TDRV_IOC_COMPLETION_RESET. Ignored on input. */
	__u32 pad2;		/* in: zero */
	__u64 buf_id;		/* out: the buffer's identity (ABI 1.3,
				 * TDRV_FEAT_BUF_ID): handles of one buffer,
				 * in any file of the device (an IMPORT of its
				 * dma-buf included), report the same buf_id,
				 * and no two live buffers of the device share
				 * one; a freed buffer's id may be reused.
				 * Never 0. Lets a process that imports a
				 * dma-buf find the buffer it already holds.
				 * Ignored on input (was "reserved, zero" in
				 * ABI 1.0-1.2). */
};

/* TDRV_IOC_COPY_IN / TDRV_IOC_COPY_OUT: user memory <-> buffer. COPY_IN
 * waits for all pending device access; COPY_OUT for pending device writes. */
struct tdrv_xfer {
	__u64 handle;		/* in */
	__u64 offset;		/* in: byte offset in the buffer */
	__u64 size;		/* in: bytes; 0 is a no-op after the checks */
	__u64 user_ptr;		/* in: source (COPY_IN) or destination */
	__u64 reserved[2];	/* in: zero */
};

/* TDRV_IOC_MEMSET: fill a range with a byte value. */
struct tdrv_memset {
	__u64 handle;		/* in */
	__u64 offset;		/* in */
	__u64 size;		/* in */
	__u32 value;		/* in: 0..255 */
	__u32 pad;		/* in: zero */
	__u64 reserved[2];	/* in: zero */
};

/* One buffer-to-buffer copy. Both buffers must be on the same channel. */
struct tdrv_copy_desc {
	__u64 src_handle;
	__u64 src_offset;
	__u64 dst_handle;
	__u64 dst_offset;
	__u64 size;		/* bytes, > 0 */
};

/* TDRV_IOC_COPY: synchronous buffer-to-buffer copy. It waits like a read
 * of the source and a write of the destination, and no job is queued on
 * either buffer while it runs (SUBMIT waits for it; the same holds for
 * COPY_IN, COPY_OUT and MEMSET). EOPNOTSUPP when either buffer is an
 * import of another device's memory mapped peer-to-peer (see struct
 * tdrv_import): SUBMIT a job instead. */
struct tdrv_copy {
	struct tdrv_copy_desc desc; /* in */
	__u64 reserved[2];	/* in: zero */
};

/* tdrv_submit.flags */
#define TDRV_SUBMIT_OUT_FENCE	(1U << 0) /* return the job's out-fence in out_fence (1.2) */
#define TDRV_SUBMIT_NOTIFY	(1U << 1) /* queue a completion event with user_data
					   * when the job ends (1.6) */

/**
 * struct tdrv_submit - argument of TDRV_IOC_SUBMIT: queue an asynchronous
 * job on the device's engine.
 *
 * It returns at once; every source gets a pending read and every
 * destination a pending write until the job ends (successfully or not).
 * The software device (TDRV_DEVICE_SOFT) runs a job of at most 256 KiB
 * within the call when no job is queued on its engine, none running
 * conflicts with it and the job has no in-fences: the job may then be
 * done (fences released, completion counted, waiters woken, out-fence
 * signalled) when the call returns. Callers must not rely on either
 * outcome. Jobs that share a buffer one of them writes run in submission
 * order on every device; others may run at the same time.
 *
 * Fence fds (ABI 1.2, TDRV_FEAT_FENCE_FD):
 *
 * With TDRV_SUBMIT_OUT_FENCE the call returns a sync_file fd (O_CLOEXEC)
 * whose dma_fence signals when the job has ended and let go of its
 * buffers, after TDRV_IOC_JOB_WAIT reports it done. The job's outcome is
 * the fence's error: 0 on success, else -ECANCELED (its file was closed),
 * -EIO (device failure or recovery), -ETIMEDOUT (watchdog), -ENODEV
 * (device removed, or an imported buffer of the job revoked by its
 * exporter), or an in-fence's error (below). poll(2)/epoll report
 * POLLIN once it signalled; SYNC_IOC_FILE_INFO gives the status. The fd
 * works after the tdrv file is closed and after the module is unloaded.
 *
 * @in_fences lists sync_file fds (from any driver, e.g. another job's
 * out-fence or a sw_sync fence) that must all signal before the job may
 * start. The job is held by its file, not by the engine, so other files'
 * jobs run meanwhile; the submitting thread does not wait. A file's jobs
 * still start in submission order: a job submitted after a held one
 * waits for it too. If an in-fence signals with an error, the job fails
 * with that error without running (and its out-fence carries it).
 * Closing the file ends held jobs with ECANCELED, removing the device
 * with ENODEV.
 *
 * Implicit synchronisation (ABI 1.5, TDRV_FEAT_IMPLICIT_SYNC, on every
 * kernel): a job that uses a buffer with a dma-buf (one exported with
 * TDRV_IOC_EXPORT, or imported from another exporter) also waits, like
 * for an in-fence, for the unsignalled fences in that dma-buf's
 * reservation object: a destination for all of them, a source for the
 * writers (DMA_RESV_USAGE_WRITE), except tdrv jobs already queued on this
 * device, which run first anyway. Such a fence's error does not fail the
 * job. The job's own fence goes into each of those reservation objects
 * (write usage for a destination, read for a source) at SUBMIT, and
 * signals when the job ends, as the out-fence does; if SUBMIT then fails,
 * it signals at once with ECANCELED. A signal while SUBMIT waits for a
 * reservation lock ends it with EINTR, nothing queued.
 *
 * Completion event (ABI 1.6, TDRV_FEAT_SUBMIT_NOTIFY): with
 * TDRV_SUBMIT_NOTIFY the call also does what TDRV_IOC_JOB_NOTIFY of the
 * new job with @user_data would (see struct tdrv_job_notify), in the same
 * call: one struct tdrv_event is queued on this file when the job ends.
 * It counts against the same limits; if none is left the call fails with
 * ENOSPC and queues no job. A job that ends within the call (see above)
 * has its event ready when the call returns. This saves an ioctl per job
 * for a caller that waits for its jobs through events.
 *
 * Errors (besides those of every call): EINVAL for a bad descriptor,
 * unknown flags, in_fence_count above TDRV_MAX_IN_FENCES, in_fences set
 * with a zero count, an in-fence fd that is not a sync_file,
 * TDRV_SUBMIT_OUT_FENCE in a struct too short to hold @out_fence (the
 * 48 bytes of ABI 1.0/1.1: no fd is created), TDRV_SUBMIT_NOTIFY in a
 * struct too short to hold @user_data (the 64 bytes of ABI 1.2-1.5), or
 * a non-zero @user_data without TDRV_SUBMIT_NOTIFY; ENOSPC with
 * TDRV_SUBMIT_NOTIFY when this file's or the device's completion events
 * are used up (file_max_events, device_max_events); EBADF
 * for an in-fence that is not an open fd; EFAULT for unreadable descriptors or in_fences; EOPNOTSUPP for
 * TDRV_SUBMIT_OUT_FENCE or in-fences on a kernel without sync_file
 * support (TDRV_FEAT_FENCE_FD unset); EMFILE when no fd is free for the
 * out-fence; EAGAIN, EXDEV, ERANGE, ENOENT, ENOMEM, ENODEV as documented
 * above. A job is queued only if the call succeeds (an EFAULT writing the
 * result back is the exception: the job runs, and no out-fence fd is
 * created).
 *
 * @descs: in: user pointer to @desc_count descriptors
 * @desc_count: in: 1..TDRV_MAX_JOB_DESCS
 * @desc_size: in: sizeof(struct tdrv_copy_desc) the caller uses
 * @flags: in: TDRV_SUBMIT_* bits
 * @pad: in: zero
 * @job_id: out: per-file id, increasing from 1; in: zero
 * @reserved: in: zero
 * @in_fences: in (1.2): user pointer to @in_fence_count __s32 sync_file
 *	fds, or 0 when @in_fence_count is 0
 * @in_fence_count: in (1.2): 0..TDRV_MAX_IN_FENCES
 * @out_fence: out (1.2): the out-fence's fd with TDRV_SUBMIT_OUT_FENCE,
 *	else -1; ignored on input
 * @user_data: in (1.6): with TDRV_SUBMIT_NOTIFY, the event's user_data;
 *	else zero
 */
struct tdrv_submit {
	__u64 descs;
	__u32 desc_count;
	__u32 desc_size;
	__u32 flags;
	__u32 pad;
	__u64 job_id;
	__u64 reserved[2];
	/* ABI 1.2 (earlier callers pass the first 48 bytes) */
	__u64 in_fences;
	__u32 in_fence_count;
	__s32 out_fence;
	/* ABI 1.6 (earlier callers pass the first 64 bytes) */
	__u64 user_data;
};

/* tdrv_job_wait.state */
#define TDRV_JOB_PENDING	1 /* queued or running */
#define TDRV_JOB_DONE		2 /* finished; see status */

/**
 * struct tdrv_job_wait - TDRV_IOC_JOB_WAIT: wait until a job of this file
 * has ended; a timeout of 0 only asks.
 * @job_id: in: a job of this file (the id SUBMIT returned).
 * @timeout_us: in: 0 asks without waiting, < 0 waits without limit.
 * @state: out: TDRV_JOB_PENDING or TDRV_JOB_DONE; in: zero.
 * @status: out: with TDRV_JOB_DONE, 0 or the job's negative errno; in: zero.
 * @reserved: in: zero.
 *
 * A job has ended (TDRV_JOB_DONE) when it has its final status and the
 * device has let go of its buffers: their pending reads and writes
 * (struct tdrv_buf_info) no longer count it.
 *
 * One exception: a job the device gave up on while it may still be moving
 * the job's bytes. That is a job the watchdog timed out (-ETIMEDOUT: edu,
 * sim) or a job of a sim queue that stopped answering (-EIO). It ends at
 * once, so that nobody waits on a device that may never answer; until the
 * device lets go (edu: its transfer lands, or the device is removed; sim:
 * its queue is reset, or the device is removed):
 * - its buffers still count it in pending_reads and pending_writes, and
 *   their memory is not freed, even after FREE and close;
 * - its out-fence, and its fence in a dma-buf's reservation object,
 *   signal only then: they always mean "let go";
 * - each destination's error latch holds the job's error, so COPY_OUT and
 *   COMPLETION_WAIT on it fail with EIO;
 * - a wait for the buffer's device accesses (FENCE_WAIT, and COPY_IN,
 *   COPY_OUT and MEMSET before they copy): on edu it lasts until the
 *   transfer lands, then reports the latch (EIO); on sim, whose queue may
 *   never answer, it fails at once with EIO when only such accesses keep
 *   it from ending.
 *
 * Errors: EINVAL (job id 0 or not yet issued by this file; state, status
 * or reserved not zero), ESTALE (older than this file's last
 * TDRV_JOB_WINDOW jobs), ETIMEDOUT (@timeout_us > 0 passed with the job
 * still pending), EINTR (see the list above), ENODEV (device removed).
 */
struct tdrv_job_wait {
	__u64 job_id;
	__s64 timeout_us;
	__u32 state;
	__s32 status;
	__u64 reserved[2];
};

/* tdrv_fence_wait.kind */
#define TDRV_FENCE_READS	(1U << 0) /* no pending device reads */
#define TDRV_FENCE_WRITES	(1U << 1) /* no pending device writes */
#define TDRV_FENCE_ALL		(TDRV_FENCE_READS | TDRV_FENCE_WRITES)

/*
 * Most completion events one file may ever be allowed to have requested and
 * not yet read: the upper end of module parameter file_max_events, which
 * sets the real limit (by default 4096, TDRV_JOB_WINDOW: one event for each
 * job whose status the file can still ask for). device_max_events (by
 * default 65536) bounds the sum over all files of a device, so that many
 * files cannot hold more kernel memory in events than that.
 */
#define TDRV_MAX_EVENTS		65536

/**
 * struct tdrv_job_notify - TDRV_IOC_JOB_NOTIFY: ask for a completion event
 * (ABI 1.4, TDRV_FEAT_EVENTS).
 * @job_id: in: a job of this file (the id SUBMIT returned).
 * @user_data: in: any value; the event carries it back.
 * @reserved: in: zero.
 *
 * Queues one struct tdrv_event on this file when the job has ended, at
 * once if it already has. "Ended" is what TDRV_IOC_JOB_WAIT reports as
 * TDRV_JOB_DONE, with the same status: the job let go of its buffers,
 * except a job the device gave up on (see struct tdrv_job_wait). Each
 * call queues one event, so two calls for one job give two events.
 * SUBMIT with TDRV_SUBMIT_NOTIFY (ABI 1.6) asks for one in the same call
 * as the job (see struct tdrv_submit).
 *
 * Events are read with read(2) from the tdrv file itself: each read
 * returns as many whole events as fit in the buffer (at least one), oldest
 * first. It blocks until one is queued, unless the file is O_NONBLOCK or
 * the read RWF_NOWAIT (then EAGAIN); a signal ends the wait (EINTR, or a
 * restart after an SA_RESTART handler); a buffer smaller than one event
 * is EINVAL, and EFAULT loses no event. poll(2), select(2) and epoll
 * report EPOLLIN | EPOLLRDNORM while an event is queued. This needs no
 * sync_file (works on every kernel) and no fd per job: one file can wait
 * for thousands of jobs with one epoll registration.
 *
 * The events belong to the open file (shared by its dup()s and by
 * children that inherit it). Closing it, also by exit or SIGKILL,
 * discards the requested and unread ones. When the device is removed,
 * every job ends with ENODEV and its events are queued; read and poll
 * keep working, while JOB_NOTIFY (like every ioctl but TDRV_IOC_VERSION)
 * fails with ENODEV.
 *
 * Errors: EINVAL (job id 0 or not yet issued by this file, reserved not
 * zero), ESTALE (older than this file's last TDRV_JOB_WINDOW jobs),
 * ENOSPC (file_max_events events of this file, or device_max_events of all
 * files of the device, requested and not yet read), ENOMEM,
 * ENODEV (device removed).
 */
struct tdrv_job_notify {
	__u64 job_id;
	__u64 user_data;
	__u64 reserved[2];
};

/* tdrv_event.type */
#define TDRV_EVENT_JOB_DONE	1 /* a job asked for with TDRV_IOC_JOB_NOTIFY ended */

/**
 * struct tdrv_event - a completion event, read(2) from the tdrv file
 * (ABI 1.4, TDRV_FEAT_EVENTS).
 * @type: TDRV_EVENT_JOB_DONE.
 * @status: the job's status: 0, or its negative errno (as
 *	tdrv_job_wait.status: -ECANCELED, -EIO, -ETIMEDOUT, -ENODEV, or an
 *	in-fence's error).
 * @job_id: the job.
 * @user_data: what TDRV_IOC_JOB_NOTIFY (or SUBMIT's @user_data with
 *	TDRV_SUBMIT_NOTIFY) was given.
 *
 * Later ABI versions may define other types; skip events of a type you
 * do not know. The size stays 24 bytes.
 */
struct tdrv_event {
	__u32 type;
	__s32 status;
	__u64 job_id;
	__u64 user_data;
};

/* TDRV_IOC_FENCE_WAIT: wait until the buffer's chosen counters are zero. */
struct tdrv_fence_wait {
	__u64 handle;		/* in */
	__s64 timeout_us;	/* in: 0 polls, < 0 waits without limit */
	__u32 kind;		/* in: TDRV_FENCE_* (non-zero) */
	__u32 pad;		/* in: zero */
	__u64 reserved[2];	/* in: zero */
};

/* TDRV_IOC_COMPLETION_WAIT: wait until completion_count >= expected. */
struct tdrv_completion_wait {
	__u64 handle;		/* in */
	__u64 expected;		/* in */
	__s64 timeout_us;	/* in: 0 polls, < 0 waits without limit */
	__u64 count;		/* out: completion_count when the call returned */
	__u64 reserved[2];	/* in: zero */
};

/* TDRV_IOC_COMPLETION_RESET: set the buffer's completion_count to 0 and
 * clear its error latch. */
struct tdrv_completion_reset {
	__u64 handle;		/* in */
	__u64 reserved;		/* in: zero */
};

/**
 * struct tdrv_export - TDRV_IOC_EXPORT: share a buffer as a dma-buf (ABI 1.2).
 * @handle: in: the buffer.
 * @flags: in: zero (no flags defined yet).
 * @fd: out: a new dma-buf fd, opened O_RDWR with O_CLOEXEC set. The
 *	dma-buf's size is the buffer's size rounded up to pages.
 * @pad: in: zero.
 * @reserved: in: zero.
 *
 * The dma-buf is the buffer itself: the same memory, fence and completion
 * count. It outlives FREE, the exporter's close and exit, and keeps the
 * module loaded (rmmod fails with EWOULDBLOCK/EBUSY while it exists).
 * It also keeps the buffer's bytes charged to the exporting file's byte
 * limit (ENOSPC) after FREE of the handle, until every dma-buf exported
 * from that handle is released (its last fd and mapping gone).
 * On the fd:
 *  - mmap(2) (MAP_SHARED, not PROT_EXEC, within the size) maps the buffer
 *    like tdrv's own mmap; after unbind its pages fault with SIGBUS.
 *  - DMA_BUF_IOCTL_SYNC with DMA_BUF_SYNC_START waits for pending device
 *    writes (DMA_BUF_SYNC_READ) or all pending device access (with
 *    DMA_BUF_SYNC_WRITE), like COPY_OUT and COPY_IN, whatever the error
 *    latch says (it does not report the latch), and first (ABI 1.5) for
 *    the same kind of fences in the dma-buf's reservation object (other
 *    drivers' work, imported sync_files); a signal interrupts
 *    it (EINTR/restart), and after unbind it fails with ENODEV. It does not
 *    keep jobs off the buffer until DMA_BUF_SYNC_END, which does nothing.
 *  - TDRV_IOC_IMPORT in any file of the same device gives a handle to the
 *    same buffer.
 *  - Implicit synchronisation (ABI 1.5, TDRV_FEAT_IMPLICIT_SYNC): the
 *    buffer gets a reservation object at its first export, shared by
 *    every dma-buf exported from it. Every job submitted afterwards that
 *    writes the buffer adds its fence there with write usage, every job
 *    that reads it with read usage, and waits for the fences already
 *    there (see struct tdrv_submit). So poll(2) of the fd reports POLLIN
 *    once no job writing the buffer is pending, POLLOUT once no job uses
 *    it (on every kernel); DMA_BUF_IOCTL_EXPORT_SYNC_FILE gives a
 *    sync_file of those jobs, and DMA_BUF_IOCTL_IMPORT_SYNC_FILE makes
 *    the next tdrv jobs on the buffer wait for a foreign fence (both need
 *    CONFIG_SYNC_FILE; without it they are ENOTTY). Jobs submitted
 *    before the first export are not in it. COPY_IN, COPY_OUT, MEMSET and
 *    COPY wait for tdrv's jobs only, not for other fences there.
 *  - Other devices attach to it (dma_buf_attach, dma_buf_dynamic_attach),
 *    pin it and map it: a mapping is an sg_table of all its pages, mapped
 *    for the importer's device, and several attachments may be mapped at
 *    once; the kernel may also vmap it. Attaching fails with EIO when a
 *    page is beyond the importer's DMA mask, with ENODEV after unbind,
 *    and with EOPNOTSUPP for a buffer this device
 *    imported from another exporter (which may revoke its pages; other
 *    devices import the original dma-buf instead). On unbind, importers are told to
 *    drop their mappings (dma_buf_invalidate_mappings); revocable ones
 *    (with an invalidate_mappings callback) get 10 s to unmap, and memory
 *    still mapped by any importer is freed only once it has unmapped.
 *  - Device memory (TDRV_DEVICE_SIM: HBM behind a BAR, no struct pages)
 *    is mapped peer-to-peer: for an importer that takes peer-to-peer
 *    memory (a dynamic attachment with allow_peer2peer) and that the
 *    kernel's PCI P2P DMA finds a path to (both below one PCI switch or
 *    bridge, or a host bridge it allows), the sg_table holds the BAR's
 *    bus or DMA addresses and no pages. Otherwise attaching fails with
 *    EOPNOTSUPP (the kernel log says why, rate-limited), or with EIO
 *    when the bus address is beyond the importer's DMA mask. It is never
 *    vmapped, nor copied through host memory behind the importer's back.
 *    See docs/sharing.md.
 *
 * Errors: EINVAL (flags, pad, fd or reserved not zero), ENOENT (no such
 * handle), EMFILE (no free fd), ENOMEM, ENODEV (device removed).
 */
struct tdrv_export {
	__u64 handle;
	__u32 flags;
	__s32 fd;
	__u32 pad;
	__u32 pad2;
	__u64 reserved[2];
};

/**
 * struct tdrv_import - TDRV_IOC_IMPORT: a handle for a dma-buf (ABI 1.2).
 * @fd: in: a dma-buf fd.
 * @channel: in: the HBM channel a foreign dma-buf is placed on (SUBMIT
 *	and COPY need both buffers on one channel); out: the buffer's channel
 *	(a tdrv buffer keeps the one it was allocated on).
 * @flags: in: zero (no flags defined yet).
 * @pad: in: zero.
 * @handle: out: a handle in this file.
 * @size: out: the buffer's size in bytes.
 * @mmap_offset: out: offset to pass to mmap(2) of this file.
 * @reserved: in: zero.
 *
 * A dma-buf exported by tdrv from a buffer of this device resolves to that
 * buffer: the same memory, fence and completion count, no copy. It is
 * charged to this file's limits (file_max_buffers, file_max_mib) as well.
 *
 * A dma-buf exported by another tdrv device is imported like a foreign
 * one (below): a new buffer of this device over the exporter's memory,
 * zero-copy, with its own fence and completion count (jobs of the two
 * devices order through the reservation object). Which pairs work:
 * software (TDRV_DEVICE_SOFT) and edu (TDRV_DEVICE_EDU) devices import
 * each other's buffers in every direction, and a sim device imports
 * theirs. A sim (TDRV_DEVICE_SIM) buffer is device memory behind a BAR:
 * an edu device imports it peer-to-peer where the PCI topology has a
 * path (see struct tdrv_export), and its jobs then reach the memory by
 * DMA; COPY_IN, COPY_OUT and MEMSET of the import go through the sim
 * device, mmap maps the BAR's pages (write-combined), and COPY with it
 * is EOPNOTSUPP. IMPORT of a sim buffer into a software device (no DMA
 * engine), into another sim device, or without a path is EOPNOTSUPP.
 * Like any
 * import it lives on the channel named here: SUBMIT
 * and COPY need it on the same channel as the other buffers of a job
 * (the channel is the importer's accounting, not where the memory is).
 *
 * A foreign dma-buf (e.g. from /dev/dma_heap/system) is mapped into the
 * kernel for CPU access and, on a device whose engine does DMA (edu), is
 * attached and mapped for the device once, now; jobs, COPY_IN/OUT,
 * MEMSET, BUF_INFO and mmap then work on it as on any buffer. It counts
 * against file_max_buffers but is not charged to the channel or to
 * file_max_mib (its exporter accounts the memory). Instead, a file holds
 * at most file_max_imports (default 4096) handles of foreign imports, and
 * a device at most device_max_imports (default 65536) such buffers
 * (module parameters); each IMPORT of a foreign dma-buf makes a new one,
 * alive until its handle is freed and no job uses it. FREE of the handle,
 * or close of the file, releases an import that no job or mapping uses
 * before it returns: the dma-buf is unmapped and its reference dropped, so
 * a tdrv exporter has its memory back by then. An import a job or mapping
 * still uses is released shortly after the last of them lets go, and
 * counts against device_max_imports until it is (IMPORT at the limit
 * waits for such releases before it reports ENOSPC). Jobs on it take
 * part in the dma-buf's reservation object (ABI 1.5, see struct
 * tdrv_submit): they wait for the exporter's and other importers' fences
 * there and add their own. Unbind detaches and releases the import.
 *
 * Revocation: on software and edu devices an import (of another tdrv
 * device's buffer or any foreign dma-buf) is a dynamic, pinned attachment
 * that the exporter can revoke (dma_buf_invalidate_mappings, as a tdrv
 * exporter does when it is unbound). The importing device then stops
 * using the memory: a job running on the buffer stops at its next piece
 * or chunk and ends with ENODEV (TDRV_IOC_JOB_WAIT status), jobs that
 * have not started end with ENODEV without running, and the exporter's
 * revocation waits for those running before it takes the memory back.
 * Afterwards COPY_IN, COPY_OUT, MEMSET, COPY and SUBMIT with the handle
 * fail with ENODEV (a job submitted while the revocation runs ends with
 * ENODEV instead), and its user mappings fault with SIGBUS;
 * FREE still works (the handle is an empty shell). On a sim device an
 * import is a static attachment: the exporter keeps the memory until the
 * import is freed, and the import stays usable.
 *
 * Errors: EBADF (@fd is not an open fd), EINVAL (@fd is not a dma-buf;
 * flags, pad or reserved not zero, out fields not zero; @channel out of
 * range for a foreign dma-buf; its size is zero, not whole pages, above
 * TDRV_MAX_BUFFER_SIZE, or its DMA mapping is not in whole pages),
 * EOPNOTSUPP (a dma-buf without a kernel mapping in system memory;
 * another tdrv device's device memory without a peer-to-peer path, see
 * above), ENOSPC (this file's buffer or byte
 * limit, or for a foreign dma-buf file_max_imports or device_max_imports),
 * ENOMEM (also when the exporter cannot map the dma-buf into the
 * kernel; the dma-buf core then logs a warning once), ENODEV (device
 * removed, or the exporter revoked the dma-buf during the IMPORT), or the
 * exporter's error when mapping the dma-buf for the
 * device (EIO when its pages are beyond the device's DMA mask: edu's
 * default mask is 28 bits, so load tdrv with edu_dma_bits=32 for QEMU's
 * -device edu,dma_mask=0xffffffff).
 */
struct tdrv_import {
	__s32 fd;
	__u32 channel;
	__u32 flags;
	__u32 pad;
	__u64 handle;
	__u64 size;
	__u64 mmap_offset;
	__u64 reserved[2];
};

#define TDRV_IOC_MAGIC 0xD7

#define TDRV_IOC_VERSION	_IOR(TDRV_IOC_MAGIC, 0x00, struct tdrv_version)
#define TDRV_IOC_CHANNEL_INFO	_IOWR(TDRV_IOC_MAGIC, 0x01, struct tdrv_channel_info)
#define TDRV_IOC_ALLOC		_IOWR(TDRV_IOC_MAGIC, 0x02, struct tdrv_alloc)
#define TDRV_IOC_FREE		_IOW(TDRV_IOC_MAGIC, 0x03, struct tdrv_free)
#define TDRV_IOC_BUF_INFO	_IOWR(TDRV_IOC_MAGIC, 0x04, struct tdrv_buf_info)
#define TDRV_IOC_COPY_IN	_IOW(TDRV_IOC_MAGIC, 0x05, struct tdrv_xfer)
#define TDRV_IOC_COPY_OUT	_IOW(TDRV_IOC_MAGIC, 0x06, struct tdrv_xfer)
#define TDRV_IOC_MEMSET		_IOW(TDRV_IOC_MAGIC, 0x07, struct tdrv_memset)
#define TDRV_IOC_COPY		_IOW(TDRV_IOC_MAGIC, 0x08, struct tdrv_copy)
#define TDRV_IOC_SUBMIT		_IOWR(TDRV_IOC_MAGIC, 0x09, struct tdrv_submit)
#define TDRV_IOC_JOB_WAIT	_IOWR(TDRV_IOC_MAGIC, 0x0A, struct tdrv_job_wait)
#define TDRV_IOC_FENCE_WAIT	_IOW(TDRV_IOC_MAGIC, 0x0B, struct tdrv_fence_wait)
#define TDRV_IOC_COMPLETION_WAIT _IOWR(TDRV_IOC_MAGIC, 0x0C, struct tdrv_completion_wait)
#define TDRV_IOC_COMPLETION_RESET _IOW(TDRV_IOC_MAGIC, 0x0D, struct tdrv_completion_reset)
#define TDRV_IOC_EXPORT		_IOWR(TDRV_IOC_MAGIC, 0x0E, struct tdrv_export)
#define TDRV_IOC_IMPORT		_IOWR(TDRV_IOC_MAGIC, 0x0F, struct tdrv_import)
#define TDRV_IOC_JOB_NOTIFY	_IOW(TDRV_IOC_MAGIC, 0x10, struct tdrv_job_notify)

#endif /* _UAPI_TDRV_H */
