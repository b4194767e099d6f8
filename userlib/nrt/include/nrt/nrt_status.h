/* SPDX-License-Identifier: MIT OR Apache-2.0 */
/*
 * nrt/nrt_status.h: the status codes of libnrt.so.1. The names and values
 * are those of the public Neuron runtime header, all of them, so that code
 * written against that header compiles and switches over the same values.
 *
 * What this implementation returns: NRT_SUCCESS, NRT_FAILURE, NRT_INVALID,
 * NRT_INVALID_HANDLE, NRT_RESOURCE (the device's memory or the driver's
 * limits are exhausted), NRT_TIMEOUT, NRT_HW_ERROR (a job or device write
 * failed), NRT_FAIL_HOST_MEM_ALLOC (a host allocation failed),
 * NRT_UNINITIALIZED (the device cannot be opened) and NRT_CLOSED (the
 * device was removed). The other codes belong to model loading and
 * execution, which this library does not have; they are never returned.
 */
#ifndef NRT_NRT_STATUS_H
#define NRT_NRT_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
	NRT_SUCCESS = 0,
	NRT_FAILURE = 1,
	NRT_INVALID = 2,
	NRT_INVALID_HANDLE = 3,
	NRT_RESOURCE = 4,
	NRT_TIMEOUT = 5,
	NRT_HW_ERROR = 6,
	NRT_QUEUE_FULL = 7,
	NRT_LOAD_NOT_ENOUGH_NC = 9,
	NRT_UNSUPPORTED_NEFF_VERSION = 10,
	NRT_FAIL_HOST_MEM_ALLOC = 11,
	NRT_UNINITIALIZED = 13,
	NRT_CLOSED = 14,
	NRT_QUEUE_EMPTY = 15,
	NRT_EXEC_UNIT_UNRECOVERABLE = 101,
	NRT_EXEC_BAD_INPUT = 1002,
	NRT_EXEC_COMPLETED_WITH_NUM_ERR = 1003,
	NRT_EXEC_COMPLETED_WITH_ERR = 1004,
	NRT_EXEC_NC_BUSY = 1005,
	NRT_EXEC_OOB = 1006,
	NRT_COLL_PENDING = 1100,
	NRT_EXEC_HW_ERR_COLLECTIVES = 1200,
	NRT_EXEC_HW_ERR_HBM_UE = 1201,
	NRT_EXEC_HW_ERR_NC_UE = 1202,
	NRT_EXEC_HW_ERR_DMA_ABORT = 1203,
	NRT_EXEC_SW_NQ_OVERFLOW = 1204,
	NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE = 1205,
	NRT_NETWORK_PROXY_FAILURE = 1206,
} NRT_STATUS;

/*
 * The name of a status ("NRT_TIMEOUT"), or "UNKNOWN STATUS" for a value
 * that is not one. The string is static: never free it.
 */
const char *nrt_get_status_as_str(NRT_STATUS status);

#ifdef __cplusplus
}
#endif

#endif /* NRT_NRT_STATUS_H */
