/* SPDX-License-Identifier: MIT OR Apache-2.0 */
/*
 * nrt/nrt.h: the tensor API of libnrt.so.1, as implemented over the tdrv
 * driver. Status codes are in nrt/nrt_status.h, which this header includes;
 * tdrv's own job API (copy jobs that advance output completion counts) is
 * in tdrv/job.h.
 *
 * Signatures and values follow the public Neuron runtime header. Notes on
 * this implementation:
 *  - NULL or invalid arguments return an error status; nothing asserts.
 *  - NRT_TENSOR_PLACEMENT_DEVICE allocates a buffer of the tdrv device named
 *    by $TDRV_DEVICE (default /dev/tdrv0) on HBM channel `vnc` (0 when
 *    negative); HOST and VIRTUAL allocate host memory.
 *  - A tensor set holds its own reference to each tensor it contains, and
 *    nrt_get_tensor_from_tensor_set returns the pointer that was added.
 *  - nrt_tensor_attach_buffer fails (NRT_INVALID) on a tensor that is in a
 *    tensor set: attach before adding it.
 *  - A device-to-device copy across HBM channels returns NRT_INVALID.
 *  - nrt_tensor_get_device_allocation_info returns NRT_FAILURE when the
 *    driver withholds DMA addresses from this process (it gives them only
 *    to openers with CAP_SYS_RAWIO).
 *
 * Handles. An nrt_tensor_t * or nrt_tensor_set_t * is an opaque token that
 * the library looks up in a table of live handles before every use; it is
 * never dereferenced, by the library or by you. Passing a pointer that is
 * not a live handle of this library (one already freed, one of another
 * library, a set where a tensor is expected) returns NRT_INVALID_HANDLE and
 * touches nothing; nrt_tensor_free and nrt_destroy_tensor_set log it and
 * leave the pointer alone, so a double free is harmless. Handles are never
 * reused. A handle may be used from several threads at once; freeing it
 * while another thread uses it is safe (that call either completes on the
 * tensor or gets NRT_INVALID_HANDLE).
 *
 * Caller memory. The buffers of nrt_tensor_read/write and of the batch
 * calls are copied with memmove semantics through raw pointers:
 *  - they may overlap each other (in a read batch, later ops win) and may
 *    lie inside a tensor's own memory (nrt_tensor_get_va), even the
 *    tensor being read or written, and even the batch descriptors;
 *  - each must be valid for its size for the whole call, and no other
 *    thread may write a buffer the call reads, or access a buffer the call
 *    writes, until the call returns.
 * The batch and op arrays are read once, before any byte moves.
 *
 * Batches. nrt_tensor_read_batch and nrt_tensor_write_batch check every
 * handle, pointer and range of every batch before moving a byte: an error
 * found then (NRT_INVALID, NRT_INVALID_HANDLE) leaves every tensor and
 * buffer unchanged. After the checks, only a failing device call (a
 * COPY_IN/COPY_OUT on a device buffer the library cannot map, a fence
 * wait) can stop a batch; the batches before it are then applied.
 */
#ifndef NRT_NRT_H
#define NRT_NRT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nrt_status.h"
#include <ndl/neuron_driver_shared_tensor_batch_op.h>

#ifdef __cplusplus
extern "C" {
#endif


typedef struct nrt_tensor nrt_tensor_t; /* opaque */
typedef void nrt_tensor_set_t;          /* opaque */

typedef enum {
	NRT_TENSOR_PLACEMENT_DEVICE = 0,
	NRT_TENSOR_PLACEMENT_HOST = 1,
	NRT_TENSOR_PLACEMENT_VIRTUAL = 2,
} nrt_tensor_placement_t;

typedef struct nrt_tensor_batch {
	const nrt_tensor_t *tensor;
	const nrt_tensor_batch_op_t *ops;
	uint32_t num_ops;
} nrt_tensor_batch_t;

typedef struct nrt_tensor_device_allocation_info {
	uint64_t physical_address;
	size_t size;
	int hbm_index;
} nrt_tensor_device_allocation_info_t;

NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t placement, int vnc, size_t size,
			       const char *name, nrt_tensor_t **tensor);
/* Frees the caller's reference; sets *tensor = NULL. */
void nrt_tensor_free(nrt_tensor_t **tensor);
NRT_STATUS nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size);
NRT_STATUS nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size);
NRT_STATUS nrt_tensor_read_batch(const nrt_tensor_batch_t *batches, uint64_t num_batches,
				 bool unsafe);
