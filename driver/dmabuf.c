// SPDX-License-Identifier: GPL-2.0
/*
 * tdrv: dma-buf export and import (see dmabuf.h for the interface and
 * driver/dmabuf.rs for the design). The C side owns everything that is a
 * macro or an inline in C (export info, scatterlist walks, iosys_map);
 * the buffer logic stays in Rust behind three callbacks.
 */

#include <linux/dma-buf.h>
#include <linux/dma-buf-mapping.h>
#include <linux/dma-direct.h>
#include <linux/dma-direction.h>
#include <linux/dma-map-ops.h>
#include <linux/dma-resv.h>
#include <linux/err.h>
#include <linux/fcntl.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/iosys-map.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/pci-p2pdma.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/swiotlb.h>
#include <linux/vmalloc.h>
#include <linux/workqueue.h>

#include "dmabuf.h"
#include "resv.h"

MODULE_IMPORT_NS("DMA_BUF");

/*
 * One export's state: the buffer reference the dma-buf holds, and how many
 * DMA mappings (map_dma_buf) and kernel mappings (vmap) of its pages
 * other users hold. Unbind revokes the mappings and frees the memory only
 * once the count is zero (see driver/dmabuf.rs, "Revocation").
 */
struct tdrv_export {
	const void *buf;
	atomic_t users;
	/* The DMA mappings of revocable importers among them: unbind waits
	 * for these after telling the importers. */
	atomic_t revocable;
	wait_queue_head_t idle;
};

static void tdrv_export_put_user(struct tdrv_export *exp)
{
	if (atomic_dec_and_test(&exp->users))
		wake_up_all(&exp->idle);
}

static void tdrv_export_put_mapping(struct tdrv_export *exp,
				    struct dma_buf_attachment *attach)
{
	if (dma_buf_attach_revocable(attach) &&
	    atomic_dec_and_test(&exp->revocable))
		wake_up_all(&exp->idle);
	tdrv_export_put_user(exp);
}

/*
 * The pages of the export, in order, in a new array (kvfree it). Fails
 * with the buffer's refusal: -EOPNOTSUPP for device memory, -ENODEV once
 * the device is being unbound.
 */
static struct page **tdrv_export_pages(struct tdrv_export *exp, size_t n)
{
	unsigned long *pfns;
	size_t i;
	int ret;

	pfns = kvmalloc_array(n, sizeof(*pfns), GFP_KERNEL);
	if (!pfns)
		return ERR_PTR(-ENOMEM);
	ret = tdrv_dmabuf_buffer_pfns(exp->buf, pfns, n);
	if (ret) {
		kvfree(pfns);
		return ERR_PTR(ret);
	}
	/* struct page pointers are the same size: convert in place. */
	BUILD_BUG_ON(sizeof(struct page *) != sizeof(unsigned long));
	for (i = 0; i < n; i++)
		((struct page **)pfns)[i] = pfn_to_page(pfns[i]);
	return (struct page **)pfns;
}

/* True if @dev maps memory directly (no IOMMU, DMA ops or bounce buffers),
 * with the highest bus address it reaches in @limit: only then can a page
 * beyond its mask be known before mapping it. */
static bool tdrv_direct_dma_limit(struct device *dev, u64 *limit)
{
	if (!dev->dma_mask || get_dma_ops(dev) || dev_dma_iommu(dev))
		return false;
#ifdef CONFIG_SWIOTLB
	if (dev->dma_io_tlb_mem && dev->dma_io_tlb_mem->nslabs)
		return false;
#endif
	*limit = min_not_zero(*dev->dma_mask, dev->bus_dma_limit);
	return true;
}

/* True if @dev maps memory directly and one of @pages lies beyond its DMA
 * mask: mapping it would fail with a WARN of the DMA core. */
static bool tdrv_pages_beyond_mask(struct device *dev, struct page **pages,
				   size_t n)
{
	u64 limit;
	size_t i;

	if (!tdrv_direct_dma_limit(dev, &limit))
		return false;
	for (i = 0; i < n; i++)
		if (phys_to_dma(dev, page_to_phys(pages[i])) + PAGE_SIZE - 1 > limit)
			return true;
	return false;
}

/*
 * Whether device memory of a tdrv device (the sim device's HBM, behind a
 * BAR) can be mapped for @attach's device, peer-to-peer: 0 if so, else
 * -EOPNOTSUPP (the importer takes no P2P memory, the device is no P2P
 * provider, or the PCI topology has no path between them) or -EIO (beyond
 * the importer's DMA mask), with one rate-limited line saying why.
 *
 * Called with the reservation lock held. Unbind detaches the memory (after
 * which the buffer reports -ENODEV) and then takes every export's
 * reservation lock to revoke it, before the provider (device-managed) goes:
 * so @provider is live here and in tdrv_dmabuf_map().
 */
