// SPDX-License-Identifier: GPL-2.0
/*
 * tdrv: the few C helpers the Rust side cannot reach in Linux 7.2.
 *
 * Each is a static inline or a macro in C (so 7.2's bindings do not have
 * it) and is wrapped here as one small exported-to-Rust function with the
 * narrowest interface the driver needs. `driver/glue.rs` declares them and
 * documents their contracts on the Rust side.
 */

#include <linux/capability.h>
#include <linux/moduleparam.h>
#include <linux/device.h>
#include <linux/miscdevice.h>
#include <linux/sysfs.h>
#include <linux/mm.h>
#include <linux/poll.h>
#include <linux/fs.h>
#include <linux/sched.h>
#include <linux/vmalloc.h>
#include <linux/dma-mapping.h>
#include <linux/io.h>
#include <linux/pci.h>
#include <linux/pci-p2pdma.h>
#include <linux/sched/signal.h>
#include <linux/uaccess.h>

#include "glue.h"

/* Page frame of a kernel address of DMA-coherent memory: linear-map or
 * vmalloc-remapped (e.g. behind an IOMMU) alike. */
unsigned long tdrv_kaddr_to_pfn(const void *addr)
{
	if (is_vmalloc_addr(addr))
		return vmalloc_to_pfn(addr);
	return page_to_pfn(virt_to_page(addr));
}

/* size bytes (a multiple of pages) of zeroed, physically contiguous
 * pages for memory no device accesses by DMA, charged to the caller's
 * memory cgroup; NULL if none. Costly sizes do not retry hard: the
 * caller falls back to smaller blocks. A power-of-two size is one block
 * of the page allocator, freed as one; another size is split into pages
 * and its tail given back (alloc_pages_exact), which costs a call per
 * page at free. Returns the linear-map address; *phys gets the physical
 * one. */
void *tdrv_pages_alloc(size_t size, u64 *phys)
{
	gfp_t gfp = GFP_KERNEL_ACCOUNT | __GFP_ZERO | __GFP_NOWARN;
	unsigned int order = get_order(size);
	void *addr;

	if (order > PAGE_ALLOC_COSTLY_ORDER)
		gfp |= __GFP_NORETRY;
	if (size == PAGE_SIZE << order)
		addr = (void *)__get_free_pages(gfp, order);
	else
		addr = alloc_pages_exact(size, gfp);
	if (addr)
		*phys = virt_to_phys(addr);
	return addr;
}

/* Frees a block of tdrv_pages_alloc of the same size. */
void tdrv_pages_free(void *addr, size_t size)
{
	unsigned int order = get_order(size);

	if (size == PAGE_SIZE << order)
		free_pages((unsigned long)addr, order);
	else
		free_pages_exact(addr, size);
}

/* Sets up a VMA for pages inserted one by one by the fault handler:
 * raw PFNs (no struct page refcounting), never copied on fork, never
 * grown by mremap, not dumped, and never executable. Returns -EACCES if
 * the mapping asked for PROT_EXEC. */
int tdrv_vma_init(struct vm_area_struct *vma, bool wc)
{
	if (vma->vm_flags & VM_EXEC)
		return -EACCES;
	/* Device memory behind a BAR: write-combined (see
	 * tdrv_io_reserve_wc for the memory type of the range). */
	if (wc)
		vma->vm_page_prot = pgprot_writecombine(vma->vm_page_prot);
	vm_flags_mod(vma, VM_PFNMAP | VM_IO | VM_DONTEXPAND | VM_DONTDUMP |
			  VM_DONTCOPY, VM_MAYEXEC);
	return 0;
}

/* Whether a DMA mapping of dev failed (a static inline). */
bool tdrv_dma_mapping_error(struct device *dev, dma_addr_t addr)
{
	return dma_mapping_error(dev, addr) != 0;
}

/* How many of the n pinned pages, from the first, are physically
 * consecutive: the pages of a huge page, or 4 KiB pages that the page
 * allocator handed out in order (as it mostly does to memory faulted in
 * one sweep). One DMA mapping covers them: the DMA API maps a physical
 * range, whatever folios it spans. At least 1 for n >= 1. */
unsigned int tdrv_page_run(struct page *const *pages, unsigned int n)
{
	unsigned long pfn;
	unsigned int i;

	if (!n)
		return 0;
	pfn = page_to_pfn(pages[0]);
	for (i = 1; i < n; i++)
		if (page_to_pfn(pages[i]) != pfn + i)
			break;
	return i;
}

