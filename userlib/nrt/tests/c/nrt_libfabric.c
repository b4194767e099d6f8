// SPDX-License-Identifier: MIT OR Apache-2.0
/*
 * libfabric's Neuron memory support, as a test of libnrt.so.1: it loads
 * the library with dlopen() by its soname, looks up the six symbols it
 * needs (failing to initialise if one is missing), asks for the number of
 * NeuronCores (which must be > 0), allocates device memory, finds its
 * address, copies host bytes into it with nrt_memcpy_to_device, and asks
 * for a dma-buf fd to register with the NIC, assuming the address is at
 * offset 0 of that dma-buf. Here the fd is mmapped instead of registered,
 * and the bytes compared. Prints kselftest TAP 13; exits 0 when every
 * check passed, 1 otherwise.
 *
 * usage: nrt_libfabric /dev/tdrvN [library]
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "nrt/nrt.h"

#include "tap.h"

#define PLAN 14

#define API(fn) static __typeof__(fn) *p_##fn
API(nrt_tensor_allocate);
API(nrt_tensor_free);
API(nrt_tensor_get_va);
API(nrt_memcpy_to_device);
API(nrt_get_dmabuf_fd);
API(nrt_get_total_nc_count);

/* Mappings of the device node in this process (/proc/self/maps). */
static int node_mappings(const char *node)
{
	char line[512];
	int n = 0;
	FILE *f = fopen("/proc/self/maps", "r");

	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f)) {
		char *path = strchr(line, '/');
		if (path && !strncmp(path, node, strlen(node)) &&
		    (path[strlen(node)] == '\n' || path[strlen(node)] == ' '))
			n++;
	}
	fclose(f);
	return n;
}

static void fill(unsigned char *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)(i * 13 + seed);
}

int main(int argc, char **argv)
{
	enum { N = 64 * 1024, MID = 4096 };
	static unsigned char host[N];

	if (argc < 2 || strncmp(argv[1], "/dev/", 5)) {
		fprintf(stderr, "usage: %s /dev/tdrvN [library]\n", argv[0]);
		return 2;
	}
	const char *libname = argc > 2 ? argv[2] : "libnrt.so.1";
	setenv("TDRV_DEVICE", argv[1], 1);
	/* The refusals below make the library log errors on purpose. */
	setenv("NEURON_RT_LOG_LEVEL", "OFF", 0);

	(void)skip; /* every check here runs */
	tap_start();
	printf("TAP version 13\n1..%d\n", PLAN);
	void *lib = dlopen(libname, RTLD_NOW);
	if (!lib && argc <= 2) {
		/* Next to this program, under its soname. */
		static char path[4096];
		ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 32);
		if (n > 0) {
			path[n] = 0;
			char *slash = strrchr(path, '/');
			if (slash) {
				strcpy(slash + 1, "libnrt.so.1");
				lib = dlopen(path, RTLD_NOW);
			}
		}
	}
	if (!lib)
		printf("# dlopen: %s\n", dlerror());
	check(lib != NULL, "dlopen libnrt.so.1");
	int found = lib != NULL;