static int tdrv_p2p_check(struct dma_buf_attachment *attach,
			  struct p2pdma_provider *provider, u64 phys,
			  size_t len)
{
	struct device *dev = attach->dev;
	const char *why;
	u64 limit;

	if (!attach->peer2peer) {
		why = "the importer takes no peer-to-peer memory";
	} else if (!provider) {
		why = "the device is no peer-to-peer DMA provider";
	} else if (pci_p2pdma_distance(to_pci_dev(provider->owner), dev, false) < 0) {
		why = "no peer-to-peer DMA path between the two devices";
	} else if (tdrv_direct_dma_limit(dev, &limit) &&
		   phys + provider->bus_offset + len - 1 > limit) {
		/* Below a common bridge the bus address is used as it is
		 * (the DMA API never sees it); through the host bridge the
		 * direct mapping would refuse it the same. */
		dev_info_ratelimited(dev,
			"tdrv: cannot attach to tdrv device memory: its bus address is beyond this device's DMA mask\n");
		return -EIO;
	} else {
		return 0;
	}
	dev_info_ratelimited(dev,
		"tdrv: cannot attach to tdrv device memory: %s\n", why);
	return -EOPNOTSUPP;
}

/*
 * Host memory: any device may attach, but pages beyond the importer's DMA
 * mask (with a direct mapping) are EIO. Device memory (the sim device's
 * HBM behind its BAR) has no struct pages: it is mapped peer-to-peer
 * where the PCI topology allows (tdrv_p2p_check) and refused otherwise;
 * never copied through host memory behind the importer's back.
 */
static int tdrv_dmabuf_attach(struct dma_buf *dmabuf,
			      struct dma_buf_attachment *attach)
{
	struct tdrv_export *exp = dmabuf->priv;
	size_t n = dmabuf->size >> PAGE_SHIFT;
	struct p2pdma_provider *provider;
	struct page **pages;
	u64 phys;
	int ret;

	dma_resv_lock(dmabuf->resv, NULL);
	ret = tdrv_dmabuf_buffer_p2p(exp->buf, (void **)&provider, &phys);
	if (ret > 0)
		ret = tdrv_p2p_check(attach, provider, phys, dmabuf->size);
	else if (ret == 0)
		ret = 1;
	dma_resv_unlock(dmabuf->resv);
	if (ret <= 0)
		return ret;
	pages = tdrv_export_pages(exp, n);
	if (IS_ERR(pages))
		return PTR_ERR(pages);
	ret = 0;
	if (tdrv_pages_beyond_mask(attach->dev, pages, n))
		ret = -EIO;
	kvfree(pages);
	return ret;
}

/* The memory never moves: pinning has nothing to do. */
static int tdrv_dmabuf_pin(struct dma_buf_attachment *attach)
{
	return 0;
}

static void tdrv_dmabuf_unpin(struct dma_buf_attachment *attach)
{
}

static struct sg_table *tdrv_dmabuf_map(struct dma_buf_attachment *attach,
					enum dma_data_direction dir)
{
	struct tdrv_export *exp = attach->dmabuf->priv;
	size_t n = attach->dmabuf->size >> PAGE_SHIFT;
	struct p2pdma_provider *provider;
	struct sg_table *sgt;
	struct page **pages;
	u64 phys;
	int ret;

	if (!attach->dev->dma_mask)
		return ERR_PTR(-EOPNOTSUPP);
	/* Counted before the buffer is asked for its pages: unbind marks
	 * the memory detached first and reads the count after, so either
	 * it sees this mapping or the buffer refuses it. */
	atomic_inc(&exp->users);
	if (dma_buf_attach_revocable(attach))
		atomic_inc(&exp->revocable);
	ret = tdrv_dmabuf_buffer_p2p(exp->buf, (void **)&provider, &phys);
	if (ret < 0)
		goto err_user;
	if (ret > 0) {
		/* Device memory, peer-to-peer (under the reservation lock,
		 * which the core holds for every map: see tdrv_p2p_check). */
		struct phys_vec vec = { .paddr = phys, .len = attach->dmabuf->size };

		ret = tdrv_p2p_check(attach, provider, phys, vec.len);
		if (ret)
			goto err_user;
		sgt = dma_buf_phys_vec_to_sgt(attach, provider, &vec, 1,
					      vec.len, dir);
		if (IS_ERR(sgt)) {
			ret = PTR_ERR(sgt);
			goto err_user;
		}
		return sgt;
	}
	pages = tdrv_export_pages(exp, n);
	if (IS_ERR(pages)) {
		ret = PTR_ERR(pages);
		goto err_user;
	}
	ret = -EIO;
	if (tdrv_pages_beyond_mask(attach->dev, pages, n))
		goto err_pages;
	ret = -ENOMEM;
	sgt = kzalloc(sizeof(*sgt), GFP_KERNEL);
	if (!sgt)
		goto err_pages;
	/* Contiguous pages merge into one segment; every piece is in it. */
	ret = sg_alloc_table_from_pages(sgt, pages, n, 0, n << PAGE_SHIFT,
					GFP_KERNEL);
	if (ret)
		goto err_sgt;
	ret = dma_map_sgtable(attach->dev, sgt, dir, 0);
	if (ret)
		goto err_table;
	kvfree(pages);
	return sgt;

err_table:
	sg_free_table(sgt);
err_sgt:
	kfree(sgt);
err_pages:
	kvfree(pages);
err_user:
	tdrv_export_put_mapping(exp, attach);
	return ERR_PTR(ret);
}

