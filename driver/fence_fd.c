// SPDX-License-Identifier: GPL-2.0
/*
 * tdrv: fence fds of jobs, the narrow C side of driver/fence_fd.rs.
 *
 * 7.2 has no Rust abstraction of dma_fence or sync_file. Everything that
 * touches them is here, behind a handful of functions; the reasoning
 * (lifetimes, module unload, contexts) is in the module doc of
 * driver/fence_fd.rs.
 *
 * Without CONFIG_SYNC_FILE (e.g. Debian's cloud kernel) the module still
 * builds and loads: tdrv_fence_fd_supported() is false and the fd
 * functions return -EOPNOTSUPP. Job fences and dependency sets exist on
 * every kernel: implicit synchronisation through dma-buf reservation
 * objects (resv.c) needs no sync_file.
 */

#include <linux/dma-fence.h>
#include <linux/fcntl.h>
#include <linux/file.h>
#include <linux/rcupdate.h>
#include <linux/slab.h>
#include <linux/sync_file.h>
#include <linux/workqueue.h>

#include "fence_fd.h"

bool tdrv_fence_fd_supported(void)
{
	return IS_ENABLED(CONFIG_SYNC_FILE);
}

/*
 * Out-fences have no release and no wait op, so dma_fence_signal() sets
 * their ops to NULL: from then on the fence (freed by the core with
 * kfree_rcu) and its sync_file need nothing of this module. The two name
 * ops run only for unsignalled fences, inside an RCU read-side section
 * (dma_fence_driver_name/timeline_name); module exit waits for those
 * sections (tdrv_fence_module_exit) after every fence was signalled.
 *
 * Proof against Linux 7.2 (linux-source-7.2.tar.xz of Debian's 7.2.13-1;
 * paths relative to its top directory):
 *
 * 1. The NULL lock of dma_fence_init (tdrv_fence_new below) makes the lock
 *    part of the fence: __dma_fence_init, drivers/dma-buf/dma-fence.c:1079-1084,
 *    stores an external lock only when one is passed, else runs
 *    spin_lock_init(&fence->inline_lock) and sets
 *    DMA_FENCE_FLAG_INLINE_LOCK_BIT; every locker goes through
 *    dma_fence_spinlock(), include/linux/dma-fence.h:398-402, which picks
 *    &fence->inline_lock when that bit is set. So the lock lives and dies
 *    with the fence's own memory (dma-fence.c:1105-1107 recommends exactly
 *    this: an external lock couples lock and fence lifetime), and
 *    dma_fence_signal, dma-fence.c:498-500, takes it from any context with
 *    irqsave. Both name ops exist, as __dma_fence_init's BUG_ON at
 *    dma-fence.c:1065 demands.
 *
 * 2. A sync_file that outlives rmmod needs no module text or data:
 *    - Signalling detaches the ops: dma_fence_signal_timestamp_locked,
 *      dma-fence.c:373-375, sets fence->ops to NULL when the ops have
 *      neither .release nor .wait (ours have neither), after setting the
 *      signalled bit (dma-fence.c:361-363). Every out-fence is signalled
 *      before module exit (see fence_fd.rs: open files pin the module,
 *      unbind at exit ends every job, ending a job signals its fence).
 *    - Every later user of the ops checks for NULL under RCU:
 *      dma_fence_release, dma-fence.c:607-611 (NULL ops: dma_fence_free,
 *      i.e. kfree_rcu in the core, dma-fence.c:623-626: the kzalloc'd
 *      fence needs no module code to be freed; struct tdrv_fence starts
 *      with it, so that frees the whole allocation); __dma_fence_enable_signaling,
 *      dma-fence.c:642-644 (sync_file_poll's dma_fence_add_callback);
 *      dma_fence_wait_timeout, dma-fence.c:540-551; dma_fence_is_signaled,
 *      include/linux/dma-fence.h:555-563 (sync_file_poll, FILE_INFO);
 *      dma_fence_driver_name/timeline_name, dma-fence.c:1165-1180 and
 *      1203-1218, return core strings ("detached-driver",
 *      "signaled-timeline") once the fence signalled or its ops are NULL.
 *    - The sync_file itself is the core's: its file_operations are
 *      sync_file_fops (drivers/dma-buf/sync_file.c:402-407, release at
 *      sync_file.c:185-193 drops the fence reference and removes the poll
 *      callback, both core code), so its fd does not pin tdrv and needs
 *      nothing of it.
 *    - A name query that loaded the ops before the signal may still be
 *      running tdrv_fence_driver_name: those callers hold rcu_read_lock
 *      across the call and the use of the string (sync_file.c:141-149 and
 *      274-290, dma-fence.c:577-612), and tdrv_fence_module_exit's
 *      synchronize_rcu waits for them before the text and the strings go.
 *
 * guest test: fencefd "out-fence fds outlive rmmod" (FILE_INFO, poll and
 * close of a signalled out-fence held across rmmod).
 */
