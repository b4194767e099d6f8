/* SPDX-License-Identifier: MIT OR Apache-2.0 */
/*
 * kselftest-style TAP 13 output for the C test programs of libnrt.so.1:
 * each result line carries its duration (the time since the previous
 * line), as the Rust guest programs' lines do. Header-only: each program
 * includes it once. tap_start() before the first check.
 */
#ifndef TDRV_TESTS_TAP_H
#define TDRV_TESTS_TAP_H

#include <stdio.h>
#include <time.h>

static int test_no, failures;
static struct timespec tap_last;

static void tap_start(void)
{
	clock_gettime(CLOCK_MONOTONIC, &tap_last);
}

/* Milliseconds since the previous TAP line. */
static long long ms_since_last(void)
{
	struct timespec now;
	long long ms;

	clock_gettime(CLOCK_MONOTONIC, &now);
	ms = (now.tv_sec - tap_last.tv_sec) * 1000LL + (now.tv_nsec - tap_last.tv_nsec) / 1000000;
	tap_last = now;
	return ms;
}

static void check(int ok, const char *name)
{
	test_no++;
	if (!ok)
		failures++;
	printf("%sok %d %s # time=%lldms\n", ok ? "" : "not ", test_no, name, ms_since_last());
	fflush(stdout);
}

static void skip(const char *name, const char *why)
{
	test_no++;
	printf("ok %d %s # SKIP %s\n", test_no, name, why);
	ms_since_last();
}

#endif /* TDRV_TESTS_TAP_H */
