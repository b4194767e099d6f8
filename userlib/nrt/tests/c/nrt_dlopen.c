// SPDX-License-Identifier: MIT OR Apache-2.0
/*
 * Loads libnrt.so.1 with dlopen(), as third-party programs do, and checks
 * the nrt_tensor API. Prints kselftest TAP 13; exits 0 when every check
 * passed, 1 otherwise.
 *
 * usage: nrt_dlopen [virtual|host|device|/dev/tdrvN] [library]
 *   The placement defaults to virtual. A device path means DEVICE placement
 *   on that node (it sets TDRV_DEVICE); plain "device" uses $TDRV_DEVICE or
 *   /dev/tdrv0. The library defaults to "libnrt.so.1", found through the
 *   loader's search path (LD_LIBRARY_PATH, ...) or else next to this
 *   program.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "nrt/nrt.h"

#include "tap.h"

#define PLAN 28


#define API(fn) static __typeof__(fn) *p_##fn
API(nrt_tensor_allocate);
API(nrt_tensor_free);
API(nrt_tensor_read);
API(nrt_tensor_write);
API(nrt_tensor_read_batch);
API(nrt_tensor_write_batch);
API(nrt_tensor_copy);
API(nrt_tensor_get_size);
API(nrt_tensor_memset);
API(nrt_tensor_allocate_empty);
API(nrt_tensor_attach_buffer);
API(nrt_tensor_allocate_slice);
API(nrt_tensor_get_va);
API(nrt_tensor_get_device_allocation_info);
API(nrt_tensor_check_output_completion);
API(nrt_tensor_reset_output_completion);
API(nrt_allocate_tensor_set);
API(nrt_destroy_tensor_set);
API(nrt_add_tensor_to_tensor_set);
API(nrt_get_tensor_from_tensor_set);
API(nrt_get_dmabuf_fd);

static int load(void *lib)
{
	int ok = 1;
#define LOAD(fn)                                                        \
	do {                                                            \
		p_##fn = (__typeof__(fn) *)dlsym(lib, #fn);              \
		if (!p_##fn) {                                          \
			printf("# missing symbol %s\n", #fn);           \
			ok = 0;                                         \
		}                                                       \
	} while (0)
	LOAD(nrt_tensor_allocate);
	LOAD(nrt_tensor_free);
	LOAD(nrt_tensor_read);
	LOAD(nrt_tensor_write);
	LOAD(nrt_tensor_read_batch);
	LOAD(nrt_tensor_write_batch);
	LOAD(nrt_tensor_copy);
	LOAD(nrt_tensor_get_size);
	LOAD(nrt_tensor_memset);
	LOAD(nrt_tensor_allocate_empty);
	LOAD(nrt_tensor_attach_buffer);
	LOAD(nrt_tensor_allocate_slice);
	LOAD(nrt_tensor_get_va);
	LOAD(nrt_tensor_get_device_allocation_info);
	LOAD(nrt_tensor_check_output_completion);
	LOAD(nrt_tensor_reset_output_completion);
	LOAD(nrt_allocate_tensor_set);
	LOAD(nrt_destroy_tensor_set);
	LOAD(nrt_add_tensor_to_tensor_set);
	LOAD(nrt_get_tensor_from_tensor_set);
	LOAD(nrt_get_dmabuf_fd);
#undef LOAD
	return ok;
}

static void fill(unsigned char *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)(i * 31 + seed);
}

static int all_eq(const unsigned char *p, size_t n, unsigned char v)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] != v)
			return 0;
	return 1;
}

int main(int argc, char **argv)
{
	const char *mode = argc > 1 ? argv[1] : "virtual";
	const char *libname = argc > 2 ? argv[2] : "libnrt.so.1";
	nrt_tensor_placement_t pl;
	enum { N = 4096 };
	static unsigned char a[N], b[N];

	if (!strcmp(mode, "virtual"))
		pl = NRT_TENSOR_PLACEMENT_VIRTUAL;
	else if (!strcmp(mode, "host"))
		pl = NRT_TENSOR_PLACEMENT_HOST;
	else if (!strcmp(mode, "device"))
		pl = NRT_TENSOR_PLACEMENT_DEVICE;
	else if (!strncmp(mode, "/dev/", 5)) {
		pl = NRT_TENSOR_PLACEMENT_DEVICE;
		setenv("TDRV_DEVICE", mode, 1);
	} else {
		fprintf(stderr, "usage: %s [virtual|host|device|/dev/tdrvN] [library]\n", argv[0]);
		return 2;
	}

	/* Many checks make the library log an error on purpose; keep the
	 * TAP output readable unless the caller asked for logs. */
	setenv("NEURON_RT_LOG_LEVEL", "OFF", 0);

	tap_start();
	printf("TAP version 13\n1..%d\n", PLAN);
	printf("# placement %s, library %s\n", mode, libname);
	void *lib = dlopen(libname, RTLD_NOW | RTLD_LOCAL);
	if (!lib && argc <= 2) {
		/* Next to this program, under its soname. */
		static char path[4096];
		ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 32);
		if (n > 0) {
			path[n] = 0;
			char *slash = strrchr(path, '/');
			if (slash) {
				strcpy(slash + 1, "libnrt.so.1");
				printf("# %s; trying %s\n", dlerror(), path);
				lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
			}
		}
	}
	if (!lib)
		printf("# dlopen: %s\n", dlerror());
	check(lib != NULL, "dlopen libnrt.so.1");
	if (!lib || !load(lib)) {
		check(0, "resolve every nrt_tensor symbol");
		printf("# Totals: pass:%d fail:%d\n", test_no - failures, PLAN - test_no + failures);
		return 1;
	}
	check(1, "resolve every nrt_tensor symbol");

	/* allocate */
	nrt_tensor_t *t = NULL;
	NRT_STATUS s = p_nrt_tensor_allocate(pl, 0, N, "c_tensor", &t);
	check(s == NRT_SUCCESS && t && p_nrt_tensor_get_size(t) == N, "allocate and get_size");
	if (!t) {
		printf("# allocate returned %d; cannot go on\n", s);
		return 1;
	}

	/* write / read */
	fill(a, N, 7);
	s = p_nrt_tensor_write(t, a, 0, N);
	memset(b, 0, N);
	NRT_STATUS r = p_nrt_tensor_read(t, b, 0, N);
	check(s == NRT_SUCCESS && r == NRT_SUCCESS && !memcmp(a, b, N), "write then read back");

	/* va */
	unsigned char *va = p_nrt_tensor_get_va(t);
	check(va && !memcmp(va, a, N), "get_va sees the written bytes");

	/* dma-buf of a device tensor: the same memory; host memory has none */
	int dfd = -1;
	s = p_nrt_get_dmabuf_fd((uint64_t)(uintptr_t)va, 200, &dfd);
	if (pl == NRT_TENSOR_PLACEMENT_DEVICE) {
		unsigned char *m = MAP_FAILED;
		if (s == NRT_SUCCESS && dfd >= 0)
			m = mmap(NULL, N, PROT_READ | PROT_WRITE, MAP_SHARED, dfd, 0);
		int same = m != MAP_FAILED && !memcmp(m, a, N);
		if (same) {
			m[5] = (unsigned char)~a[5];
			same = va[5] == m[5];
			m[5] = a[5];
		}
		if (m != MAP_FAILED)
			munmap(m, N);
		check(same, "nrt_get_dmabuf_fd: an mmap of the fd is the tensor's memory");
	} else {
		check(s == NRT_INVALID && dfd == -1, "nrt_get_dmabuf_fd: host memory is NRT_INVALID");
	}
	if (dfd >= 0)
		close(dfd);
	check(p_nrt_get_dmabuf_fd((uint64_t)(uintptr_t)va + 100, 200, &dfd) == NRT_INVALID &&
		      p_nrt_get_dmabuf_fd((uint64_t)(uintptr_t)va, N + 1, &dfd) == NRT_INVALID &&
		      p_nrt_get_dmabuf_fd((uint64_t)(uintptr_t)va, 0, &dfd) == NRT_INVALID &&
		      p_nrt_get_dmabuf_fd((uint64_t)(uintptr_t)va, 1, NULL) == NRT_INVALID &&
		      p_nrt_get_dmabuf_fd((uint64_t)(uintptr_t)a, 1, &dfd) == NRT_INVALID,
	      "nrt_get_dmabuf_fd: a va past a tensor's start, ranges outside a device tensor and NULL are NRT_INVALID");

	/* memset */
	s = p_nrt_tensor_memset(t, 100, 0x1AB, 200); /* value converts to 0xAB */
	r = p_nrt_tensor_read(t, b, 0, N);
	check(s == NRT_SUCCESS && r == NRT_SUCCESS && all_eq(b + 100, 200, 0xAB) &&
		      !memcmp(b, a, 100) && !memcmp(b + 300, a + 300, N - 300),
	      "memset a range");

	/* bounds */
	check(p_nrt_tensor_read(t, b, N - 10, 11) == NRT_INVALID &&
		      p_nrt_tensor_write(t, a, (size_t)-1, 2) == NRT_INVALID &&
		      p_nrt_tensor_memset(t, N, 0, 1) == NRT_INVALID,
	      "out-of-bounds and overflowing ranges are NRT_INVALID");

	/* slices */
	nrt_tensor_t *sl = NULL, *bad = (nrt_tensor_t *)1;
	s = p_nrt_tensor_allocate_slice(t, 1024, 1024, "c_slice", &sl);
	r = p_nrt_tensor_allocate_slice(sl, 1000, 25, NULL, &bad);
	check(s == NRT_SUCCESS && sl && p_nrt_tensor_get_size(sl) == 1024 && r == NRT_INVALID &&
		      bad == NULL,
	      "slice; a slice past its parent view is NRT_INVALID");
	nrt_tensor_t *keep = t;
	p_nrt_tensor_write(sl, "slice!", 0, 6);
	p_nrt_tensor_read(t, b, 1024, 6);
	int shared = !memcmp(b, "slice!", 6);
	p_nrt_tensor_free(&t);
	memset(b, 0, 6);
	r = p_nrt_tensor_read(sl, b, 0, 6);
	check(shared && t == NULL && keep != NULL && r == NRT_SUCCESS && !memcmp(b, "slice!", 6),
	      "slices share storage and outlive their parent; free sets NULL");

	/* copy */
	nrt_tensor_t *c1 = NULL, *c2 = NULL;
	p_nrt_tensor_allocate(pl, 0, N, "c1", &c1);
	p_nrt_tensor_allocate(pl, 0, N, "c2", &c2);
	fill(a, N, 3);
	p_nrt_tensor_write(c1, a, 0, N);
	s = p_nrt_tensor_copy(c1, 10, c2, 20, 1000);
	p_nrt_tensor_read(c2, b, 0, N);
	check(s == NRT_SUCCESS && !memcmp(b + 20, a + 10, 1000) && all_eq(b, 20, 0),
	      "copy between tensors");
	check(p_nrt_tensor_copy(c1, 0, c2, N - 1, 2) == NRT_INVALID, "copy out of bounds is NRT_INVALID");

	/* batches */
	unsigned char x[64], y[64], z[64];
	fill(x, 64, 1);
	fill(y, 64, 2);
	nrt_tensor_batch_op_t wops[2] = { { 0, 64, x }, { 512, 64, y } };
	nrt_tensor_batch_t wb[2] = { { c1, wops, 2 }, { c2, wops + 1, 1 } };
	s = p_nrt_tensor_write_batch(wb, 2, false);
	nrt_tensor_batch_op_t rops[1] = { { 512, 64, z } };
	nrt_tensor_batch_t rb[1] = { { c2, rops, 1 } };
	r = p_nrt_tensor_read_batch(rb, 1, true);
	unsigned char w[64];
	p_nrt_tensor_read(c1, w, 0, 64);
	check(s == NRT_SUCCESS && r == NRT_SUCCESS && !memcmp(z, y, 64) && !memcmp(w, x, 64),
	      "write_batch and read_batch");
	nrt_tensor_batch_op_t badop[1] = { { N - 8, 64, z } };
	nrt_tensor_batch_t bb[2] = { { c1, wops, 1 }, { c2, badop, 1 } };
	memset(x, 0xEE, 64);
	s = p_nrt_tensor_write_batch(bb, 2, false);
	p_nrt_tensor_read(c1, w, 0, 64);
	check(s == NRT_INVALID && !all_eq(w, 64, 0xEE) &&
		      p_nrt_tensor_read_batch(NULL, 1, false) == NRT_INVALID,
	      "a bad batch fails before any byte moves");

	/* attach_buffer */
	nrt_tensor_t *e = NULL;
	unsigned char *user = malloc(256);
	s = p_nrt_tensor_allocate_empty("c_empty", &e);
	check(s == NRT_SUCCESS && e && p_nrt_tensor_get_size(e) == 0 &&
		      p_nrt_tensor_read(e, b, 0, 1) != NRT_SUCCESS,
	      "allocate_empty has no storage");
	s = p_nrt_tensor_attach_buffer(e, user, 256);
	r = p_nrt_tensor_memset(e, 0, 0x42, 256);
	check(s == NRT_SUCCESS && r == NRT_SUCCESS && p_nrt_tensor_get_va(e) == user &&
		      all_eq(user, 256, 0x42) && p_nrt_tensor_get_size(e) == 256,
	      "attach_buffer uses the caller's memory");
	p_nrt_tensor_free(&e);
	user[0] = 1;
	free(user); /* would crash if the library had freed it */
	check(e == NULL, "freeing an attached tensor leaves the caller's buffer alone");

	/* tensor sets */
	nrt_tensor_set_t *set = NULL;
	nrt_tensor_t *got = NULL;
	s = p_nrt_allocate_tensor_set(&set);
	r = p_nrt_add_tensor_to_tensor_set(set, "in", c1);
	NRT_STATUS g = p_nrt_get_tensor_from_tensor_set(set, "in", &got);
	NRT_STATUS m = p_nrt_get_tensor_from_tensor_set(set, "missing", &got);
	check(s == NRT_SUCCESS && r == NRT_SUCCESS && g == NRT_SUCCESS && m == NRT_FAILURE,
	      "tensor set add/get; a missing name is NRT_FAILURE");
	p_nrt_get_tensor_from_tensor_set(set, "in", &got);
	check(got == c1, "get returns the tensor that was added");
	p_nrt_destroy_tensor_set(&set);
	check(set == NULL && p_nrt_tensor_get_size(c1) == N, "destroy_tensor_set keeps the caller's tensors");

	/* completion plane */
	check(p_nrt_tensor_check_output_completion(c2, 0, 0) == NRT_SUCCESS &&
		      p_nrt_tensor_check_output_completion(c2, 0, 1) == NRT_TIMEOUT &&
		      p_nrt_tensor_check_output_completion(c2, 2000, 1) == NRT_TIMEOUT &&
		      p_nrt_tensor_reset_output_completion(c2) == NRT_SUCCESS &&
		      p_nrt_tensor_check_output_completion(NULL, 0, 0) == NRT_INVALID,
	      "check_output_completion polls, times out, and rejects NULL");

	/* device allocation info */
	nrt_tensor_device_allocation_info_t info = { 0 };
	s = p_nrt_tensor_get_device_allocation_info(sl, &info);
	if (pl == NRT_TENSOR_PLACEMENT_DEVICE)
		check(s == NRT_SUCCESS && info.size == 1024 && info.hbm_index == 0 &&
			      info.physical_address != 0,
		      "device allocation info of a device slice");
	else
		check(s == NRT_INVALID, "device allocation info of a host tensor is NRT_INVALID");

	/* cross-channel copy */
	if (pl == NRT_TENSOR_PLACEMENT_DEVICE) {
		nrt_tensor_t *h1 = NULL;
		if (p_nrt_tensor_allocate(pl, 1, 64, "hbm1", &h1) == NRT_SUCCESS) {
			check(p_nrt_tensor_copy(c1, 0, h1, 0, 64) == NRT_INVALID,
			      "device copy across HBM channels is NRT_INVALID");
			p_nrt_tensor_free(&h1);
		} else {
			skip("device copy across HBM channels is NRT_INVALID", "one HBM channel");
		}
	} else {
		skip("device copy across HBM channels is NRT_INVALID", "host placement");
	}

	/* NULL and invalid arguments */
	nrt_tensor_t *nt = NULL, *np = NULL;
	p_nrt_tensor_free(NULL);
	p_nrt_tensor_free(&np);
	p_nrt_destroy_tensor_set(NULL);
	check(p_nrt_tensor_allocate(pl, 0, 16, "x", NULL) == NRT_INVALID &&
		      p_nrt_tensor_allocate((nrt_tensor_placement_t)9, 0, 16, "x", &nt) == NRT_INVALID &&
		      nt == NULL && p_nrt_tensor_read(NULL, b, 0, 1) == NRT_INVALID &&
		      p_nrt_tensor_write(c1, NULL, 0, 1) == NRT_INVALID &&
		      p_nrt_tensor_get_size(NULL) == 0 && p_nrt_tensor_get_va(NULL) == NULL &&
		      p_nrt_tensor_copy(NULL, 0, c1, 0, 1) == NRT_INVALID &&
		      p_nrt_tensor_allocate_empty("x", NULL) == NRT_INVALID &&
		      p_nrt_tensor_allocate_slice(NULL, 0, 0, NULL, &nt) == NRT_INVALID &&
		      p_nrt_allocate_tensor_set(NULL) == NRT_INVALID &&
		      p_nrt_add_tensor_to_tensor_set(NULL, "a", c1) == NRT_INVALID &&
		      p_nrt_get_tensor_from_tensor_set(NULL, "a", &nt) == NRT_INVALID &&
		      p_nrt_tensor_get_device_allocation_info(c1, NULL) == NRT_INVALID &&
		      p_nrt_tensor_reset_output_completion(NULL) == NRT_INVALID,
	      "NULL and invalid arguments return an error status");
	/* A pointer to something that is not a tensor (here, a set). */
	nrt_tensor_set_t *other = NULL;
	p_nrt_allocate_tensor_set(&other);
	check(p_nrt_tensor_get_size((nrt_tensor_t *)other) == 0 &&
		      p_nrt_tensor_read((nrt_tensor_t *)other, b, 0, 1) == NRT_INVALID_HANDLE,
	      "a non-tensor handle is NRT_INVALID_HANDLE");
	p_nrt_destroy_tensor_set(&other);

	/* zero-sized and large-size operations */
	check(p_nrt_tensor_read(c1, NULL, N, 0) == NRT_SUCCESS &&
		      p_nrt_tensor_write(c1, NULL, 0, 0) == NRT_SUCCESS,
	      "zero-sized I/O with NULL buffers succeeds");

	p_nrt_tensor_free(&sl);
	p_nrt_tensor_free(&c1);
	p_nrt_tensor_free(&c2);
	check(sl == NULL && c1 == NULL && c2 == NULL, "free every tensor");

	printf("# Totals: pass:%d fail:%d\n", test_no - failures, failures + (PLAN - test_no));
	if (test_no != PLAN)
		printf("# plan was %d but %d tests ran\n", PLAN, test_no);
	dlclose(lib);
	return failures || test_no != PLAN ? 1 : 0;
}