static const char *tdrv_fence_driver_name(struct dma_fence *fence)
{
	return "tdrv";
}

static const char *tdrv_fence_timeline_name(struct dma_fence *fence)
{
	return "tdrv-job";
}

static const struct dma_fence_ops tdrv_fence_ops = {
	.get_driver_name = tdrv_fence_driver_name,
	.get_timeline_name = tdrv_fence_timeline_name,
};

/*
 * A job's fence, and what implicit synchronisation (resv.c) needs to know
 * about it: the engine that runs the job and whether the job has reached
 * that engine's queue.
 */
struct tdrv_fence {
	/* First: a signalled fence has no ops and the core frees it with
	 * kfree_rcu() of this member, which must be the allocation. */
	struct dma_fence base;
	/* The device (engine) the job runs on; only compared. */
	const void *engine;
	/* Set (release) once the job is in its engine's queue. */
	bool queued;
};

static_assert(offsetof(struct tdrv_fence, base) == 0);

/* A new unsignalled fence of a job on @engine, with its own context (see
 * fence_fd.rs: jobs of one file may end out of order), its own lock, and
 * one reference. */
struct dma_fence *tdrv_fence_new(const void *engine)
{
	struct tdrv_fence *f = kzalloc(sizeof(*f), GFP_KERNEL_ACCOUNT);

	if (!f)
		return NULL;
	f->engine = engine;
	dma_fence_init(&f->base, &tdrv_fence_ops, NULL, dma_fence_context_alloc(1), 1);
	return &f->base;
}

/* The job of @fence is in its engine's queue: jobs of the same engine
 * queued later run after it, so they need not wait for its fence. */
void tdrv_fence_set_queued(struct dma_fence *fence)
{
	smp_store_release(&container_of(fence, struct tdrv_fence, base)->queued, true);
}

/*
 * True if @fence is the fence of a tdrv job that runs on @engine and is in
 * its queue already. The caller holds a reference to @fence. A signalled
 * tdrv fence has no ops any more (and is not ours by this test), which
 * the callers treat as done anyway.
 */
bool tdrv_fence_queued_on(struct dma_fence *fence, const void *engine)
{
	struct tdrv_fence *f;

	if (rcu_access_pointer(fence->ops) != &tdrv_fence_ops)
		return false;
	f = container_of(fence, struct tdrv_fence, base);
	return f->engine == engine && smp_load_acquire(&f->queued);
}

/* Signals the fence, with error (a negative errno) or 0. Call once. */
void tdrv_fence_signal(struct dma_fence *fence, int error)
{
	bool cookie = dma_fence_begin_signalling();

	if (error < 0 && error >= -MAX_ERRNO)
		dma_fence_set_error(fence, error);
	dma_fence_signal(fence);
	dma_fence_end_signalling(cookie);
}

void tdrv_fence_put(struct dma_fence *fence)
{
	dma_fence_put(fence);
}

/* One dependency of a job: the callback node lives as long as the set. */
struct tdrv_dep {
	struct dma_fence_cb cb;
	struct dma_fence *fence;
	struct tdrv_deps *deps;
	/* From a reservation object (resv.c), not an in-fence fd: it orders
	 * the job, its error does not fail it. */
	bool implicit;
};

struct tdrv_deps {
	/* Fences not yet signalled, plus one while arming. */
	atomic_t pending;
	void *ctx;
	u32 count;
	struct tdrv_dep dep[] __counted_by(count);
};

static struct tdrv_deps *tdrv_deps_alloc(u32 count)
{
	struct tdrv_deps *deps;
	u32 i;

	deps = kzalloc(struct_size(deps, dep, count), GFP_KERNEL_ACCOUNT);
	if (!deps)
		return NULL;
	deps->count = count;
	for (i = 0; i < count; i++) {
		INIT_LIST_HEAD(&deps->dep[i].cb.node);
		deps->dep[i].deps = deps;
	}
	return deps;
}