#define LOOKUP(fn)                                                      \
	do {                                                            \
		p_##fn = lib ? (__typeof__(fn) *)dlsym(lib, #fn) : NULL; \
		if (!p_##fn) {                                          \
			printf("# missing symbol %s\n", #fn);           \
			found = 0;                                      \
		}                                                       \
	} while (0)
	LOOKUP(nrt_tensor_allocate);
	LOOKUP(nrt_tensor_free);
	LOOKUP(nrt_tensor_get_va);
	LOOKUP(nrt_memcpy_to_device);
	LOOKUP(nrt_get_dmabuf_fd);
	LOOKUP(nrt_get_total_nc_count);
#undef LOOKUP
	check(found, "dlsym finds the six symbols libfabric requires");
	if (!found) {
		printf("# Totals: pass:%d fail:%d\n", test_no - failures, PLAN - test_no + failures);
		return 1;
	}

	uint32_t count = 0;
	NRT_STATUS s = p_nrt_get_total_nc_count(&count);
	printf("# nrt_get_total_nc_count: status %d, count %u\n", s, count);
	check(s == NRT_SUCCESS && count > 0, "nrt_get_total_nc_count gives a count > 0");

	nrt_tensor_t *t = NULL;
	s = p_nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_DEVICE, 0, N, "libfabric", &t);
	unsigned char *va = t ? p_nrt_tensor_get_va(t) : NULL;
	check(s == NRT_SUCCESS && t && va, "allocate a DEVICE tensor on vnc 0 and get its va");
	if (!va) {
		printf("# allocate returned %d; cannot go on\n", s);
		return 1;
	}

	fill(host, N, 5);
	s = p_nrt_memcpy_to_device(va, host, N);
	check(s == NRT_SUCCESS, "nrt_memcpy_to_device of the whole tensor");

	/* Another device tensor whose address nobody asked for: finding va
	 * must not map it (the library once mapped every device tensor). */
	nrt_tensor_t *other = NULL;
	NRT_STATUS o = p_nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_DEVICE, 0, N, "unmapped", &other);
	int maps_before = node_mappings(argv[1]);
	int fd = -1;
	s = p_nrt_get_dmabuf_fd((uint64_t)(uintptr_t)va, N, &fd);
	int maps_after = node_mappings(argv[1]);
	check(s == NRT_SUCCESS && fd >= 0, "nrt_get_dmabuf_fd at the tensor's va");
	printf("# mappings of %s: %d before, %d after\n", argv[1], maps_before, maps_after);
	check(o == NRT_SUCCESS && maps_before > 0 && maps_after == maps_before,
	      "nrt_get_dmabuf_fd maps no other tensor to find va");
	p_nrt_tensor_free(&other);

	unsigned char *m = MAP_FAILED;
	if (fd >= 0)
		m = mmap(NULL, N, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	check(m != MAP_FAILED && !memcmp(m, host, N),
	      "the dma-buf's bytes from offset 0 are those copied to va");

	/* A copy into the middle of the tensor lands at its offset. */
	unsigned char part[100];
	fill(part, sizeof(part), 99);
	s = p_nrt_memcpy_to_device(va + MID, part, sizeof(part));
	check(s == NRT_SUCCESS && m != MAP_FAILED && !memcmp(m + MID, part, sizeof(part)) &&
		      !memcmp(m, host, MID),
	      "nrt_memcpy_to_device at va + offset writes that offset only");

	/* libfabric takes the fd's offset of an address to be 0, so an
	 * address inside the allocation must not get its dma-buf; and a
	 * refusal other than NRT_RESOURCE makes it fall back. */
	int mid_fd = -1;
	s = p_nrt_get_dmabuf_fd((uint64_t)(uintptr_t)(va + MID), 100, &mid_fd);
	check(s == NRT_INVALID && mid_fd == -1,
	      "nrt_get_dmabuf_fd in the middle of a tensor is NRT_INVALID (not NRT_RESOURCE)");

	int host_fd = -1;
	s = p_nrt_get_dmabuf_fd((uint64_t)(uintptr_t)host, 100, &host_fd);
	NRT_STATUS c = p_nrt_memcpy_to_device(host, part, sizeof(part));
	check(s == NRT_INVALID && host_fd == -1 && c == NRT_INVALID,
	      "host memory is NRT_INVALID for nrt_get_dmabuf_fd and nrt_memcpy_to_device");

	s = p_nrt_get_dmabuf_fd((uint64_t)(uintptr_t)va, N + 1, &host_fd);
	c = p_nrt_memcpy_to_device(va + N - 10, part, 11);
	check(s == NRT_INVALID && c == NRT_INVALID,
	      "ranges past the tensor's end are NRT_INVALID");

	p_nrt_tensor_free(&t);
	int gone_fd = -1;
	s = p_nrt_get_dmabuf_fd((uint64_t)(uintptr_t)va, N, &gone_fd);
	check(t == NULL && s == NRT_INVALID && gone_fd == -1,
	      "after nrt_tensor_free its va has no dma-buf");

	/* The dma-buf is the same memory and outlives the tensor. */
	check(m != MAP_FAILED && !memcmp(m + MID, part, sizeof(part)) && !memcmp(m, host, MID),
	      "the dma-buf's mapping keeps the bytes after the tensor is freed");
	if (m != MAP_FAILED)
		munmap(m, N);
	if (fd >= 0)
		close(fd);

	printf("# Totals: pass:%d fail:%d\n", test_no - failures, failures + (PLAN - test_no));
	if (test_no != PLAN)
		printf("# plan was %d but %d tests ran\n", PLAN, test_no);
	dlclose(lib);
	return failures || test_no != PLAN ? 1 : 0;
}
