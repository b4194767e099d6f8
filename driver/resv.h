/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Implicit synchronisation of tdrv jobs through the reservation objects
 * of their buffers' dma-bufs (driver/resv.c), called from Rust
 * (driver/resv.rs documents the design).
 */
#ifndef TDRV_RESV_H
#define TDRV_RESV_H

#include <linux/types.h>

struct dma_fence;
struct dma_resv;
struct tdrv_deps;

/* One reservation object a job uses, and how. */
struct tdrv_resv_use {
	struct dma_resv *resv;
	/* Nonzero: the job writes a buffer behind it. */
	u32 write;
	u32 pad;
};

/* A reservation object of a tdrv buffer (dma_resv_init), or NULL. */
struct dma_resv *tdrv_resv_new(void);
/* Finalises and frees one from tdrv_resv_new(): drops its fences. Takes
 * no lock and allocates nothing. */
void tdrv_resv_free(struct dma_resv *resv);

/*
 * At SUBMIT, before the job is queued: locks every reservation object of
 * @uses (sorted and merged in place), reserves a fence slot in each,
 * collects the unsignalled fences the job must wait for (a writer waits
 * for readers and writers, a reader for writers; fences of jobs already
 * in @engine's queue excepted) into *@depsp as implicit dependencies,
 * then adds @fence to each object (WRITE or READ usage). All or nothing:
 * on error (-EINTR on a signal while locking, -ENOMEM)
 * nothing was added and *@depsp is unchanged. Sleeps.
 */
int tdrv_resv_attach(struct tdrv_resv_use *uses, u32 n, struct dma_fence *fence,
		     const void *engine, struct tdrv_deps **depsp);

/* Waits (interruptibly) for the fences a CPU read (@write false) or write
 * of the buffer must not overlap. 0, -ERESTARTSYS. */
int tdrv_resv_wait_cpu(struct dma_resv *resv, bool write);

#endif
