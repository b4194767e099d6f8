/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Fence fds of tdrv jobs (sync_file + dma_fence), called from Rust
 * (driver/fence_fd.rs documents the contracts and the design).
 */
#ifndef TDRV_FENCE_FD_H
#define TDRV_FENCE_FD_H

#include <linux/types.h>

struct dma_fence;
struct file;
struct tdrv_deps;
struct workqueue_struct;

bool tdrv_fence_fd_supported(void);

/* Out-fences: one dma_fence per job, exported as a sync_file fd and
 * added to the reservation objects of its buffers (resv.c). */
struct dma_fence *tdrv_fence_new(const void *engine);
void tdrv_fence_set_queued(struct dma_fence *fence);
bool tdrv_fence_queued_on(struct dma_fence *fence, const void *engine);
void tdrv_fence_signal(struct dma_fence *fence, int error);
void tdrv_fence_put(struct dma_fence *fence);
int tdrv_fence_fd_reserve(struct dma_fence *fence, struct file **filep);
void tdrv_fence_fd_install(int fd, struct file *file);
void tdrv_fence_fd_discard(int fd, struct file *file);
int tdrv_fence_module_init(void);
struct workqueue_struct *tdrv_dispatch_queue(void);
struct workqueue_struct *tdrv_engine_queue(void);
void tdrv_fence_module_exit(void);

/* dma-fence signalling critical sections (lockdep annotation). */
bool tdrv_fence_begin_signalling(void);
void tdrv_fence_end_signalling(bool cookie);

/* In-fences: the sync_files a job waits for before it may start. */
int tdrv_deps_new(const s32 *fds, u32 count, struct tdrv_deps **depsp);
bool tdrv_deps_arm(struct tdrv_deps *deps, void *ctx);
int tdrv_deps_error(struct tdrv_deps *deps);
void tdrv_deps_free(struct tdrv_deps *deps);
struct tdrv_deps *tdrv_deps_with_implicit(struct tdrv_deps *old,
					  struct dma_fence **fences, u32 n);

/* Implemented in Rust (job.rs): every in-fence of the job behind ctx has
 * signalled. Called once per armed set, from any context (under the
 * signalling fence's lock, interrupts off). */
void tdrv_deps_ready(void *ctx);

#endif
