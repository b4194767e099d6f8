# tdrv: top-level build.
#
#   make            build tdrv.ko (for the cached test kernel, or KDIR=...)
#   make distro-module  build tdrv.ko for a distro kernel (default: the
#                   vendored Debian 7.2.13 cloud kernel; DISTRO=headers dir)
#   make run        boot the test guest with the module and run the demo;
#                   make run FILES="a b" CMD="./a" runs your own command
#   make test       the quick tier (~10 min warm): host tests, Miri, every
#                   device once on the debug kernel, a Debian smoke run;
#                   one verdict (docs/testing.md)
#   make test-full  the full matrix (CI): both kernels x every device x
#                   both clocks, longer fuzz and unbind_stress runs
#   make bench      benchmarks on the bench kernel (scripts/kernel bench;
#                   BENCH_KERNEL=debug for the test kernel; see README)
#   make deb        Debian packages (tdrv-dkms, libnrt1, libnrt-dev,
#                   tdrv-tools, python3-tdrv) and the abi3 wheel in
#                   build/deb/: dpkg-buildpackage of debian/ in a Debian
#                   sid chroot, then lintian (scripts/deb; needs root;
#                   docs/install.md)
#   make deb-repro  make deb, then a second build that must give
#                   byte-identical packages
#   make test-install  those packages installed on a Debian sid system
#                   booted under QEMU (scripts/test-install; needs root)
#   make install-tests [DESTDIR=dir]  the guest test programs, tdrv-smi and
#                   the kselftest-style runner run_tests in one directory
#                   (default build/tdrv-tests), for a machine of your own
#
# `run`, `test`, `test-full` and `bench` install what they need (scripts/setup) and
# build the test kernel once (scripts/kernel, cached outside the repo).

KDIR ?=
DISTRO ?=
FILES ?=
CMD ?=
PARAMS ?=
DESTDIR ?=
TIMEOUT ?= 900

export TDRV_BUILD := $(CURDIR)/build

.PHONY: all module distro-module setup kernel userspace deb deb-repro test-install install-tests run test test-full bench uapi clean

all: module

# With KDIR the module is built for that tree and nothing is installed.
module:
ifeq ($(KDIR),)
	@scripts/setup
	@scripts/build-module "$$(scripts/kernel)"
else
	@scripts/build-module "$(KDIR)"
endif

# A module build tree for a distro kernel (scripts/distro-kernel, cached)
# and tdrv.ko for it, in build/module-<release>/.
distro-module: setup
	@kdir=$$(scripts/distro-kernel $(DISTRO)) && scripts/build-module "$$kdir"

setup:
	@scripts/setup

kernel: setup
	@scripts/kernel

userspace: setup
	@scripts/build-userspace

deb: setup
	@scripts/deb

# make deb, then a second build that must give byte-identical packages.
deb-repro: setup
	@scripts/deb --repro

test-install: deb
	@scripts/test-install

# No setup: this is for your own machine, which needs cargo and gcc only.
install-tests:
	@scripts/install-tests "$(DESTDIR)"

run: setup
	@scripts/run-guest -c '$(subst ','\'',$(CMD))' -p '$(PARAMS)' -T $(TIMEOUT) $(FILES)

test: setup
	@scripts/test

test-full: setup
	@scripts/test --full

bench: setup
	@scripts/bench

# Regenerates the bindgen bindings of uapi/tdrv.h.
uapi: setup
	@scripts/gen-uapi

clean:
	rm -rf build target
