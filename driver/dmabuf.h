/* SPDX-License-Identifier: GPL-2.0 */
/*
 * tdrv dma-buf bridge (driver/dmabuf.c), called from Rust (driver/dmabuf.rs).
 *
 * Exporter: a tdrv buffer becomes a dma-buf whose private data is one
 * reference to the buffer (an Arc<Buffer> turned into a raw pointer). The
 * dma-buf gives it back through tdrv_dmabuf_release_buffer() when its last
 * file reference goes. Other devices attach, pin and map it (an sg_table
 * of its pages mapped for the importer's device) and vmap it; device
 * memory is mapped peer-to-peer where the PCI topology allows, else
 * refused (-EOPNOTSUPP), and never vmapped. mmap and DMA_BUF_IOCTL_SYNC go to the
 * callbacks below.
 *
 * Importer: a foreign dma-buf is vmapped for CPU access (the software
 * engine, COPY_IN/OUT, mmap) and, for a device that does DMA, attached and
 * mapped once for the lifetime of the import.
 */
#ifndef TDRV_DMABUF_H
#define TDRV_DMABUF_H

#include <linux/types.h>

struct address_space;
struct device;
struct dma_buf;
struct dma_resv;
struct inode;
struct tdrv_import;
struct vm_area_struct;

/* Exports the buffer behind @buf (@size bytes). Returns the dma-buf, which
 * now owns that reference, or an ERR_PTR; on failure the reference is
 * still the caller's. @resv is the buffer's reservation object, which
 * must outlive the dma-buf (the buffer owns it). */
struct dma_buf *tdrv_dmabuf_export(const void *buf, size_t size,
				   struct dma_resv *resv);
/* A reference to the inode of @dmabuf's file (every mmap of the dma-buf
 * hangs off its address space), for unmap at unbind; the caller holds
 * @dmabuf. */
struct inode *tdrv_dmabuf_hold_inode(struct dma_buf *dmabuf);
/* Unmaps every user mapping of the file of @inode. */
void tdrv_dmabuf_zap(struct inode *inode);
/* Drops a reference from tdrv_dmabuf_hold_inode(). */
void tdrv_dmabuf_put_inode(struct inode *inode);
/* Reserves an fd (O_CLOEXEC) for a dma-buf; -errno on failure. */
int tdrv_dmabuf_reserve_fd(void);
/* Installs @dmabuf at the reserved @fd: consumes the caller's dma-buf
 * reference. Cannot fail or be undone. */
void tdrv_dmabuf_install(struct dma_buf *dmabuf, int fd);
/* Gives back an fd reserved and never installed. */
void tdrv_dmabuf_unreserve_fd(int fd);
/* Unbind: tells every importer of the tdrv export @dmabuf to drop its
 * mappings (dma_buf_invalidate_mappings) and, if one of them is revocable,
 * waits up to @timeout jiffies for them to go. Returns how many DMA and
 * kernel mappings of its pages remain. The caller keeps @dmabuf alive. */
int tdrv_dmabuf_revoke(struct dma_buf *dmabuf, unsigned long timeout);
/* Logs, rate-limited, why IMPORT of device memory of another tdrv device
 * failed. */
void tdrv_dmabuf_log_no_p2p(void);
/* How many DMA and kernel mappings of the tdrv export @dmabuf exist. */
int tdrv_dmabuf_users(struct dma_buf *dmabuf);
/* Drops a dma-buf reference. */
void tdrv_dmabuf_put(struct dma_buf *dmabuf);

/* Looks up the dma-buf of @fd. Returns -EBADF if @fd is not open, -EINVAL
 * if it is not a dma-buf. If the dma-buf is one of tdrv's, *@own is its
 * buffer pointer (valid while the returned reference is held), else NULL. */
int tdrv_dmabuf_lookup(int fd, struct dma_buf **dmabuf, const void **own);

/* Imports the foreign @dmabuf, consuming the caller's reference (also on
 * failure): vmaps it and, if @dma, maps it for DMA by @dev. With @ctx
 * (the owner's device, see tdrv_import_zap) the attachment is dynamic,
 * pinned and revocable: when the exporter invalidates it, accesses in
 * progress are waited for, tdrv_import_zap(@ctx) runs and the import is
 * unmapped; later tdrv_import_access_begin() fails. Without @ctx it is a
 * static attachment (only with @dma). -EOPNOTSUPP if it has no kernel
 * mapping in system memory, -EINVAL if its DMA segments are not whole
 * pages, -ENODEV if revoked meanwhile, or the error of
 * dma_buf_vmap()/dma_buf_attach()/dma_buf_map_attachment(). The import
 * holds one reference (see tdrv_import_get), which its release drops.
 * With @p2p (which needs @dma and @ctx) the importer takes peer-to-peer
 * memory (device memory behind another device's BAR) and makes no kernel
 * mapping: tdrv_import_vaddr() is NULL. */
