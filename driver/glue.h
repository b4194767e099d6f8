/* SPDX-License-Identifier: GPL-2.0 */
/* C helpers of tdrv.ko, called from Rust (driver/glue.rs). */
#ifndef TDRV_GLUE_H
#define TDRV_GLUE_H

#include <linux/types.h>

struct attribute_group;
struct miscdevice;
struct vm_area_struct;
struct wait_queue_head;
struct file;
struct kiocb;
struct poll_table_struct;

unsigned long tdrv_kaddr_to_pfn(const void *addr);
void *tdrv_pages_alloc(size_t size, u64 *phys);
void tdrv_pages_free(void *addr, size_t size);
int tdrv_vma_init(struct vm_area_struct *vma, bool wc);
struct device;
bool tdrv_dma_mapping_error(struct device *dev, dma_addr_t addr);
struct page;
unsigned int tdrv_page_run(struct page *const *pages, unsigned int n);
size_t tdrv_dma_max_mapping_size(struct device *dev);
int tdrv_io_reserve_wc(u64 start, u64 size);
void *tdrv_p2p_provider(struct device *dev, int bar);
void tdrv_io_free_wc(u64 start, u64 size);
void tdrv_zero_io_wc(void __iomem *addr, size_t len);
bool tdrv_fatal_signal_pending(void);
void tdrv_cond_resched(void);
bool tdrv_capable_rawio(void);
void tdrv_poll_queue_init(struct wait_queue_head *wq);
void tdrv_poll_wait(struct file *file, struct wait_queue_head *wq,
		    struct poll_table_struct *pt);
void tdrv_poll_wake(struct wait_queue_head *wq);
__poll_t tdrv_poll_readable(void);
int tdrv_kiocb_wait_mode(const struct kiocb *iocb);
void tdrv_file_allow_nowait(struct file *file);
const struct attribute_group **tdrv_node_groups_get(void);
int tdrv_get_user_words(u64 *dst, const u64 __user *src, unsigned int words);
int tdrv_put_user_words(u64 __user *dst, const u64 *src, unsigned int words);

/* The module parameters as loaded (glue.c); driver/glue.rs: ModParams. */
struct tdrv_params {
	u32 soft_devices;
	u32 channels;
	u32 channel_mib;
	u32 edu_dma_bits;
	u32 edu_timeout_ms;
	u32 sim_timeout_ms;
	u32 file_max_buffers;
	u32 file_max_imports;
	u32 device_max_imports;
	u32 file_max_mib;
	u32 file_max_events;
	u32 device_max_events;
	u32 file_max_jobs;
	u32 file_max_inflight_mib;
};
void tdrv_params_get(struct tdrv_params *p);

/* Implemented in Rust (node.rs). */
u64 tdrv_node_busy_ns(struct miscdevice *misc);

#endif
