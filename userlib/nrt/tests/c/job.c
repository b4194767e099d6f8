// SPDX-License-Identifier: MIT OR Apache-2.0
/*
 * Drives tdrv's copy jobs from C through libnrt.so.1, linked the way a C
 * program built against the installed headers is (-lnrt, nothing but
 * <nrt/nrt.h> and <tdrv/job.h>): copies run, output completion counts move,
 * waits and completion fds report the outcome, misuse gets its status.
 * Prints kselftest TAP 13 with each check's duration; exits 0 when every
 * check passed, 1 otherwise.
 *
 * usage: job /dev/tdrvN
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include <nrt/nrt.h>
#include <tdrv/job.h>

#include "../../../../uapi/tdrv.h"

#include "tap.h"

#define PLAN 31
/* A bound that only turns a hang into a failure. */
#define HANG_US (60LL * 1000 * 1000)

static void check_status(NRT_STATUS got, NRT_STATUS want, const char *name)
{
	if (got != want)
		printf("# %s: got %s (%d), want %s\n", name, nrt_get_status_as_str(got), got,
		       nrt_get_status_as_str(want));
	check(got == want, name);
}


static void fill(unsigned char *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)(i * 7 + seed);
}

/* Whether the kernel makes completion fds (TDRV_FEAT_FENCE_FD). */
static int has_fence_fds(const char *dev)
{
	struct tdrv_version v;
	int fd = open(dev, O_RDWR | O_CLOEXEC);

	if (fd < 0)
		return 0;
	memset(&v, 0, sizeof(v));
	int r = ioctl(fd, TDRV_IOC_VERSION, &v);
	close(fd);
	return r == 0 && (v.features & TDRV_FEAT_FENCE_FD);
}

/* Whether file dir/name holds exactly the n bytes at p. */
static int file_holds(const char *dir, const char *name, const unsigned char *p, size_t n)
{
	static unsigned char buf[1 << 16];
	char path[256];
	FILE *f;
	size_t got;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	f = fopen(path, "rb");
	if (!f)
		return 0;
	got = fread(buf, 1, sizeof(buf), f);
	fclose(f);
	return got == n && !memcmp(buf, p, n);
}