/* The longest single DMA mapping dev can take (swiotlb's slot limit when
 * it bounces; otherwise no limit). */
size_t tdrv_dma_max_mapping_size(struct device *dev)
{
	return dma_max_mapping_size(dev);
}

/* Marks the physical range [start, start + size) of a BAR write-combined
 * in the memory-type tracking (PAT), so that user mappings of it inserted
 * page by page on fault get WC rather than uncached. The range must not
 * be ioremapped otherwise. */
int tdrv_io_reserve_wc(u64 start, u64 size)
{
	int ret = arch_io_reserve_memtype_wc(start, size);

	if (ret)
		return ret;
	return 0;
}

/* The peer-to-peer DMA provider of BAR @bar of the PCI device @dev, for as
 * long as its driver stays bound (device-managed), or NULL, logged once,
 * if the kernel has no P2P DMA (CONFIG_PCI_P2PDMA) or the BAR cannot be
 * one. */
void *tdrv_p2p_provider(struct device *dev, int bar)
{
	struct pci_dev *pdev = to_pci_dev(dev);
	int ret = pcim_p2pdma_init(pdev);

	if (ret) {
		dev_info(dev, "tdrv: device memory is not shared peer-to-peer: %pe\n",
			 ERR_PTR(ret));
		return NULL;
	}
	return pcim_p2pdma_provider(pdev, bar);
}

void tdrv_io_free_wc(u64 start, u64 size)
{
	arch_io_free_memtype_wc(start, size);
}

/* Zeroes len bytes of write-combined device memory, and drains the CPU's
 * write-combining buffers (wmb) so that the zeroes reach the device before
 * any later doorbell or DMA that the caller orders after this. */
void tdrv_zero_io_wc(void __iomem *addr, size_t len)
{
	memset_io(addr, 0, len);
	wmb();
}

/* Whether the current task was killed (a static inline). */
bool tdrv_fatal_signal_pending(void)
{
	return fatal_signal_pending(current);
}

/* cond_resched() is a macro whose implementation depends on the
 * preemption model. */
void tdrv_cond_resched(void)
{
	cond_resched();
}

/* Whether the current task may see physical/DMA addresses. */
bool tdrv_capable_rawio(void)
{
	return capable(CAP_SYS_RAWIO);
}

/*
 * Stable sysfs attributes of /dev/tdrv<N> (/sys/class/misc/tdrv<N>/):
 *  busy_ns: nanoseconds the device's copy engine spent running jobs.
 * The value comes from the Rust side. The attribute lives only while the
 * misc device is registered, and misc_deregister waits for running show
 * calls, so the node it reads is alive.
 */
static ssize_t busy_ns_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	struct miscdevice *misc = dev_get_drvdata(dev);

	return sysfs_emit(buf, "%llu\n", tdrv_node_busy_ns(misc));
}
static DEVICE_ATTR_RO(busy_ns);

static struct attribute *tdrv_node_attrs[] = {
	&dev_attr_busy_ns.attr,
	NULL,
};
ATTRIBUTE_GROUPS(tdrv_node);

const struct attribute_group **tdrv_node_groups_get(void)
{
	return tdrv_node_groups;
}

/*
 * Small ioctl arguments, a 64-bit word at a time inside one user-access
 * section, unrolled (a loop costs more per word than the move itself).
 * For the few words of a hot query (BUF_INFO) this is several times fewer
 * instructions than copy_from_user/copy_to_user, whose checks and byte or
 * word loop (rep_movs_alternative) dominated its profile. More than
 * TDRV_USER_WORDS words, or a misaligned user pointer, take the ordinary
 * path. -EFAULT on a fault, after which the destination may be partly
 * written.
 */
#define TDRV_USER_WORDS 16

#define TDRV_GET_WORD(i)						\
	case (i) + 1:							\
		unsafe_get_user(dst[i], &src[i], fault);		\
		fallthrough

#define TDRV_PUT_WORD(i)						\
	case (i) + 1:							\
		unsafe_put_user(src[i], &dst[i], fault);		\
		fallthrough