/*
 * A set holding the fences of @old (may be NULL; not armed) followed by
 * the @n implicit dependencies @fences, whose references it takes over.
 * Allocates (GFP_KERNEL); returns NULL, changing nothing, if that fails.
 * On success @old's container is freed (its references moved).
 */
struct tdrv_deps *tdrv_deps_with_implicit(struct tdrv_deps *old,
					  struct dma_fence **fences, u32 n)
{
	u32 have = old ? old->count : 0;
	struct tdrv_deps *deps = tdrv_deps_alloc(have + n);
	u32 i;

	if (!deps)
		return NULL;
	for (i = 0; i < have; i++)
		deps->dep[i].fence = old->dep[i].fence;
	for (i = 0; i < n; i++) {
		deps->dep[have + i].fence = fences[i];
		deps->dep[have + i].implicit = true;
	}
	kfree(old);
	return deps;
}

#if IS_ENABLED(CONFIG_SYNC_FILE)

/*
 * Creates a sync_file holding its own reference to fence and reserves an
 * O_CLOEXEC descriptor for it, not yet visible to userspace. Returns the
 * descriptor (and the file in *filep), or a negative errno. Finish with
 * tdrv_fence_fd_install or tdrv_fence_fd_discard, in the same task.
 */
int tdrv_fence_fd_reserve(struct dma_fence *fence, struct file **filep)
{
	struct sync_file *sync_file;
	int fd = get_unused_fd_flags(O_CLOEXEC);

	if (fd < 0)
		return fd;
	sync_file = sync_file_create(fence);
	if (!sync_file) {
		put_unused_fd(fd);
		return -ENOMEM;
	}
	*filep = sync_file->file;
	return fd;
}

void tdrv_fence_fd_install(int fd, struct file *file)
{
	fd_install(fd, file);
}

void tdrv_fence_fd_discard(int fd, struct file *file)
{
	fput(file);
	put_unused_fd(fd);
}


/*
 * Takes a reference to the fence of each sync_file fd. -EBADF for a
 * descriptor that is not open, -EINVAL for one that is not a sync_file,
 * -ENOMEM. On success *depsp owns the references (tdrv_deps_free).
 */
int tdrv_deps_new(const s32 *fds, u32 count, struct tdrv_deps **depsp)
{
	struct tdrv_deps *deps;
	u32 i;

	deps = tdrv_deps_alloc(count);
	if (!deps)
		return -ENOMEM;
	for (i = 0; i < count; i++) {
		struct tdrv_dep *dep = &deps->dep[i];
		struct file *file = fds[i] >= 0 ? fget(fds[i]) : NULL;

		if (!file) {
			tdrv_deps_free(deps);
			return -EBADF;
		}
		fput(file);
		dep->fence = sync_file_get_fence(fds[i]);
		if (!dep->fence) {
			tdrv_deps_free(deps);
			return -EINVAL;
		}
	}
	*depsp = deps;
	return 0;
}

#else /* !CONFIG_SYNC_FILE */

int tdrv_fence_fd_reserve(struct dma_fence *fence, struct file **filep)
{
	return -EOPNOTSUPP;
}

void tdrv_fence_fd_install(int fd, struct file *file)
{
}

void tdrv_fence_fd_discard(int fd, struct file *file)
{
}

int tdrv_deps_new(const s32 *fds, u32 count, struct tdrv_deps **depsp)
{
	return -EOPNOTSUPP;
}

#endif /* CONFIG_SYNC_FILE */

static void tdrv_dep_signalled(struct dma_fence *fence, struct dma_fence_cb *cb)
{
	struct tdrv_dep *dep = container_of(cb, struct tdrv_dep, cb);
	struct tdrv_deps *deps = dep->deps;

	/* The set stays alive: tdrv_deps_free removes this callback first,
	 * which waits for this call (it runs under the fence's lock). */
	if (atomic_dec_and_test(&deps->pending))
		tdrv_deps_ready(deps->ctx);
}

/*
 * Arms a callback on every fence. Returns true if all had signalled
 * already (tdrv_deps_ready will not be called); else tdrv_deps_ready(ctx)
 * is called exactly once, when the last one signals, unless the set is
 * freed first. Call once.
 */