int main(int argc, char **argv)
{
	enum { N = 8192 };
	static unsigned char a[N], b[N];
	char dump_dir[] = "/tmp/tdrv-job-dump.XXXXXX";
	nrt_tensor_t *src = NULL, *dst = NULL, *host = NULL;
	tdrv_job_t *job = NULL, *job2 = NULL;
	int fd = -1;

	if (argc < 2 || strncmp(argv[1], "/dev/", 5)) {
		fprintf(stderr, "usage: %s /dev/tdrvN\n", argv[0]);
		return 2;
	}
	setenv("TDRV_DEVICE", argv[1], 1);
	/* The input dump is read once, at the library's first call. */
	if (!mkdtemp(dump_dir)) {
		perror("mkdtemp");
		return 1;
	}
	setenv("NEURON_RT_DBG_INPUT_DUMP_DIRECTORY", dump_dir, 1);
	/* Checks of misuse make the library log on purpose. */
	setenv("NEURON_RT_LOG_LEVEL", "OFF", 0);
	tap_start();

	printf("TAP version 13\n1..%d\n# device %s\n", PLAN, argv[1]);
	if (nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_DEVICE, 0, N, "src", &src) != NRT_SUCCESS ||
	    nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_DEVICE, 0, N, "dst", &dst) != NRT_SUCCESS ||
	    nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_VIRTUAL, -1, N, "host", &host) != NRT_SUCCESS) {
		printf("Bail out! cannot allocate tensors on %s\n", argv[1]);
		return 1;
	}
	fill(a, N, 3);
	if (nrt_tensor_write(src, a, 0, N) != NRT_SUCCESS) {
		printf("Bail out! cannot write the source tensor\n");
		return 1;
	}

	check_status(tdrv_job_create(NULL), NRT_INVALID, "create with a NULL out pointer is NRT_INVALID");
	check(tdrv_job_create(&job) == NRT_SUCCESS && job, "create an empty job");
	check_status(tdrv_job_submit(job), NRT_INVALID, "an empty job cannot be submitted");
	check_status(tdrv_job_wait(job, 0), NRT_INVALID, "waiting before submit is NRT_INVALID");
	check_status(tdrv_job_add_copy(job, src, 0, (nrt_tensor_t *)(uintptr_t)0x1234, 0, N),
		     NRT_INVALID_HANDLE, "a destination that is not a live tensor handle");
	check_status(tdrv_job_add_copy(job, src, 0, host, 0, N), NRT_INVALID,
		     "a VIRTUAL (host) destination is refused");
	check_status(tdrv_job_add_copy(job, src, 1, dst, 0, N), NRT_INVALID,
		     "a source range past the tensor's end is refused");
	check_status(tdrv_job_add_copy(job, src, 0, dst, 0, 0), NRT_INVALID,
		     "a copy of 0 bytes is refused");

	/* Two copies, swapped halves: the order of the bytes proves both ran. */
	check(tdrv_job_add_copy(job, src, 0, dst, N / 2, N / 2) == NRT_SUCCESS &&
		      tdrv_job_add_copy(job, src, N / 2, dst, 0, N / 2) == NRT_SUCCESS,
	      "add two copies (the halves swapped)");
	check_status(tdrv_job_submit(job), NRT_SUCCESS, "submit the job");
	check_status(tdrv_job_submit(job), NRT_INVALID, "a second submit is NRT_INVALID");
	check_status(tdrv_job_add_copy(job, src, 0, dst, 0, 16), NRT_INVALID,
		     "a copy added after submit is NRT_INVALID");
	check_status(tdrv_job_wait(job, HANG_US), NRT_SUCCESS, "wait for the job");
	memset(b, 0, N);
	check(nrt_tensor_read(dst, b, 0, N) == NRT_SUCCESS && !memcmp(b, a + N / 2, N / 2) &&
		      !memcmp(b + N / 2, a, N / 2),
	      "the destination holds the source's halves swapped");
	check_status(nrt_tensor_check_output_completion(dst, 0, 1), NRT_SUCCESS,
		     "the destination's output completion count is 1");
	check_status(nrt_tensor_check_output_completion(src, 0, 1), NRT_TIMEOUT,
		     "the source's output completion count stayed 0");
	/* One file per input tensor of the job (src, once), named after it. */
	check(file_holds(dump_dir, "job1_input0_src.bin", a, N),
	      "submit dumped the job's input to NEURON_RT_DBG_INPUT_DUMP_DIRECTORY");
	check_status(tdrv_job_get_fd(job, &fd), NRT_INVALID,
		     "no completion fd without tdrv_job_request_fd");

	/* A completion fd: readable once the job has ended. */
	if (!has_fence_fds(argv[1])) {
		skip("a second job's completion fd polls readable",
		     "the kernel has no sync_file support (CONFIG_SYNC_FILE off: TDRV_FEAT_FENCE_FD unset)");
		skip("the fd job's copy ran", "as above");
		skip("the destination's output completion count is 2", "as above");
	} else {
		struct pollfd p = { .events = POLLIN };
		int ok = tdrv_job_create(&job2) == NRT_SUCCESS &&
			 tdrv_job_add_copy(job2, src, 0, dst, 0, N) == NRT_SUCCESS &&
			 tdrv_job_request_fd(job2) == NRT_SUCCESS &&
			 tdrv_job_submit(job2) == NRT_SUCCESS &&
			 tdrv_job_get_fd(job2, &p.fd) == NRT_SUCCESS && p.fd >= 0;
		ok = ok && poll(&p, 1, (int)(HANG_US / 1000)) == 1 && (p.revents & POLLIN);
		check(ok, "a second job's completion fd polls readable");
		memset(b, 0, N);
		check(tdrv_job_wait(job2, 0) == NRT_SUCCESS && nrt_tensor_read(dst, b, 0, N) == NRT_SUCCESS &&
			      !memcmp(a, b, N),
		      "the fd job's copy ran");
		check_status(nrt_tensor_check_output_completion(dst, 0, 2), NRT_SUCCESS,
			     "the destination's output completion count is 2");
	}
	/* Completion events: every kernel. */
	{
		tdrv_job_t *job3 = NULL;
		tdrv_job_event_t ev[4];
		size_t n = 99;
		struct pollfd p = { .events = POLLIN };

		check_status(tdrv_job_notify(job, 1, NULL), NRT_INVALID,
			     "tdrv_job_notify with a NULL fd pointer is NRT_INVALID");
		check_status(tdrv_read_events(0, ev, 4, &n), NRT_INVALID,
			     "tdrv_read_events of an fd tdrv_job_notify did not return is NRT_INVALID");
		int ok = tdrv_job_create(&job3) == NRT_SUCCESS &&
			 tdrv_job_add_copy(job3, src, 0, dst, 0, N) == NRT_SUCCESS &&
			 tdrv_job_submit(job3) == NRT_SUCCESS &&
			 tdrv_job_notify(job3, 0xabcdef, &p.fd) == NRT_SUCCESS && p.fd >= 0 &&
			 poll(&p, 1, (int)(HANG_US / 1000)) == 1 && (p.revents & POLLIN);
		check(ok, "a job's completion event makes its device fd poll readable");
		n = 0;
		ok = tdrv_read_events(p.fd, ev, 4, &n) == NRT_SUCCESS && n == 1 &&
		     ev[0].user_data == 0xabcdef && ev[0].status == NRT_SUCCESS &&
		     tdrv_read_events(p.fd, ev, 4, &n) == NRT_SUCCESS && n == 0;
		if (!ok)
			printf("# events: n=%zu user_data=%#llx status=%d\n", n,
			       (unsigned long long)ev[0].user_data, ev[0].status);
		check(ok, "tdrv_read_events returns the one event with its user_data and status, then none");
		tdrv_job_free(&job3);

		/* The event asked for in the submit itself (ABI 1.6). */
		int notify_fd = p.fd;
		ok = tdrv_job_create(&job3) == NRT_SUCCESS &&
		     tdrv_job_add_copy(job3, src, 0, dst, 0, N) == NRT_SUCCESS &&
		     nrt_tensor_memset(dst, 0, 0, N) == NRT_SUCCESS;
		p.fd = -1;
		check(ok && tdrv_job_submit_notify(job3, 2, NULL) == NRT_INVALID &&
			      tdrv_job_wait(job3, 0) == NRT_INVALID,
		      "tdrv_job_submit_notify with a NULL fd pointer is NRT_INVALID and queues nothing");
		ok = tdrv_job_submit_notify(job3, 0x5eed, &p.fd) == NRT_SUCCESS && p.fd == notify_fd &&
		     poll(&p, 1, (int)(HANG_US / 1000)) == 1 && (p.revents & POLLIN);
		check(ok, "tdrv_job_submit_notify's event makes the same device fd poll readable");
		n = 0;
		memset(b, 0, N);
		ok = tdrv_read_events(p.fd, ev, 4, &n) == NRT_SUCCESS && n == 1 &&
		     ev[0].user_data == 0x5eed && ev[0].status == NRT_SUCCESS &&
		     tdrv_job_wait(job3, 0) == NRT_SUCCESS && nrt_tensor_read(dst, b, 0, N) == NRT_SUCCESS &&
		     !memcmp(a, b, N);
		if (!ok)
			printf("# submit_notify event: n=%zu user_data=%#llx status=%d\n", n,
			       (unsigned long long)ev[0].user_data, ev[0].status);
		check(ok, "its event carries its user_data and success, and the job's copy ran");
		check_status(tdrv_job_submit_notify(job3, 3, &notify_fd), NRT_INVALID,
			     "tdrv_job_submit_notify of a submitted job is NRT_INVALID");
		tdrv_job_free(&job3);
	}
	tdrv_job_t *freed = job;
	tdrv_job_free(&job);
	check(job == NULL, "free sets the handle to NULL");
	/* The freed token is refused, not dereferenced (handles are never reused). */
	check_status(tdrv_job_wait(freed, 0), NRT_INVALID_HANDLE,
		     "a freed job handle is NRT_INVALID_HANDLE");
	tdrv_job_free(&job2);
	nrt_tensor_free(&src);
	nrt_tensor_free(&dst);
	nrt_tensor_free(&host);

	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", dump_dir);
	if (system(cmd) != 0)
		printf("# could not remove %s\n", dump_dir);
	if (test_no != PLAN)
		printf("# ran %d checks, planned %d\n", test_no, PLAN);
	return failures || test_no != PLAN ? 1 : 0;
}
