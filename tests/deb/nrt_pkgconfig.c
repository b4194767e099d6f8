/*
 * A program built the way third-party code builds against the installed
 * libnrt-dev: cc nrt_pkgconfig.c $(pkg-config --cflags --libs nrt).
 * It allocates a device tensor on /dev/tdrv0 (TDRV_DEVICE), writes a
 * pattern, copies it to a second tensor on the device, reads it back and
 * compares. Prints "nrt_pkgconfig: ok" and exits 0 on success; on failure
 * prints the failing call and its status and exits 1.
 */
#include <nrt/nrt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SIZE (256 * 1024)

static int check(NRT_STATUS s, const char *what)
{
	if (s != NRT_SUCCESS) {
		fprintf(stderr, "nrt_pkgconfig: %s failed: status %d\n", what, (int)s);
		return 1;
	}
	return 0;
}

int main(void)
{
	nrt_tensor_t *src = NULL, *dst = NULL;
	unsigned char *in = malloc(SIZE), *out = malloc(SIZE);
	size_t i;

	if (!in || !out)
		return 1;
	for (i = 0; i < SIZE; i++)
		in[i] = (unsigned char)(i * 31 + 7);
	memset(out, 0, SIZE);

	if (check(nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_DEVICE, 0, SIZE, "pkg_src", &src),
		  "nrt_tensor_allocate(src)") ||
	    check(nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_DEVICE, 0, SIZE, "pkg_dst", &dst),
		  "nrt_tensor_allocate(dst)") ||
	    check(nrt_tensor_write(src, in, 0, SIZE), "nrt_tensor_write") ||
	    check(nrt_tensor_copy(src, 0, dst, 0, SIZE), "nrt_tensor_copy") ||
	    check(nrt_tensor_read(dst, out, 0, SIZE), "nrt_tensor_read"))
		return 1;
	if (nrt_tensor_get_size(dst) != SIZE) {
		fprintf(stderr, "nrt_pkgconfig: size %zu, want %d\n", nrt_tensor_get_size(dst), SIZE);
		return 1;
	}
	for (i = 0; i < SIZE; i++) {
		if (out[i] != in[i]) {
			fprintf(stderr, "nrt_pkgconfig: byte %zu is %#x, want %#x\n", i, out[i], in[i]);
			return 1;
		}
	}
	nrt_tensor_free(&src);
	nrt_tensor_free(&dst);
	if (src || dst) {
		fprintf(stderr, "nrt_pkgconfig: nrt_tensor_free left the pointer set\n");
		return 1;
	}
	free(in);
	free(out);
	printf("nrt_pkgconfig: ok\n");
	return 0;
}