static void tdrv_dmabuf_unmap(struct dma_buf_attachment *attach,
			      struct sg_table *sgt,
			      enum dma_data_direction dir)
{
	struct tdrv_export *exp = attach->dmabuf->priv;

	/* A peer-to-peer table has no CPU list (orig_nents 0); one of
	 * pages always has. */
	if (!sgt->orig_nents) {
		/* dma_buf_phys_vec_to_sgt() zeroes orig_nents after filling
		 * all nents entries it allocated, and dma_buf_free_sgt()'s
		 * sg_free_table() frees orig_nents entries: without this,
		 * the entries leak (kmemleak reported them in the guest). */
		sgt->orig_nents = sgt->nents;
		dma_buf_free_sgt(attach, sgt, dir);
	} else {
		dma_unmap_sgtable(attach->dev, sgt, dir, 0);
		sg_free_table(sgt);
		kfree(sgt);
	}
	tdrv_export_put_mapping(exp, attach);
}

/* A kernel mapping for CPU importers (another tdrv device's software
 * engine and COPY_IN/OUT, for example). The core calls it once while any
 * importer holds a mapping (it counts them). */
static int tdrv_dmabuf_vmap(struct dma_buf *dmabuf, struct iosys_map *map)
{
	struct tdrv_export *exp = dmabuf->priv;
	size_t n = dmabuf->size >> PAGE_SHIFT;
	struct page **pages;
	void *vaddr;

	atomic_inc(&exp->users);
	pages = tdrv_export_pages(exp, n);
	if (IS_ERR(pages)) {
		tdrv_export_put_user(exp);
		return PTR_ERR(pages);
	}
	vaddr = vmap(pages, n, VM_MAP, PAGE_KERNEL);
	kvfree(pages);
	if (!vaddr) {
		tdrv_export_put_user(exp);
		return -ENOMEM;
	}
	iosys_map_set_vaddr(map, vaddr);
	return 0;
}

static void tdrv_dmabuf_vunmap(struct dma_buf *dmabuf, struct iosys_map *map)
{
	vunmap(map->vaddr);
	tdrv_export_put_user(dmabuf->priv);
}

static void tdrv_dmabuf_release(struct dma_buf *dmabuf)
{
	struct tdrv_export *exp = dmabuf->priv;

	tdrv_dmabuf_release_buffer(exp->buf, dmabuf);
	kfree(exp);
}

static int tdrv_dmabuf_mmap(struct dma_buf *dmabuf, struct vm_area_struct *vma)
{
	return tdrv_dmabuf_mmap_buffer(((struct tdrv_export *)dmabuf->priv)->buf, vma);
}

static int tdrv_dmabuf_begin_cpu_access(struct dma_buf *dmabuf,
					enum dma_data_direction dir)
{
	bool write = dir != DMA_FROM_DEVICE;
	/* Other drivers' work first (fences in the reservation object: an
	 * importer's job, or a sync_file imported with
	 * DMA_BUF_IOCTL_IMPORT_SYNC_FILE), then tdrv's own. */
	int ret = tdrv_resv_wait_cpu(dmabuf->resv, write);

	if (ret)
		return ret;
	return tdrv_dmabuf_begin_cpu(((struct tdrv_export *)dmabuf->priv)->buf, write);
}

static const struct dma_buf_ops tdrv_dmabuf_ops = {
	.attach = tdrv_dmabuf_attach,
	.pin = tdrv_dmabuf_pin,
	.unpin = tdrv_dmabuf_unpin,
	.map_dma_buf = tdrv_dmabuf_map,
	.unmap_dma_buf = tdrv_dmabuf_unmap,
	.release = tdrv_dmabuf_release,
	.mmap = tdrv_dmabuf_mmap,
	.begin_cpu_access = tdrv_dmabuf_begin_cpu_access,
	.vmap = tdrv_dmabuf_vmap,
	.vunmap = tdrv_dmabuf_vunmap,
};