int tdrv_get_user_words(u64 *dst, const u64 __user *src, unsigned int words)
{
	if (words > TDRV_USER_WORDS || (unsigned long)src % sizeof(u64))
		return copy_from_user(dst, src, words * sizeof(u64)) ? -EFAULT : 0;
	if (!user_read_access_begin(src, words * sizeof(u64)))
		return -EFAULT;
	switch (words) {
	TDRV_GET_WORD(15);
	TDRV_GET_WORD(14);
	TDRV_GET_WORD(13);
	TDRV_GET_WORD(12);
	TDRV_GET_WORD(11);
	TDRV_GET_WORD(10);
	TDRV_GET_WORD(9);
	TDRV_GET_WORD(8);
	TDRV_GET_WORD(7);
	TDRV_GET_WORD(6);
	TDRV_GET_WORD(5);
	TDRV_GET_WORD(4);
	TDRV_GET_WORD(3);
	TDRV_GET_WORD(2);
	TDRV_GET_WORD(1);
	TDRV_GET_WORD(0);
	default:
		break;
	}
	user_read_access_end();
	return 0;
fault:
	user_read_access_end();
	return -EFAULT;
}

int tdrv_put_user_words(u64 __user *dst, const u64 *src, unsigned int words)
{
	if (words > TDRV_USER_WORDS || (unsigned long)dst % sizeof(u64))
		return copy_to_user(dst, src, words * sizeof(u64)) ? -EFAULT : 0;
	if (!user_write_access_begin(dst, words * sizeof(u64)))
		return -EFAULT;
	switch (words) {
	TDRV_PUT_WORD(15);
	TDRV_PUT_WORD(14);
	TDRV_PUT_WORD(13);
	TDRV_PUT_WORD(12);
	TDRV_PUT_WORD(11);
	TDRV_PUT_WORD(10);
	TDRV_PUT_WORD(9);
	TDRV_PUT_WORD(8);
	TDRV_PUT_WORD(7);
	TDRV_PUT_WORD(6);
	TDRV_PUT_WORD(5);
	TDRV_PUT_WORD(4);
	TDRV_PUT_WORD(3);
	TDRV_PUT_WORD(2);
	TDRV_PUT_WORD(1);
	TDRV_PUT_WORD(0);
	default:
		break;
	}
	user_write_access_end();
	return 0;
fault:
	user_write_access_end();
	return -EFAULT;
}

/*
 * Completion events (event.rs): a wait queue per file for poll(2) and
 * epoll, woken with the readable mask so that epoll's callback can filter.
 * The queue lives as long as the file's job tracker, which outlives the
 * file's release; epoll removes its entries before release (__fput calls
 * eventpoll_release first), and poll(2) before returning.
 */
void tdrv_poll_queue_init(struct wait_queue_head *wq)
{
	init_waitqueue_head(wq);
}

void tdrv_poll_wait(struct file *file, struct wait_queue_head *wq,
		    struct poll_table_struct *pt)
{
	poll_wait(file, wq, pt);
}

void tdrv_poll_wake(struct wait_queue_head *wq)
{
	wake_up_interruptible_poll(wq, EPOLLIN | EPOLLRDNORM);
}

__poll_t tdrv_poll_readable(void)
{
	return EPOLLIN | EPOLLRDNORM;
}

/* A read that must not sleep: O_NONBLOCK on the file, or RWF_NOWAIT. */
int tdrv_kiocb_wait_mode(const struct kiocb *iocb)
{
	if (iocb->ki_flags & IOCB_NOWAIT)
		return 2;
	return (iocb->ki_filp->f_flags & O_NONBLOCK) ? 1 : 0;
}

/* read(2) of the file honours RWF_NOWAIT (preadv2), which the VFS refuses
 * with EOPNOTSUPP unless the file says so. Called from open. */
void tdrv_file_allow_nowait(struct file *file)
{
	file->f_mode |= FMODE_NOWAIT;
}

/*
 * The module parameters. They are declared in C rather than in Rust's
 * module! because a C parameter given twice takes its last value, as
 * admins expect when an option is both in /etc/modprobe.d and on the
 * modprobe command line; 7.2's Rust parameters refuse a second value
 * (EEXIST), which fails the load. Read-only in sysfs (0444): nothing
 * writes them after the load, so tdrv_params_get() needs no lock.
 * The ranges are checked by the Rust side (tdrv.rs: params()).
 */
/* (Kbuild: the DKMS or Debian package version.) */
MODULE_VERSION(TDRV_VERSION);

