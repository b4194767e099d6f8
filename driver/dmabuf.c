// SPDX-License-Identifier: GPL-2.0
/*
 * tdrv: dma-buf export and import (see dmabuf.h for the interface and
 * driver/dmabuf.rs for the design). The C side owns everything that is a
 * macro or an inline in C (export info, scatterlist walks, iosys_map);
 * the buffer logic stays in Rust behind three callbacks.
 */

#include <linux/dma-buf.h>
#include <linux/dma-direct.h>
#include <linux/dma-direction.h>
#include <linux/dma-map-ops.h>
#include <linux/err.h>
#include <linux/fcntl.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/iosys-map.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/swiotlb.h>
#include <linux/vmalloc.h>
#include <linux/workqueue.h>

#include "dmabuf.h"
#include "resv.h"

MODULE_IMPORT_NS("DMA_BUF");

/* No device but tdrv's own files may use the memory: an importer's DMA
 * mapping could not be revoked when the device is unbound and its memory
 * freed. */
static int tdrv_dmabuf_attach(struct dma_buf *dmabuf,
			      struct dma_buf_attachment *attach)
{
	return -EOPNOTSUPP;
}

static struct sg_table *tdrv_dmabuf_map(struct dma_buf_attachment *attach,
					enum dma_data_direction dir)
{
	return ERR_PTR(-EOPNOTSUPP);
}

static void tdrv_dmabuf_unmap(struct dma_buf_attachment *attach,
			      struct sg_table *sgt,
			      enum dma_data_direction dir)
{
}

static void tdrv_dmabuf_release(struct dma_buf *dmabuf)
{
	tdrv_dmabuf_release_buffer(dmabuf->priv, dmabuf);
}

static int tdrv_dmabuf_mmap(struct dma_buf *dmabuf, struct vm_area_struct *vma)
{
	return tdrv_dmabuf_mmap_buffer(dmabuf->priv, vma);
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
	return tdrv_dmabuf_begin_cpu(dmabuf->priv, write);
}

static const struct dma_buf_ops tdrv_dmabuf_ops = {
	.attach = tdrv_dmabuf_attach,
	.map_dma_buf = tdrv_dmabuf_map,
	.unmap_dma_buf = tdrv_dmabuf_unmap,
	.release = tdrv_dmabuf_release,
	.mmap = tdrv_dmabuf_mmap,
	.begin_cpu_access = tdrv_dmabuf_begin_cpu_access,
};

struct dma_buf *tdrv_dmabuf_export(const void *buf, size_t size,
				   struct dma_resv *resv)
{
	DEFINE_DMA_BUF_EXPORT_INFO(info);

	info.exp_name = "tdrv";
	/* An exported fd pins the module: the release callback is ours. */
	info.owner = THIS_MODULE;
	info.ops = &tdrv_dmabuf_ops;
	info.size = size;
	info.flags = O_RDWR;
	info.priv = (void *)buf;
	/* The buffer's own: every export of the buffer shares it. */
	info.resv = resv;
	return dma_buf_export(&info);
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
	*own = dmabuf->ops == &tdrv_dmabuf_ops ? dmabuf->priv : NULL;
	return 0;
}

struct tdrv_import {
	struct dma_buf *dmabuf;
	struct iosys_map map;
	struct dma_buf_attachment *attach; /* NULL: CPU access only */
	struct sg_table *sgt;
	/* Queued by tdrv_import_release_later(). */
	struct work_struct release_work;
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

	if (!dev->dma_mask || get_dma_ops(dev) || dev_dma_iommu(dev))
		return false;
#ifdef CONFIG_SWIOTLB
	if (dev->dma_io_tlb_mem && dev->dma_io_tlb_mem->nslabs)
		return false;
#endif
	limit = min_not_zero(*dev->dma_mask, dev->bus_dma_limit);
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
	tdrv_import_release(container_of(work, struct tdrv_import, release_work));
}

struct tdrv_import *tdrv_import_new(struct dma_buf *dmabuf, struct device *dev)
{
	struct tdrv_import *imp;
	int ret;

	if (!PAGE_ALIGNED(dmabuf->size) || !dmabuf->size) {
		ret = -EINVAL;
		goto err_put;
	}
	/* No kernel mapping at all (dma_buf_vmap would say EINVAL). */
	if (!dmabuf->ops->vmap) {
		ret = -EOPNOTSUPP;
		goto err_put;
	}
	imp = kzalloc(sizeof(*imp), GFP_KERNEL_ACCOUNT);
	if (!imp) {
		ret = -ENOMEM;
		goto err_put;
	}
	imp->dmabuf = dmabuf;
	INIT_WORK(&imp->release_work, tdrv_import_release_work);
	ret = dma_buf_vmap_unlocked(dmabuf, &imp->map);
	if (ret)
		goto err_free;
	if (imp->map.is_iomem) {
		ret = -EOPNOTSUPP;
		goto err_vunmap;
	}
	if (dev) {
		if (tdrv_beyond_dma_mask(dev, imp->map.vaddr, dmabuf->size)) {
			ret = -EIO;
			goto err_vunmap;
		}
		imp->attach = dma_buf_attach(dmabuf, dev);
		if (IS_ERR(imp->attach)) {
			ret = PTR_ERR(imp->attach);
			goto err_vunmap;
		}
		imp->sgt = dma_buf_map_attachment_unlocked(imp->attach,
							   DMA_BIDIRECTIONAL);
		if (IS_ERR(imp->sgt)) {
			ret = PTR_ERR(imp->sgt);
			goto err_detach;
		}
		if (!tdrv_sgt_whole_pages(imp->sgt, dmabuf->size)) {
			ret = -EINVAL;
			goto err_unmap;
		}
	}
	return imp;

err_unmap:
	dma_buf_unmap_attachment_unlocked(imp->attach, imp->sgt,
					  DMA_BIDIRECTIONAL);
err_detach:
	dma_buf_detach(dmabuf, imp->attach);
err_vunmap:
	dma_buf_vunmap_unlocked(dmabuf, &imp->map);
err_free:
	kfree(imp);
err_put:
	dma_buf_put(dmabuf);
	return ERR_PTR(ret);
}

struct dma_buf *tdrv_import_get_dmabuf(const struct tdrv_import *imp)
{
	get_dma_buf(imp->dmabuf);
	return imp->dmabuf;
}

struct dma_resv *tdrv_dmabuf_resv(struct dma_buf *dmabuf)
{
	return dmabuf->resv;
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
	if (imp->attach) {
		dma_buf_unmap_attachment_unlocked(imp->attach, imp->sgt,
						  DMA_BIDIRECTIONAL);
		dma_buf_detach(imp->dmabuf, imp->attach);
	}
	dma_buf_vunmap_unlocked(imp->dmabuf, &imp->map);
	dma_buf_put(imp->dmabuf);
	kfree(imp);
}

/*
 * The release takes the dma-buf's reservation lock (vunmap, unmap and
 * detach), which a dma-fence signalling path must not take: reclaim may
 * wait for fences under it. A buffer's last reference can go on such a
 * path (a job's completion), so the buffer hands its import here; its
 * work item was allocated with the import, so queueing needs no
 * memory.
 */
void tdrv_import_release_later(struct tdrv_import *imp)
{
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