struct dma_buf *tdrv_dmabuf_export(const void *buf, size_t size,
				   struct dma_resv *resv)
{
	DEFINE_DMA_BUF_EXPORT_INFO(info);
	struct tdrv_export *exp;
	struct dma_buf *dmabuf;

	exp = kzalloc(sizeof(*exp), GFP_KERNEL_ACCOUNT);
	if (!exp)
		return ERR_PTR(-ENOMEM);
	exp->buf = buf;
	atomic_set(&exp->users, 0);
	atomic_set(&exp->revocable, 0);
	init_waitqueue_head(&exp->idle);
	info.exp_name = "tdrv";
	/* An exported fd pins the module: the release callback is ours. */
	info.owner = THIS_MODULE;
	info.ops = &tdrv_dmabuf_ops;
	info.size = size;
	info.flags = O_RDWR;
	info.priv = exp;
	/* The buffer's own: every export of the buffer shares it. */
	info.resv = resv;
	dmabuf = dma_buf_export(&info);
	if (IS_ERR(dmabuf))
		kfree(exp);
	return dmabuf;
}

int tdrv_dmabuf_revoke(struct dma_buf *dmabuf, unsigned long timeout)
{
	struct tdrv_export *exp = dmabuf->priv;

	dma_resv_lock(dmabuf->resv, NULL);
	dma_buf_invalidate_mappings(dmabuf);
	dma_resv_unlock(dmabuf->resv);
	/* Revocable importers unmap in bounded time; others keep theirs
	 * until they are done (the memory waits for them). */
	wait_event_timeout(exp->idle, !atomic_read(&exp->revocable), timeout);
	return atomic_read(&exp->users);
}

void tdrv_dmabuf_log_no_p2p(void)
{
	pr_info_ratelimited("tdrv: IMPORT of another tdrv device's device memory refused: no peer-to-peer DMA path to it\n");
}

int tdrv_dmabuf_users(struct dma_buf *dmabuf)
{
	return atomic_read(&((struct tdrv_export *)dmabuf->priv)->users);
}

struct inode *tdrv_dmabuf_hold_inode(struct dma_buf *dmabuf)
{
	struct inode *inode = file_inode(dmabuf->file);

	ihold(inode);
	return inode;
}

void tdrv_dmabuf_zap(struct inode *inode)
{
	/* Length 0: the whole file. */
	unmap_mapping_range(inode->i_mapping, 0, 0, 1);
}

void tdrv_dmabuf_put_inode(struct inode *inode)
{
	iput(inode);
}

int tdrv_dmabuf_reserve_fd(void)
{
	return get_unused_fd_flags(O_CLOEXEC);
}

void tdrv_dmabuf_install(struct dma_buf *dmabuf, int fd)
{
	dma_buf_fd_install(dmabuf, fd);
}

void tdrv_dmabuf_unreserve_fd(int fd)
{
	put_unused_fd(fd);
}

void tdrv_dmabuf_put(struct dma_buf *dmabuf)
{
	dma_buf_put(dmabuf);
}

int tdrv_dmabuf_lookup(int fd, struct dma_buf **out, const void **own)
{
	struct dma_buf *dmabuf;

	if (fd < 0)
		return -EBADF;
	dmabuf = dma_buf_get(fd);
	if (IS_ERR(dmabuf))
		return PTR_ERR(dmabuf);
	*out = dmabuf;
	*own = dmabuf->ops == &tdrv_dmabuf_ops ?
	       ((struct tdrv_export *)dmabuf->priv)->buf : NULL;
	return 0;
}

/*
 * An import's access word: the number of accesses in progress (a job
 * running on the importing device, an ioctl's copy, a page fault), and
 * TDRV_IMPORT_REVOKED once the exporter revoked the import.
 */
#define TDRV_IMPORT_REVOKED	BIT(30)

/* How long a revocation waits for the importing device's accesses in
 * progress (each is bounded: a job's next piece or chunk, an ioctl's
 * 64 KiB copy, a fault) before it gives up and keeps the mappings. */
#define TDRV_IMPORT_REVOKE_WAIT	(60 * HZ)

struct tdrv_import {
	struct dma_buf *dmabuf;
	struct iosys_map map;
	struct dma_buf_attachment *attach; /* NULL: CPU access only */
	struct sg_table *sgt;
	/* The owner's device (a Rust Arc<TdrvDevice> reference) for a
	 * revocable import, whose attachment is dynamic and pinned; NULL for
	 * a static one. */
	const void *ctx;
	/* The vmap (and sgt, pin) are held; under the reservation lock. */
	bool mapped;
	bool pinned;
	atomic_t access;
	wait_queue_head_t idle;
	/* The import itself, and each buffer built on it (see
	 * tdrv_import_get). */
	struct kref ref;
	/* Queued by tdrv_import_release_later(). */
	struct work_struct release_work;
	/* Given back to Rust once the queued release ran (may be NULL). */
	void *released;
};

