/* SPDX-License-Identifier: MIT OR Apache-2.0 */
/*
 * ndl/neuron_driver_shared_tensor_batch_op.h: one operation of a tensor
 * batch (nrt_tensor_read_batch, nrt_tensor_write_batch in nrt/nrt.h).
 * The public Neuron runtime headers define it in this file, which nrt.h
 * includes, so programs written against them find it here too.
 */
#ifndef NDL_NEURON_DRIVER_SHARED_TENSOR_BATCH_OP_H
#define NDL_NEURON_DRIVER_SHARED_TENSOR_BATCH_OP_H

#include <stdint.h>

typedef uint64_t nrt_tensor_batch_offset_t;
typedef uint64_t nrt_tensor_batch_size_t;

/* `size` bytes at `offset` of the batch's tensor, to or from `buffer`. */
typedef struct nrt_tensor_batch_op {
	nrt_tensor_batch_offset_t offset;
	nrt_tensor_batch_size_t size;
	void *buffer;
} nrt_tensor_batch_op_t;

#endif /* NDL_NEURON_DRIVER_SHARED_TENSOR_BATCH_OP_H */
