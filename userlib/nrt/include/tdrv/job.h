/* SPDX-License-Identifier: MIT OR Apache-2.0 */
/*
 * tdrv/job.h: copy jobs on a tdrv device, for C programs that use the
 * tensors of libnrt.so.1 (nrt/nrt.h). This is tdrv's own API, not part of
 * the Neuron runtime's; libnrt.so.1 exports it.
 *
 * A job is a list of copies between DEVICE tensors of one device and HBM
 * channel, which the device's copy engine runs after tdrv_job_submit
 * returns. When a job ends well, the output completion count of every
 * destination tensor goes up by one, which nrt_tensor_check_output_completion
 * waits for. When NEURON_RT_DBG_INPUT_DUMP_DIRECTORY is set, submitting a
 * job first writes each source tensor to a file in that directory.
 *
 * Life of a job: tdrv_job_create, one or more tdrv_job_add_copy, optionally
 * tdrv_job_request_fd, one tdrv_job_submit (or tdrv_job_submit_notify), any
 * number of tdrv_job_wait and tdrv_job_get_fd, tdrv_job_free. Calls out of
 * that order return NRT_INVALID and change nothing. Freeing a submitted
 * job does not cancel it: the copies run to their end, and the tensors stay
 * alive until then.
 *
 * Handles follow nrt_tensor_t's rules: a tdrv_job_t * is an opaque token
 * that is looked up before every use and never dereferenced; a stale or
 * foreign pointer is NRT_INVALID_HANDLE. Jobs may be used from several
 * threads; tdrv_job_wait on one thread and tdrv_job_free on another is
 * safe (the wait finishes first).
 */
#ifndef TDRV_JOB_H
#define TDRV_JOB_H

#include <stddef.h>
#include <stdint.h>

#include <nrt/nrt.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdrv_job tdrv_job_t; /* opaque */

/* A new, empty job in *job (set to NULL on failure). */
NRT_STATUS tdrv_job_create(tdrv_job_t **job);

/*
 * Adds a copy of size (> 0) bytes from src at src_offset to dst at
 * dst_offset. Both must be DEVICE tensors (or slices of them) of the same
 * device and HBM channel as the job's other copies: NRT_INVALID otherwise,
 * or for a range outside a tensor; NRT_INVALID_HANDLE for a tensor that is
 * not live; NRT_INVALID after tdrv_job_submit.
 */
NRT_STATUS tdrv_job_add_copy(tdrv_job_t *job, const nrt_tensor_t *src, size_t src_offset,
			     nrt_tensor_t *dst, size_t dst_offset, size_t size);

/*
 * Asks for a completion fd (see tdrv_job_get_fd) when the job is submitted.
 * NRT_INVALID after tdrv_job_submit.
 */
NRT_STATUS tdrv_job_request_fd(tdrv_job_t *job);

/*
 * Queues the job on the device and returns at once. NRT_INVALID for an
 * empty job or a second submit; NRT_RESOURCE when the device's queue or
 * memory is full; NRT_FAILURE when a completion fd was requested and the
 * kernel cannot make one (the log line says why); NRT_CLOSED if the device
 * was removed. On failure nothing was queued and the job can be freed.
 */
NRT_STATUS tdrv_job_submit(tdrv_job_t *job);

/*
 * Waits for a submitted job: NRT_SUCCESS when it ended well, NRT_HW_ERROR
 * when it failed (its destinations' bytes are then undefined), NRT_TIMEOUT
 * when it was still running after timeout_us microseconds (0 polls; a
 * negative value waits without limit), NRT_CLOSED if the device was
 * removed, NRT_INVALID before tdrv_job_submit.
 */
NRT_STATUS tdrv_job_wait(tdrv_job_t *job, int64_t timeout_us);

/*
 * The job's completion fd in *fd: it polls readable (POLLIN) once the job
 * has ended, well or not; tdrv_job_wait then tells which. The fd belongs
 * to the job (close-on-exec; it stays valid until tdrv_job_free, which
 * closes it): do not close it. NRT_INVALID when the job was not submitted
 * after tdrv_job_request_fd.
 */
