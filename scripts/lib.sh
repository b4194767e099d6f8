# Shared shell helpers for tdrv's scripts. Sourced, not executed.

# Everything built outside the repo (kernel builds, libclang) lives here.
TDRV_CACHE=${TDRV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tdrv}
LIBCLANG_DIR=$TDRV_CACHE/pylibclang/clang/native
export TDRV_CACHE LIBCLANG_DIR
mkdir -p "$TDRV_CACHE"

if [ -d "$LIBCLANG_DIR" ]; then
	export LIBCLANG_PATH=$LIBCLANG_DIR
fi
export PATH="$HOME/.cargo/bin:$PATH"

_t0=${_t0:-$(date +%s)}

# Prints a stage line with the seconds elapsed since the script started.
stage() {
	printf '[%4ds] %s\n' $(($(date +%s) - _t0)) "$*" >&2
}

die() {
	echo "error: $*" >&2
	exit 1
}

# --- Linux source -----------------------------------------------------
# Shared by scripts/kernel (the test kernel) and scripts/distro-kernel (a
# tree for a distro kernel): both build from the same 7.2 source.

_tdrv_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The vendored kernel files (README: ../shared/kernel next to the checkout).
TDRV_SHARED_KERNEL=${TDRV_SHARED_KERNEL:-$_tdrv_root/../shared/kernel}

# Unpacks tarball $1 into the cache (once per content hash), prints the tree.
# Callers run this in a command substitution, where `set -e` does not
# reach: every failure exits here, explicitly. The tree is unpacked under
# a temporary name and renamed into place, under a lock, so that two builds
# starting together (make test and make bench, say) neither unpack over
# each other nor use a half-unpacked tree, and a tree once there is never
# removed while another build uses it.
unpack_kernel_tarball() {
	local tar=$1 sum dir tmp
	[ -f "$tar" ] || die "kernel source tarball $tar not found"
	sum=$(sha256sum "$tar" | cut -c1-16) && [ ${#sum} = 16 ] ||
		die "cannot read $tar"
	dir=$TDRV_CACHE/src/$sum
	if [ ! -e "$dir/.unpacked" ]; then
		mkdir -p "$TDRV_CACHE/src" || die "cannot create $TDRV_CACHE/src"
		(
			flock 9 || die "cannot lock $dir.lock"
			[ ! -e "$dir/.unpacked" ] || exit 0
			stage "kernel: unpacking $(basename "$tar")"
			tmp=$dir.partial
			rm -rf "$tmp" "$dir" && mkdir -p "$tmp" &&
				tar -xf "$tar" -C "$tmp" --strip-components=1 &&
				touch "$tmp/.unpacked" && mv "$tmp" "$dir" ||
				die "unpacking $tar into $dir failed"
		) 9>"$dir.lock" || exit 1
	fi
	echo "$dir"
}

# Installs linux-source-7.2 with apt, prints its tarball. If no configured
# suite carries it, adds the backports suite of this release on the same
# mirrors that are already configured (no host is named here).
debian_source_tarball() {
	local pkg=linux-source-7.2 tar=/usr/src/linux-source-7.2.tar.xz
	if [ ! -e "$tar" ]; then
		if ! apt-cache policy "$pkg" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
			local codename uris
			codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
			uris=$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | cut -d' ' -f2-)
			[ -n "$uris" ] || uris=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list)
			[ -n "$uris" ] || die "no apt source to derive a suite from; set KSRC"
			stage "kernel: adding ${codename}-backports from the configured mirror"
			printf 'Types: deb\nURIs: %s\nSuites: %s-backports\nComponents: main\n' \
				"$uris" "$codename" >/etc/apt/sources.list.d/tdrv-backports.sources
			apt-get update -qq >/dev/null
		fi
		stage "kernel: installing $pkg"
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg" >/dev/null ||
			die "apt could not install $pkg: set KSRC to a Linux 7.2 source tarball or tree"
	fi
	echo "$tar"
}

# Prints the Linux source tree to build from; first match wins:
#   $KSRC                                       a tarball or an unpacked tree
#   ../shared/kernel/linux-source-7.2.tar.xz    after checking its .sha256
#   the linux-source-7.2 Debian package, through the machine's apt
kernel_source() {
	local shared_tar=$TDRV_SHARED_KERNEL/linux-source-7.2.tar.xz want have stamp
	if [ -n "${KSRC:-}" ]; then
		if [ -d "$KSRC" ]; then (cd "$KSRC" && pwd); else unpack_kernel_tarball "$KSRC"; fi
	elif [ -e "$shared_tar" ]; then
		want=$(cut -d' ' -f1 "$shared_tar.sha256")
		stamp=$TDRV_CACHE/src/shared-$want.ok
		if [ ! -e "$stamp" ]; then
			stage "kernel: checking $(basename "$shared_tar") checksum"
			have=$(sha256sum "$shared_tar" | cut -d' ' -f1)
			[ "$have" = "$want" ] || die "checksum mismatch for $shared_tar"
			mkdir -p "$TDRV_CACHE/src" && touch "$stamp"
		fi
		unpack_kernel_tarball "$shared_tar"
	else
		local tar
		tar=$(debian_source_tarball) || exit 1
		unpack_kernel_tarball "$tar"
	fi
}

# --- kernel config ----------------------------------------------------

# Value of CONFIG_$1 in config file $2 (quotes removed), empty if unset.
config_value() {
	sed -n "s/^CONFIG_$1=//p" "$2" | sed 's/^"\(.*\)"$/\1/'
}

# The vermagic string (include/linux/vermagic.h) of release $2 built with
# config $1, without its trailing space: what modinfo shows and what the
# kernel compares at load time.
config_vermagic() {
	local config=$1 v="$2 "
	[ "$(config_value SMP "$config")" = y ] && v+="SMP "
	if [ "$(config_value PREEMPT_RT "$config")" = y ]; then
		v+="preempt_rt "
	elif [ "$(config_value PREEMPT_BUILD "$config")" = y ]; then
		v+="preempt "
	fi
	[ "$(config_value MODULE_UNLOAD "$config")" = y ] && v+="mod_unload "
	[ "$(config_value MODVERSIONS "$config")" = y ] && v+="modversions "
	echo "${v% }"
}

# The Debian mirror this machine's apt uses (no host is named here).
debian_mirror() {
	local u
	u=$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' |
		grep -v -- '-security' | head -1)
	[ -n "$u" ] || u=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) {print $i; exit}}' \
		/etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -1)
	[ -n "$u" ] || die "no Debian mirror in /etc/apt/sources.list*"
	echo "${u%/}"
}