/* Runs deferred import releases; unbind flushes it, module exit drains it. */
static struct workqueue_struct *tdrv_release_wq;

/* True if every DMA segment of @sgt is whole pages and they add up to
 * @size bytes. */
static bool tdrv_sgt_whole_pages(struct sg_table *sgt, size_t size)
{
	struct scatterlist *sg;
	size_t total = 0;
	unsigned int i;

	for_each_sgtable_dma_sg(sgt, sg, i) {
		if (!PAGE_ALIGNED(sg_dma_address(sg)) ||
		    !PAGE_ALIGNED(sg_dma_len(sg)))
			return false;
		total += sg_dma_len(sg);
	}
	return total >= size;
}

/*
 * True if @dev maps memory directly (no IOMMU, no bounce buffers) and some
 * page behind the kernel mapping @vaddr (@size bytes) lies beyond its DMA
 * mask. Mapping such a page for the device would fail with a one-time
 * WARN of the DMA core ("DMA addr ... overflow"), which userspace must not
 * be able to trigger: the import is refused with EIO first. Pages whose
 * frame cannot be found from the mapping are left to the exporter's map.
 */
static bool tdrv_beyond_dma_mask(struct device *dev, const void *vaddr,
				 size_t size)
{
	u64 limit;
	size_t off;

	if (!tdrv_direct_dma_limit(dev, &limit))
		return false;
	for (off = 0; off < size; off += PAGE_SIZE) {
		const void *p = vaddr + off;
		struct page *page;

		if (is_vmalloc_addr(p))
			page = vmalloc_to_page(p);
		else if (virt_addr_valid(p))
			page = virt_to_page(p);
		else
			return false;
		if (!page)
			return false;
		if (phys_to_dma(dev, page_to_phys(page)) + PAGE_SIZE - 1 > limit)
			return true;
	}
	return false;
}

static void tdrv_import_release_work(struct work_struct *work)
{
	struct tdrv_import *imp =
		container_of(work, struct tdrv_import, release_work);
	void *released = imp->released;

	tdrv_import_release(imp);
	if (released)
		tdrv_import_released(released);
}

static void tdrv_import_free(struct kref *ref)
{
	struct tdrv_import *imp = container_of(ref, struct tdrv_import, ref);

	dma_buf_put(imp->dmabuf);
	kfree(imp);
}

struct tdrv_import *tdrv_import_get(struct tdrv_import *imp)
{
	kref_get(&imp->ref);
	return imp;
}

void tdrv_import_put(struct tdrv_import *imp)
{
	kref_put(&imp->ref, tdrv_import_free);
}

bool tdrv_import_access_begin(struct tdrv_import *imp)
{
	/* Fully ordered, like the revocation's fetch_or: either this sees
	 * the flag, or the revocation's wait sees this access. */
	if (atomic_inc_return(&imp->access) & TDRV_IMPORT_REVOKED) {
		tdrv_import_access_end(imp);
		return false;
	}
	return true;
}

void tdrv_import_access_end(struct tdrv_import *imp)
{
	/* No allocation and no lock but the wait queue's: a job's
	 * completion (a dma-fence signalling path) ends its accesses. */
	if (atomic_dec_return(&imp->access) == TDRV_IMPORT_REVOKED)
		wake_up_all(&imp->idle);
}

bool tdrv_import_revoked(const struct tdrv_import *imp)
{
	return atomic_read(&imp->access) & TDRV_IMPORT_REVOKED;
}

/* Drops the vmap, the DMA mapping and the pin; under the reservation
 * lock. */
static void tdrv_import_unmap_locked(struct tdrv_import *imp)
{
	dma_resv_assert_held(imp->dmabuf->resv);
	if (!imp->mapped)
		return;
	if (imp->sgt)
		dma_buf_unmap_attachment(imp->attach, imp->sgt,
					 DMA_BIDIRECTIONAL);
	imp->sgt = NULL;
	if (imp->pinned)
		dma_buf_unpin(imp->attach);
	imp->pinned = false;
	/* A peer-to-peer import has no kernel mapping. */
	if (!iosys_map_is_null(&imp->map))
		dma_buf_vunmap(imp->dmabuf, &imp->map);
	iosys_map_clear(&imp->map);
	imp->mapped = false;
}

