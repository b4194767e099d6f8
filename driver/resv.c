// SPDX-License-Identifier: GPL-2.0
/*
 * tdrv: implicit synchronisation through dma-buf reservation objects, the
 * C side of driver/resv.rs (which holds the design). Everything here runs
 * at SUBMIT or in a CPU access, never on a fence signalling path: taking
 * a reservation lock or allocating there could wait for the very fence
 * being signalled.
 */

#include <linux/dma-fence.h>
#include <linux/dma-resv.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/sort.h>
#include <linux/ww_mutex.h>

#include "fence_fd.h"
#include "resv.h"

struct dma_resv *tdrv_resv_new(void)
{
	struct dma_resv *resv = kmalloc(sizeof(*resv), GFP_KERNEL_ACCOUNT);

	if (resv)
		dma_resv_init(resv);
	return resv;
}

void tdrv_resv_free(struct dma_resv *resv)
{
	if (!resv)
		return;
	dma_resv_fini(resv);
	kfree(resv);
}

static int tdrv_resv_cmp(const void *a, const void *b)
{
	const struct tdrv_resv_use *x = a, *y = b;

	if (x->resv == y->resv)
		return 0;
	return x->resv < y->resv ? -1 : 1;
}

/* Sorts @uses and merges entries of one object (writing if any writes):
 * returns how many are left. ww_mutex refuses to take a lock twice. */
static u32 tdrv_resv_merge(struct tdrv_resv_use *uses, u32 n)
{
	u32 i, out = 0;

	sort(uses, n, sizeof(*uses), tdrv_resv_cmp, NULL);
	for (i = 0; i < n; i++) {
		if (out && uses[out - 1].resv == uses[i].resv) {
			uses[out - 1].write |= uses[i].write;
			continue;
		}
		uses[out++] = uses[i];
	}
	return out;
}

/*
 * Locks the @n distinct objects of @uses under @ctx, backing off on
 * -EDEADLK (another task holds one we need and wants one we hold: drop
 * everything, wait for the contended lock, start again). On error nothing
 * is locked and @ctx is finished.
 */
static int tdrv_resv_lock_all(struct tdrv_resv_use *uses, u32 n,
			      struct ww_acquire_ctx *ctx)
{
	struct dma_resv *contended = NULL;
	int ret;
	u32 i, j;

	ww_acquire_init(ctx, &reservation_ww_class);
retry:
	if (contended) {
		ret = dma_resv_lock_slow_interruptible(contended, ctx);
		if (ret)
			goto fail;
	}
	for (i = 0; i < n; i++) {
		if (uses[i].resv == contended)
			continue;
		ret = dma_resv_lock_interruptible(uses[i].resv, ctx);
		if (!ret)
			continue;
		for (j = 0; j < i; j++)
			if (uses[j].resv != contended)
				dma_resv_unlock(uses[j].resv);
		if (contended)
			dma_resv_unlock(contended);
		if (ret == -EDEADLK) {
			contended = uses[i].resv;
			goto retry;
		}
		goto fail;
	}
	ww_acquire_done(ctx);
	return 0;
fail:
	ww_acquire_fini(ctx);
	return ret;
}

int tdrv_resv_attach(struct tdrv_resv_use *uses, u32 n, struct dma_fence *fence,
		     const void *engine, struct tdrv_deps **depsp)
{
	struct dma_fence **found = NULL;
	struct ww_acquire_ctx ctx;
	u32 count = 0, cap = 0, i;
	int ret;

	n = tdrv_resv_merge(uses, n);
	ret = tdrv_resv_lock_all(uses, n, &ctx);
	if (ret)
		return ret;
	for (i = 0; i < n; i++) {
		struct dma_resv_iter cursor;
		struct dma_fence *f;

		/* The slot our fence takes below: reserved now, so that
		 * adding it cannot fail once other objects have it. */
		ret = dma_resv_reserve_fences(uses[i].resv, 1);
		if (ret)
			goto out;
		dma_resv_for_each_fence(&cursor, uses[i].resv,
					dma_resv_usage_rw(uses[i].write), f) {
			/* Jobs already in our engine's queue run before this
			 * one anyway (the engine keeps the order of jobs that
			 * share a buffer), as drm_sched does not wait for
			 * the fences of its own ring. */
			if (dma_fence_is_signaled(f) || tdrv_fence_queued_on(f, engine))
				continue;
			if (count == cap) {
				u32 want = cap ? cap * 2 : 8;
				struct dma_fence **more;

				more = krealloc_array(found, want, sizeof(*found),
						      GFP_KERNEL_ACCOUNT);
				if (!more) {
					ret = -ENOMEM;
					goto out;
				}
				found = more;
				cap = want;
			}
			found[count++] = dma_fence_get(f);
		}
	}
	if (count) {
		struct tdrv_deps *deps = tdrv_deps_with_implicit(*depsp, found, count);

		if (!deps) {
			ret = -ENOMEM;
			goto out;
		}
		*depsp = deps;
		/* The set has the references now. */
		count = 0;
	}
	for (i = 0; i < n; i++)
		dma_resv_add_fence(uses[i].resv, fence,
				   uses[i].write ? DMA_RESV_USAGE_WRITE :
						   DMA_RESV_USAGE_READ);
	ret = 0;
out:
	for (i = 0; i < n; i++)
		dma_resv_unlock(uses[i].resv);
	ww_acquire_fini(&ctx);
	for (i = 0; i < count; i++)
		dma_fence_put(found[i]);
	kfree(found);
	return ret;
}

int tdrv_resv_wait_cpu(struct dma_resv *resv, bool write)
{
	long r = dma_resv_wait_timeout(resv, dma_resv_usage_rw(write), true,
				       MAX_SCHEDULE_TIMEOUT);

	return r < 0 ? (int)r : 0;
}
