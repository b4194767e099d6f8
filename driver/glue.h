/* SPDX-License-Identifier: GPL-2.0 */
/* C helpers of tdrv.ko, called from Rust (driver/glue.rs). */
#ifndef TDRV_GLUE_H
#define TDRV_GLUE_H

#include <linux/types.h>

struct vm_area_struct;

unsigned long tdrv_kaddr_to_pfn(const void *addr);
int tdrv_vma_init(struct vm_area_struct *vma);
void tdrv_cond_resched(void);
bool tdrv_capable_rawio(void);

#endif