/*
 * The exporter revokes the buffer (it is being unbound, or it moves the
 * memory although the attachment is pinned). Called under the dma-buf's
 * reservation lock. From here on every access of the importing device
 * fails with ENODEV; those in progress are waited for (each is bounded,
 * and none takes a reservation lock), then the user mappings of the
 * importing device are zapped and the import unmapped, so that the
 * exporter may free the memory when this returns.
 */
static void tdrv_import_invalidate(struct dma_buf_attachment *attach)
{
	struct tdrv_import *imp = attach->importer_priv;

	if (atomic_fetch_or(TDRV_IMPORT_REVOKED, &imp->access) &
	    TDRV_IMPORT_REVOKED)
		return;
	if (!imp->mapped)
		return;
	if (!wait_event_timeout(imp->idle,
				atomic_read(&imp->access) == TDRV_IMPORT_REVOKED,
				TDRV_IMPORT_REVOKE_WAIT)) {
		/* Never reached with working engines; the memory then stays
		 * mapped (the exporter keeps it) rather than be freed under
		 * a device that may still reach it. */
		dev_warn(attach->dev,
			 "tdrv: revoked dma-buf still in use after 60 s: its mapping is kept\n");
		return;
	}
	tdrv_import_zap(imp->ctx);
	tdrv_import_unmap_locked(imp);
}

static const struct dma_buf_attach_ops tdrv_import_ops = {
	.allow_peer2peer = false,
	.invalidate_mappings = tdrv_import_invalidate,
};

/* A peer-to-peer import (of another device's memory behind a BAR): the
 * same, but it takes mappings without struct pages and never vmaps. */
static const struct dma_buf_attach_ops tdrv_import_p2p_ops = {
	.allow_peer2peer = true,
	.invalidate_mappings = tdrv_import_invalidate,
};

struct tdrv_import *tdrv_import_new(struct dma_buf *dmabuf, struct device *dev,
				    bool dma, const void *ctx, bool p2p)
{
	struct tdrv_import *imp;
	int ret;

	if (!PAGE_ALIGNED(dmabuf->size) || !dmabuf->size) {
		ret = -EINVAL;
		goto err_put;
	}
	/* Peer-to-peer needs a revocable DMA import: the exporter's BAR goes
	 * with its binding. */
	if (p2p && (!dma || !ctx)) {
		ret = -EOPNOTSUPP;
		goto err_put;
	}
	/* No kernel mapping at all (dma_buf_vmap would say EINVAL). */
	if (!p2p && !dmabuf->ops->vmap) {
		ret = -EOPNOTSUPP;
		goto err_put;
	}
	imp = kzalloc(sizeof(*imp), GFP_KERNEL_ACCOUNT);
	if (!imp) {
		ret = -ENOMEM;
		goto err_put;
	}
	imp->dmabuf = dmabuf;
	imp->ctx = ctx;
	atomic_set(&imp->access, 0);
	init_waitqueue_head(&imp->idle);
	kref_init(&imp->ref);
	INIT_WORK(&imp->release_work, tdrv_import_release_work);
	/* A revocable import attaches even without DMA: the attachment is
	 * how the exporter tells it. */
	if (ctx)
		imp->attach = dma_buf_dynamic_attach(dmabuf, dev,
				p2p ? &tdrv_import_p2p_ops : &tdrv_import_ops, imp);
	else if (dma)
		imp->attach = dma_buf_attach(dmabuf, dev);
	if (IS_ERR(imp->attach)) {
		ret = PTR_ERR(imp->attach);
		imp->attach = NULL;
		goto err_free;
	}
	dma_resv_lock(dmabuf->resv, NULL);
	ret = -ENODEV;
	if (tdrv_import_revoked(imp))
		goto err_unlock;
	if (!p2p) {
		ret = dma_buf_vmap(dmabuf, &imp->map);
		if (ret)
			goto err_unlock;
	}
	imp->mapped = true;
	if (imp->map.is_iomem) {
		ret = -EOPNOTSUPP;
		goto err_unmap;
	}
	if (ctx) {
		/* Pinned, so that only a revocation invalidates it (a
		 * movable exporter's moves would end it for good). */
		ret = dma_buf_pin(imp->attach);
		if (ret)
			goto err_unmap;
		imp->pinned = true;
	}
	if (dma) {
		struct sg_table *sgt;

		/* (The exporter checks a peer-to-peer mapping's reach.) */
		if (!p2p && tdrv_beyond_dma_mask(dev, imp->map.vaddr, dmabuf->size)) {
			ret = -EIO;
			goto err_unmap;
		}
		sgt = dma_buf_map_attachment(imp->attach, DMA_BIDIRECTIONAL);
		if (IS_ERR(sgt)) {
			ret = PTR_ERR(sgt);
			goto err_unmap;
		}
		imp->sgt = sgt;
		if (!tdrv_sgt_whole_pages(imp->sgt, dmabuf->size)) {
			ret = -EINVAL;
			goto err_unmap;
		}
	}
	dma_resv_unlock(dmabuf->resv);
	return imp;

err_unmap:
	tdrv_import_unmap_locked(imp);
err_unlock:
	dma_resv_unlock(dmabuf->resv);
	if (imp->attach)
		dma_buf_detach(dmabuf, imp->attach);
err_free:
	kfree(imp);
err_put:
	dma_buf_put(dmabuf);
	return ERR_PTR(ret);
}