NRT_STATUS nrt_tensor_write_batch(const nrt_tensor_batch_t *batches, uint64_t num_batches,
				  bool unsafe);
NRT_STATUS nrt_tensor_copy(const nrt_tensor_t *src, size_t src_offset, nrt_tensor_t *dst,
			   size_t dst_offset, size_t size);
size_t nrt_tensor_get_size(const nrt_tensor_t *tensor);
NRT_STATUS nrt_tensor_memset(nrt_tensor_t *tensor, uint64_t offset, int value, size_t size);
NRT_STATUS nrt_tensor_allocate_empty(const char *name, nrt_tensor_t **tensor);
NRT_STATUS nrt_tensor_attach_buffer(nrt_tensor_t *tensor, void *buffer, size_t size);
NRT_STATUS nrt_tensor_allocate_slice(const nrt_tensor_t *source, size_t offset, size_t size,
				     const char *name, nrt_tensor_t **slice);
void *nrt_tensor_get_va(const nrt_tensor_t *tensor);
NRT_STATUS nrt_tensor_get_device_allocation_info(const nrt_tensor_t *tensor,
						 nrt_tensor_device_allocation_info_t *info);
NRT_STATUS nrt_tensor_check_output_completion(const nrt_tensor_t *output, int64_t timeout_us,
					      uint64_t expected_completion_count);
NRT_STATUS nrt_tensor_reset_output_completion(nrt_tensor_t *output);

/*
 * A dma-buf fd for device memory, e.g. to register it with an RDMA NIC
 * (ibv_reg_dmabuf_mr) or to pass it to another process. The contract is
 * the one libfabric's Neuron support relies on (it takes the fd's offset
 * for va to be 0):
 *  - va is the first byte of a device allocation: nrt_tensor_get_va of a
 *    DEVICE tensor (or of a slice at offset 0 of one), and 0 < size and
 *    [va, va + size) lies inside that tensor (or slice). The fd (O_RDWR,
 *    close-on-exec; the caller closes it) covers the whole allocation,
 *    which may be larger than size, from offset 0. It is the same memory
 *    and outlives the tensor.
 *  - A va inside a device allocation but not at its start is NRT_INVALID:
 *    the allocation's dma-buf does not begin there. Ask for the
 *    allocation's start and add the offset yourself.
 *  - An address that is not device memory of this library (host memory,
 *    another library's, a freed tensor's), size 0 or a NULL fd is
 *    NRT_INVALID. Callers such as libfabric then fall back to registering
 *    the memory another way; NRT_RESOURCE is reserved for real failures
 *    (out of fds or memory), on which they give up. NRT_CLOSED if the
 *    device was removed.
 * Only tensors whose memory this process has mapped (nrt_tensor_get_va
 * does) are looked at: nothing new is mapped to find va.
 */
NRT_STATUS nrt_get_dmabuf_fd(uint64_t va, uint64_t size, int *fd);

/*
 * Copies size bytes from host memory at src to device memory at dest,
 * where [dest, dest + size) lies inside a live DEVICE tensor (or slice) of
 * this library, dest being nrt_tensor_get_va of it plus an offset. The
 * same copy as nrt_tensor_write(tensor, src, dest - va, size): it waits for
 * the device work in flight on the tensor, and src may overlap any
 * tensor's memory. size 0 succeeds; NULL dest or src, or a range that is
 * not inside one device tensor, is NRT_INVALID.
 */
NRT_STATUS nrt_memcpy_to_device(void *dest, const void *src, size_t size);

/*
 * The number of NeuronCores: here the HBM channels of the DEVICE
 * placement's device ($TDRV_DEVICE, default /dev/tdrv0), i.e. the values
 * of vnc that nrt_tensor_allocate accepts. May be called first (it opens
 * the device); NRT_UNINITIALIZED if the device cannot be opened, NRT_INVALID
 * for a NULL count.
 */
NRT_STATUS nrt_get_total_nc_count(uint32_t *count);

NRT_STATUS nrt_allocate_tensor_set(nrt_tensor_set_t **result);
void nrt_destroy_tensor_set(nrt_tensor_set_t **tensor_set);
NRT_STATUS nrt_add_tensor_to_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name,
					nrt_tensor_t *tensor);
/* NRT_FAILURE when no tensor has that name. */
NRT_STATUS nrt_get_tensor_from_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name,
					  nrt_tensor_t **tensor);

#ifdef __cplusplus
}
#endif

#endif /* NRT_NRT_H */
