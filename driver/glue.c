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
#include <linux/mm.h>
#include <linux/sched.h>
#include <linux/vmalloc.h>

#include "glue.h"

/* Page frame of a kernel address of DMA-coherent memory: linear-map or
 * vmalloc-remapped (e.g. behind an IOMMU) alike. */
unsigned long tdrv_kaddr_to_pfn(const void *addr)
{
	if (is_vmalloc_addr(addr))
		return vmalloc_to_pfn(addr);
	return page_to_pfn(virt_to_page(addr));
}

/* Sets up a VMA for pages inserted one by one by the fault handler:
 * raw PFNs (no struct page refcounting), never copied on fork, never
 * grown by mremap, not dumped, and never executable. Returns -EACCES if
 * the mapping asked for PROT_EXEC. */
int tdrv_vma_init(struct vm_area_struct *vma)
{
	if (vma->vm_flags & VM_EXEC)
		return -EACCES;
	vm_flags_mod(vma, VM_PFNMAP | VM_IO | VM_DONTEXPAND | VM_DONTDUMP |
			  VM_DONTCOPY, VM_MAYEXEC);
	return 0;
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