struct dma_resv *tdrv_import_resv(const struct tdrv_import *imp)
{
	return imp->dmabuf->resv;
}

size_t tdrv_import_size(const struct tdrv_import *imp)
{
	return imp->dmabuf->size;
}

void *tdrv_import_vaddr(const struct tdrv_import *imp)
{
	return imp->map.vaddr;
}

void tdrv_import_dma_pages(const struct tdrv_import *imp, u64 *dma, size_t pages)
{
	struct scatterlist *sg;
	size_t n = 0;
	unsigned int i;

	if (!imp->sgt) {
		memset(dma, 0, pages * sizeof(*dma));
		return;
	}
	for_each_sgtable_dma_sg(imp->sgt, sg, i) {
		dma_addr_t addr = sg_dma_address(sg);
		size_t off;

		for (off = 0; off < sg_dma_len(sg) && n < pages; off += PAGE_SIZE)
			dma[n++] = addr + off;
	}
}

void tdrv_import_release(struct tdrv_import *imp)
{
	dma_resv_lock(imp->dmabuf->resv, NULL);
	/* Accesses through buffers that outlive the import fail. */
	atomic_or(TDRV_IMPORT_REVOKED, &imp->access);
	tdrv_import_unmap_locked(imp);
	dma_resv_unlock(imp->dmabuf->resv);
	if (imp->attach)
		dma_buf_detach(imp->dmabuf, imp->attach);
	if (imp->ctx)
		tdrv_import_put_ctx(imp->ctx);
	imp->ctx = NULL;
	tdrv_import_put(imp);
}

/*
 * The release takes the dma-buf's reservation lock (vunmap, unmap and
 * detach), which a dma-fence signalling path must not take: reclaim may
 * wait for fences under it. A buffer's last reference can go on such a
 * path (a job's completion), so the buffer hands its import here; its
 * work item was allocated with the import, so queueing needs no
 * memory.
 */
void tdrv_import_release_later(struct tdrv_import *imp, void *released)
{
	imp->released = released;
	queue_work(tdrv_release_wq, &imp->release_work);
}

void tdrv_import_flush_releases(void)
{
	flush_workqueue(tdrv_release_wq);
}

int tdrv_dmabuf_module_init(void)
{
	tdrv_release_wq = alloc_workqueue("tdrv-release", WQ_UNBOUND, 0);
	return tdrv_release_wq ? 0 : -ENOMEM;
}

void tdrv_dmabuf_module_exit(void)
{
	if (tdrv_release_wq)
		destroy_workqueue(tdrv_release_wq);
	tdrv_release_wq = NULL;
}

#if IS_ENABLED(CONFIG_KUNIT)
#include <linux/device/faux.h>
#include <linux/highmem.h>

/*
 * A KUnit importer that does what the RDMA core does for a pinned dma-buf
 * memory region: a dynamic attach that takes peer-to-peer memory and is
 * revocable, pin, map, and on invalidation unmap and unpin at once.
 */
struct tdrv_test_importer {
	struct faux_device *fdev;
	struct dma_buf *dmabuf;
	struct dma_buf_attachment *attach;
	struct sg_table *sgt;
	bool pinned;
	int invalidated;
};

static void tdrv_test_invalidate(struct dma_buf_attachment *attach)
{
	struct tdrv_test_importer *t = attach->importer_priv;

	t->invalidated++;
	if (t->sgt)
		dma_buf_unmap_attachment(attach, t->sgt, DMA_BIDIRECTIONAL);
	t->sgt = NULL;
	if (t->pinned)
		dma_buf_unpin(attach);
	t->pinned = false;
}

static const struct dma_buf_attach_ops tdrv_test_importer_ops = {
	.allow_peer2peer = true,
	.invalidate_mappings = tdrv_test_invalidate,
};

/* Attaches a new faux device (64-bit DMA) to @dmabuf, dynamic and
 * revocable if @dynamic, else static; takes a dma-buf reference. */