static unsigned int tdrv_param_soft_devices = 1;
module_param_named(soft_devices, tdrv_param_soft_devices, uint, 0444);
MODULE_PARM_DESC(soft_devices, "Number of software devices to create (0-4)");
static unsigned int tdrv_param_channels = 2;
module_param_named(channels, tdrv_param_channels, uint, 0444);
MODULE_PARM_DESC(channels, "HBM channels per device (1-16)");
static unsigned int tdrv_param_channel_mib = 64;
module_param_named(channel_mib, tdrv_param_channel_mib, uint, 0444);
MODULE_PARM_DESC(channel_mib, "Byte limit of each channel, in MiB (1-4096)");
static unsigned int tdrv_param_edu_dma_bits = 28;
module_param_named(edu_dma_bits, tdrv_param_edu_dma_bits, uint, 0444);
MODULE_PARM_DESC(edu_dma_bits, "DMA mask width of edu devices in bits (24-64; 28 = QEMU's default; match -device edu,dma_mask=)");
static unsigned int tdrv_param_edu_timeout_ms = 5000;
module_param_named(edu_timeout_ms, tdrv_param_edu_timeout_ms, uint, 0444);
MODULE_PARM_DESC(edu_timeout_ms, "Watchdog: time one edu DMA chunk may take before its job fails (200-600000; a chunk takes about 100 ms)");
static unsigned int tdrv_param_sim_timeout_ms = 2000;
module_param_named(sim_timeout_ms, tdrv_param_sim_timeout_ms, uint, 0444);
MODULE_PARM_DESC(sim_timeout_ms, "Watchdog of sim devices: time a queue may make no progress before it is reset and its jobs fail (100-600000)");
static unsigned int tdrv_param_file_max_buffers = 65536;
module_param_named(file_max_buffers, tdrv_param_file_max_buffers, uint, 0444);
MODULE_PARM_DESC(file_max_buffers, "Most live buffers one open file may hold (1-16777216); more is ENOSPC");
static unsigned int tdrv_param_file_max_imports = 4096;
module_param_named(file_max_imports, tdrv_param_file_max_imports, uint, 0444);
MODULE_PARM_DESC(file_max_imports, "Most handles of foreign dma-buf imports one open file may hold (1-16777216); more is ENOSPC");
static unsigned int tdrv_param_device_max_imports = 65536;
module_param_named(device_max_imports, tdrv_param_device_max_imports, uint, 0444);
MODULE_PARM_DESC(device_max_imports, "Most live buffers imported from foreign dma-bufs per device (1-16777216); more is ENOSPC");
static unsigned int tdrv_param_file_max_mib = 4096;
module_param_named(file_max_mib, tdrv_param_file_max_mib, uint, 0444);
MODULE_PARM_DESC(file_max_mib, "Most MiB of buffers one open file may hold, page-rounded (1-1048576); more is ENOSPC");
static unsigned int tdrv_param_file_max_events = 4096;
module_param_named(file_max_events, tdrv_param_file_max_events, uint, 0444);
MODULE_PARM_DESC(file_max_events, "Most completion events one open file may have asked for and not read (1-65536); more is ENOSPC");
static unsigned int tdrv_param_device_max_events = 65536;
module_param_named(device_max_events, tdrv_param_device_max_events, uint, 0444);
MODULE_PARM_DESC(device_max_events, "Most completion events all open files of a device may have asked for and not read (1-16777216); more is ENOSPC");
static unsigned int tdrv_param_file_max_jobs = 1024;
module_param_named(file_max_jobs, tdrv_param_file_max_jobs, uint, 0444);
MODULE_PARM_DESC(file_max_jobs, "Most unfinished jobs one open file may have (1-4095); more is EAGAIN");
static unsigned int tdrv_param_file_max_inflight_mib = 1024;
module_param_named(file_max_inflight_mib, tdrv_param_file_max_inflight_mib, uint, 0444);
MODULE_PARM_DESC(file_max_inflight_mib, "Most MiB the unfinished jobs of one open file may move (1-1048576); more is EAGAIN, but a lone job always fits");

void tdrv_params_get(struct tdrv_params *p)
{
	p->soft_devices = tdrv_param_soft_devices;
	p->channels = tdrv_param_channels;
	p->channel_mib = tdrv_param_channel_mib;
	p->edu_dma_bits = tdrv_param_edu_dma_bits;
	p->edu_timeout_ms = tdrv_param_edu_timeout_ms;
	p->sim_timeout_ms = tdrv_param_sim_timeout_ms;
	p->file_max_buffers = tdrv_param_file_max_buffers;
	p->file_max_imports = tdrv_param_file_max_imports;
	p->device_max_imports = tdrv_param_device_max_imports;
	p->file_max_mib = tdrv_param_file_max_mib;
	p->file_max_events = tdrv_param_file_max_events;
	p->device_max_events = tdrv_param_device_max_events;
	p->file_max_jobs = tdrv_param_file_max_jobs;
	p->file_max_inflight_mib = tdrv_param_file_max_inflight_mib;
}