struct tdrv_import *tdrv_import_new(struct dma_buf *dmabuf, struct device *dev,
				    bool dma, const void *ctx, bool p2p);
/* Takes a reference to the import's object (not its mappings): it and
 * the dma-buf stay until the last tdrv_import_put(). */
struct tdrv_import *tdrv_import_get(struct tdrv_import *imp);
/* Drops one; takes no lock and allocates nothing. */
void tdrv_import_put(struct tdrv_import *imp);
/* The imported dma-buf's reservation object. */
struct dma_resv *tdrv_import_resv(const struct tdrv_import *imp);
/* Starts an access to the import's memory: false once it was revoked or
 * released. End it with tdrv_import_access_end(); no lock, no memory. */
bool tdrv_import_access_begin(struct tdrv_import *imp);
void tdrv_import_access_end(struct tdrv_import *imp);
/* True once revoked or released. */
bool tdrv_import_revoked(const struct tdrv_import *imp);
/* Rust callbacks: a revocable import's owner device zaps its files' user
 * mappings; the import gives back its reference to it. */
void tdrv_import_zap(const void *ctx);
void tdrv_import_put_ctx(const void *ctx);
/* The imported dma-buf's size in bytes (a multiple of pages). */
size_t tdrv_import_size(const struct tdrv_import *imp);
/* The kernel address of byte 0 of the import (virtually contiguous). */
void *tdrv_import_vaddr(const struct tdrv_import *imp);
/* Writes the bus address of each of the first @pages pages of the import
 * to @dma (zeros without a device). */
void tdrv_import_dma_pages(const struct tdrv_import *imp, u64 *dma, size_t pages);
/* Unmaps, detaches, vunmaps and puts the import (accesses through
 * buffers that hold a reference fail from here on). Sleeps. */
void tdrv_import_release(struct tdrv_import *imp);
/* The same, later, from the module's release queue; needs no memory and
 * takes no lock, so a dma-fence signalling path may call it. Once the
 * release ran, @released (if not NULL) is handed to
 * tdrv_import_released(). */
void tdrv_import_release_later(struct tdrv_import *imp, void *released);
/* Rust: the queued release of an import whose @released it was ran. */
void tdrv_import_released(void *released);
/* Returns once every release queued before the call has run. Sleeps. */
void tdrv_import_flush_releases(void);
/* Module init and exit: the release queue. */
int tdrv_dmabuf_module_init(void);
void tdrv_dmabuf_module_exit(void);

/* KUnit only (dmabuf.rs's tests): an importer of a tdrv export that
 * behaves like the RDMA core's pinned dma-buf memory region. */
struct tdrv_test_importer;
struct tdrv_test_importer *tdrv_test_importer_new(struct dma_buf *dmabuf,
						  const char *name, bool dynamic);
int tdrv_test_importer_map(struct tdrv_test_importer *t);
long tdrv_test_importer_mapped_bytes(struct tdrv_test_importer *t);
long tdrv_test_importer_count_other(struct tdrv_test_importer *t, u8 value);
int tdrv_test_importer_invalidated(struct tdrv_test_importer *t);
/* A new reference to @dmabuf. */
struct dma_buf *tdrv_test_dmabuf_get(struct dma_buf *dmabuf);
void tdrv_test_importer_free(struct tdrv_test_importer *t);
/* Holds and lets go of @dmabuf's reservation lock (which an import's
 * release takes), to hold a queued release back. */
void tdrv_test_resv_lock(struct dma_buf *dmabuf);
void tdrv_test_resv_unlock(struct dma_buf *dmabuf);

/* Implemented in Rust (dmabuf.rs). */
void tdrv_dmabuf_release_buffer(const void *buf, struct dma_buf *dmabuf);
int tdrv_dmabuf_mmap_buffer(const void *buf, struct vm_area_struct *vma);
int tdrv_dmabuf_begin_cpu(const void *buf, bool write);
/* The page frame of each of the buffer's first @n pages: -EOPNOTSUPP for
 * device memory, -ENODEV once unbind detached the memory. */
int tdrv_dmabuf_buffer_pfns(const void *buf, unsigned long *pfns, size_t n);
/* Where the buffer's memory is: 0 for host memory (see
 * tdrv_dmabuf_buffer_pfns), 1 for device memory, one physically contiguous
 * range starting at *@phys (in a BAR) whose peer-to-peer provider is
 * *@provider (NULL if the device is none), -ENODEV once unbind detached
 * the memory. */
int tdrv_dmabuf_buffer_p2p(const void *buf, void **provider, u64 *phys);

#endif