struct tdrv_test_importer *tdrv_test_importer_new(struct dma_buf *dmabuf,
						  const char *name, bool dynamic)
{
	struct tdrv_test_importer *t;
	struct device *dev;
	int ret;

	t = kzalloc(sizeof(*t), GFP_KERNEL);
	if (!t)
		return ERR_PTR(-ENOMEM);
	t->fdev = faux_device_create(name, NULL, NULL);
	if (!t->fdev) {
		kfree(t);
		return ERR_PTR(-ENODEV);
	}
	dev = &t->fdev->dev;
	dev->coherent_dma_mask = DMA_BIT_MASK(64);
	dev->dma_mask = &dev->coherent_dma_mask;
	get_dma_buf(dmabuf);
	t->dmabuf = dmabuf;
	t->attach = dynamic ?
		dma_buf_dynamic_attach(dmabuf, dev, &tdrv_test_importer_ops, t) :
		dma_buf_attach(dmabuf, dev);
	if (IS_ERR(t->attach)) {
		ret = PTR_ERR(t->attach);
		dma_buf_put(dmabuf);
		faux_device_destroy(t->fdev);
		kfree(t);
		return ERR_PTR(ret);
	}
	return t;
}

/* Pins (dynamic importers) and maps the attachment. */
int tdrv_test_importer_map(struct tdrv_test_importer *t)
{
	struct sg_table *sgt;
	int ret = 0;

	dma_resv_lock(t->dmabuf->resv, NULL);
	if (t->attach->importer_ops) {
		ret = dma_buf_pin(t->attach);
		if (ret)
			goto out;
		t->pinned = true;
	}
	sgt = dma_buf_map_attachment(t->attach, DMA_BIDIRECTIONAL);
	if (IS_ERR(sgt))
		ret = PTR_ERR(sgt);
	else
		t->sgt = sgt;
out:
	dma_resv_unlock(t->dmabuf->resv);
	return ret;
}

/* Bytes the mapping covers, -EINVAL if a segment is not whole pages,
 * -ENOENT if there is no mapping. */
long tdrv_test_importer_mapped_bytes(struct tdrv_test_importer *t)
{
	struct scatterlist *sg;
	long total = 0;
	unsigned int i;

	if (!t->sgt)
		return -ENOENT;
	for_each_sgtable_dma_sg(t->sgt, sg, i) {
		if (!PAGE_ALIGNED(sg_dma_address(sg)) ||
		    !PAGE_ALIGNED(sg_dma_len(sg)))
			return -EINVAL;
		total += sg_dma_len(sg);
	}
	return total;
}

/* Reads every byte at the bus addresses of the mapping (a direct mapping:
 * they are physical addresses) and counts those that are not @value. */
long tdrv_test_importer_count_other(struct tdrv_test_importer *t, u8 value)
{
	struct device *dev = &t->fdev->dev;
	struct scatterlist *sg;
	long other = 0;
	unsigned int i;

	if (!t->sgt)
		return -ENOENT;
	for_each_sgtable_dma_sg(t->sgt, sg, i) {
		phys_addr_t phys = dma_to_phys(dev, sg_dma_address(sg));
		size_t off;

		for (off = 0; off < sg_dma_len(sg); off += PAGE_SIZE) {
			u8 *p = kmap_local_page(pfn_to_page(PHYS_PFN(phys + off)));
			size_t b;

			for (b = 0; b < PAGE_SIZE; b++)
				other += p[b] != value;
			kunmap_local(p);
		}
	}
	return other;
}

struct dma_buf *tdrv_test_dmabuf_get(struct dma_buf *dmabuf)
{
	get_dma_buf(dmabuf);
	return dmabuf;
}

int tdrv_test_importer_invalidated(struct tdrv_test_importer *t)
{
	return t->invalidated;
}

/* Unmaps, unpins, detaches and frees the importer and its device. */
void tdrv_test_importer_free(struct tdrv_test_importer *t)
{
	if (t->attach->importer_ops) {
		dma_resv_lock(t->dmabuf->resv, NULL);
		if (t->sgt)
			dma_buf_unmap_attachment(t->attach, t->sgt,
						 DMA_BIDIRECTIONAL);
		if (t->pinned)
			dma_buf_unpin(t->attach);
		dma_resv_unlock(t->dmabuf->resv);
	} else if (t->sgt) {
		dma_buf_unmap_attachment_unlocked(t->attach, t->sgt,
						  DMA_BIDIRECTIONAL);
	}
	dma_buf_detach(t->dmabuf, t->attach);
	dma_buf_put(t->dmabuf);
	faux_device_destroy(t->fdev);
	kfree(t);
}

void tdrv_test_resv_lock(struct dma_buf *dmabuf)
{
	dma_resv_lock(dmabuf->resv, NULL);
}

void tdrv_test_resv_unlock(struct dma_buf *dmabuf)
{
	dma_resv_unlock(dmabuf->resv);
}
#endif