NRT_STATUS tdrv_job_get_fd(tdrv_job_t *job, int *fd);

/*
 * Completion events, on every kernel (also one without sync_file, where
 * tdrv_job_request_fd cannot work): asks for one event when the submitted
 * job ends (at once if it has), carrying user_data, and returns in *fd
 * the descriptor of the job's device file. That fd polls readable
 * (POLLIN) while events are ready: read them with tdrv_read_events. One fd
 * per device serves all its jobs, so a program can wait for thousands of
 * jobs with one poll entry. The fd belongs to the library: do not close
 * or read it. Each call queues one event. NRT_INVALID before
 * tdrv_job_submit; NRT_RESOURCE when the file's or the device's event
 * limit is reached (module parameters file_max_events, 4096 by default,
 * and device_max_events: read events to make room); NRT_FAILURE with a
 * driver older than ABI 1.4; NRT_CLOSED if the device was removed.
 *
 * One stream per process and device: the library opens each device once
 * per process, so every tdrv_job_notify of the process for jobs of that
 * device (every thread's, every library's that uses libnrt.so.1 in it)
 * queues its event on the same fd, and tdrv_read_events returns whatever
 * is ready there, whoever asked for it. Read the events in one place (one
 * event loop) and hand them out by user_data, or make user_data unique in
 * the process (for example the address of the waiter's own state) and
 * pass on events that are not yours: an event read by someone else does
 * not come again (ask again with tdrv_job_notify, which answers at once
 * for a job that has ended). A child after fork shares its parent's
 * device files and so their event streams, which stay the parent's: there
 * both calls fail with NRT_FAILURE (the parent's events would otherwise
 * go to whichever process read first).
 */
NRT_STATUS tdrv_job_notify(tdrv_job_t *job, uint64_t user_data, int *fd);

/*
 * Submits the job as tdrv_job_submit does and asks, in the same call, for
 * its completion event carrying user_data, as tdrv_job_notify right after
 * it would (ABI 1.6): one system call per job instead of two for a program
 * that waits through events, and no moment when the job is queued but its
 * event not yet asked for. *fd gets the device file's descriptor, as from
 * tdrv_job_notify, with the same rules. Fails as tdrv_job_submit does
 * (NRT_INVALID also for a NULL fd pointer), with NRT_RESOURCE also when
 * the file's or the device's event limit is reached, and with NRT_FAILURE
 * on a driver older than ABI 1.6 or in a child after fork; on failure
 * nothing was queued, and the job keeps its copies for another submit.
 */
NRT_STATUS tdrv_job_submit_notify(tdrv_job_t *job, uint64_t user_data, int *fd);

/* An event read by tdrv_read_events. */
typedef struct tdrv_job_event {
	uint64_t user_data; /* what tdrv_job_notify or tdrv_job_submit_notify
			     * was given */
	NRT_STATUS status;  /* NRT_SUCCESS, NRT_HW_ERROR (the job failed), or
			     * NRT_CLOSED (the device was removed) */
} tdrv_job_event_t;

/*
 * Reads up to max ready events of fd (from tdrv_job_notify or
 * tdrv_job_submit_notify) into events, oldest first, without waiting;
 * *count gets how many (0 when none is ready). Events not read stay for the next call. NRT_INVALID for an fd
 * that is not one tdrv_job_notify or tdrv_job_submit_notify returned, or
 * NULL pointers.
 */
NRT_STATUS tdrv_read_events(int fd, tdrv_job_event_t *events, size_t max, size_t *count);

/*
 * Frees the caller's handle and sets *job = NULL. A pointer that is not a
 * live job handle is logged and left alone.
 */
void tdrv_job_free(tdrv_job_t **job);

#ifdef __cplusplus
}
#endif

#endif /* TDRV_JOB_H */