bool tdrv_deps_arm(struct tdrv_deps *deps, void *ctx)
{
	u32 i;

	deps->ctx = ctx;
	atomic_set(&deps->pending, deps->count + 1);
	for (i = 0; i < deps->count; i++) {
		struct tdrv_dep *dep = &deps->dep[i];

		/* -ENOENT: already signalled, and no callback was added. */
		if (dma_fence_add_callback(dep->fence, &dep->cb, tdrv_dep_signalled))
			atomic_dec(&deps->pending);
	}
	return atomic_dec_and_test(&deps->pending);
}

/* The first error among the fences (all signalled): a negative errno, or
 * 0 if every one succeeded. */
int tdrv_deps_error(struct tdrv_deps *deps)
{
	u32 i;

	for (i = 0; i < deps->count; i++) {
		int status;

		/* An implicit dependency orders the job, nothing more (see
		 * resv.c). */
		if (deps->dep[i].implicit)
			continue;
		status = dma_fence_get_status(deps->dep[i].fence);

		if (status < 0)
			return status;
	}
	return 0;
}

/*
 * Removes the callbacks that have not run and waits for any that is
 * running (dma_fence_remove_callback takes the fence's lock, under which
 * callbacks run), then drops the references. Afterwards nothing refers to
 * the set or to this module's callback. Process or atomic context.
 */
void tdrv_deps_free(struct tdrv_deps *deps)
{
	u32 i;

	for (i = 0; i < deps->count; i++) {
		struct tdrv_dep *dep = &deps->dep[i];

		if (!dep->fence)
			continue;
		dma_fence_remove_callback(dep->fence, &dep->cb);
		dma_fence_put(dep->fence);
	}
	kfree(deps);
}


/*
 * Lockdep annotation of a dma-fence signalling critical section (see
 * Documentation/driver-api/dma-buf.rst, "Indefinite DMA Fences"): code
 * that fences wait for must not allocate with reclaim, nor take locks
 * held elsewhere around such allocations. Without CONFIG_LOCKDEP both are
 * no-ops.
 */
bool tdrv_fence_begin_signalling(void)
{
	return dma_fence_begin_signalling();
}

void tdrv_fence_end_signalling(bool cookie)
{
	dma_fence_end_signalling(cookie);
}

/* The queue of the files' dispatch work items (queued by in-fence
 * callbacks), owned by the module so that exit can drain it. */
static struct workqueue_struct *tdrv_dispatch_wq;

/* The queue of the engines' work: the soft engine's copies, the sim
 * device's deferred work and watchdog, edu's watchdog. */
static struct workqueue_struct *tdrv_engine_wq;

/*
 * Both queues signal out-fences (dispatch queues a job or ends it with an
 * error, the engine work completes it), and reclaim may wait on those
 * fences. A queue without WQ_MEM_RECLAIM may need a new kworker to make
 * progress, and creating one can wait on that same reclaim: so each has
 * a rescuer thread (kworker/R-tdrv-dispatch, kworker/R-tdrv-engine), as
 * drm_sched's queues do.
 */
int tdrv_fence_module_init(void)
{
	tdrv_dispatch_wq = alloc_workqueue("tdrv-dispatch",
					   WQ_UNBOUND | WQ_MEM_RECLAIM, 0);
	if (!tdrv_dispatch_wq)
		return -ENOMEM;
	tdrv_engine_wq = alloc_workqueue("tdrv-engine",
					 WQ_UNBOUND | WQ_MEM_RECLAIM, 0);
	if (!tdrv_engine_wq) {
		destroy_workqueue(tdrv_dispatch_wq);
		tdrv_dispatch_wq = NULL;
		return -ENOMEM;
	}
	return 0;
}

struct workqueue_struct *tdrv_dispatch_queue(void)
{
	return tdrv_dispatch_wq;
}

struct workqueue_struct *tdrv_engine_queue(void)
{
	return tdrv_engine_wq;
}

/*
 * Module exit, after every device is gone (so every out-fence was
 * signalled and every in-fence callback removed, though a callback's
 * dispatch work may still be pending): runs what is left of the dispatch
 * work and frees its queue, then waits for RCU readers that may still be
 * inside tdrv_fence_driver_name/timeline_name, or using the strings they
 * returned, before the module's text and data go.
 */
void tdrv_fence_module_exit(void)
{
	if (tdrv_dispatch_wq)
		destroy_workqueue(tdrv_dispatch_wq);
	tdrv_dispatch_wq = NULL;
	if (tdrv_engine_wq)
		destroy_workqueue(tdrv_engine_wq);
	tdrv_engine_wq = NULL;
	synchronize_rcu();
}
