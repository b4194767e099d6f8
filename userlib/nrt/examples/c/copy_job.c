// SPDX-License-Identifier: MIT OR Apache-2.0
/*
 * The smallest C program that moves data with a tdrv copy job: two device
 * tensors, a job that copies one into the other, a wait, and the output
 * completion count that the job advanced.
 *
 * Build it against the installed library and headers:
 *   cc -o copy_job copy_job.c $(pkg-config --cflags --libs nrt)
 * and run it with the device node as its argument (default /dev/tdrv0):
 *   ./copy_job /dev/tdrv0
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nrt/nrt.h>
#include <tdrv/job.h>

#define SIZE 4096

static int failed(const char *what, NRT_STATUS s)
{
	fprintf(stderr, "copy_job: %s: %s\n", what, nrt_get_status_as_str(s));
	return 1;
}

int main(int argc, char **argv)
{
	static unsigned char in[SIZE], out[SIZE];
	nrt_tensor_t *src = NULL, *dst = NULL;
	tdrv_job_t *job = NULL;
	NRT_STATUS s;
	int rc = 1;

	if (argc > 1)
		setenv("TDRV_DEVICE", argv[1], 1);
	for (size_t i = 0; i < SIZE; i++)
		in[i] = (unsigned char)i;

	if ((s = nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_DEVICE, 0, SIZE, "in", &src)) ||
	    (s = nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_DEVICE, 0, SIZE, "out", &dst))) {
		failed("allocate", s);
		goto out;
	}
	if ((s = nrt_tensor_write(src, in, 0, SIZE))) {
		failed("write", s);
		goto out;
	}
	if ((s = tdrv_job_create(&job)) || (s = tdrv_job_add_copy(job, src, 0, dst, 0, SIZE)) ||
	    (s = tdrv_job_submit(job))) {
		failed("submit", s);
		goto out;
	}
	/* The job runs on the device's copy engine; wait up to 10 s for it. */
	if ((s = tdrv_job_wait(job, 10 * 1000 * 1000))) {
		failed("wait", s);
		goto out;
	}
	/* Each job that writes a tensor counts once on it. */
	if ((s = nrt_tensor_check_output_completion(dst, 0, 1))) {
		failed("output completion", s);
		goto out;
	}
	if ((s = nrt_tensor_read(dst, out, 0, SIZE))) {
		failed("read", s);
		goto out;
	}
	if (memcmp(in, out, SIZE)) {
		fprintf(stderr, "copy_job: the copy differs from its source\n");
		goto out;
	}
	printf("copied %d bytes on the device\n", SIZE);
	rc = 0;
out:
	tdrv_job_free(&job);
	nrt_tensor_free(&src);
	nrt_tensor_free(&dst);
	return rc;
}
