#!/usr/bin/env bash
# Tests of scripts/lib.sh's kernel source handling, as TAP: run by
# scripts/test with the host tests (`bash tests/scripts/lib.t`).
set -uo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
n=0
ok() { n=$((n + 1)); echo "ok $n $1"; }
not_ok() { n=$((n + 1)); echo "not ok $n $1"; echo "# $2"; }

# Runs unpack_kernel_tarball "$1" with the cache in $tmp/cache, in a shell
# of its own as the build scripts do; its stdout to $2, stderr to $3.
unpack() {
	TDRV_CACHE=$tmp/cache bash -c '. "$1/scripts/lib.sh" && unpack_kernel_tarball "$2"' \
		- "$root" "$1" >"$2" 2>"$3"
}

# A small "source tree": a top directory (stripped on unpacking) of 3000
# files, enough that unpacking takes a while.
mkdir -p "$tmp/linux-x/sub"
for i in $(seq 3000); do echo "$i" >"$tmp/linux-x/sub/f$i"; done
tar -cJf "$tmp/src.tar.xz" -C "$tmp" linux-x

echo "1..3"

# A missing tarball (apt installed nothing, say): an error that names it,
# and the trees already in the cache stay.
mkdir -p "$tmp/cache/src/0123456789abcdef"
touch "$tmp/cache/src/0123456789abcdef/.unpacked"
if unpack "$tmp/none.tar.xz" "$tmp/out" "$tmp/err"; then
	not_ok "a missing tarball fails and removes nothing" "it succeeded: $(cat "$tmp/out")"
elif ! grep -q "none.tar.xz not found" "$tmp/err"; then
	not_ok "a missing tarball fails and removes nothing" "stderr: $(cat "$tmp/err")"
elif [ ! -e "$tmp/cache/src/0123456789abcdef/.unpacked" ]; then
	not_ok "a missing tarball fails and removes nothing" "the cached tree was removed"
else
	ok "a missing tarball fails and removes nothing"
fi

# Eight builds starting together: each gets the tree whole when its call
# returns, and all the same one.
pids=()
for i in $(seq 8); do
	(
		unpack "$tmp/src.tar.xz" "$tmp/out$i" "$tmp/err$i" || exit 1
		d=$(cat "$tmp/out$i")
		find "$d/sub" -type f | wc -l >"$tmp/count$i"
	) &
	pids+=($!)
done
bad=''
for i in $(seq 8); do
	wait "${pids[$((i - 1))]}" || bad+=" unpack $i failed: $(cat "$tmp/err$i");"
	[ "$(cat "$tmp/count$i" 2>/dev/null)" = 3000 ] ||
		bad+=" unpack $i saw $(cat "$tmp/count$i" 2>/dev/null) files;"
	[ "$(cat "$tmp/out$i")" = "$(cat "$tmp/out1")" ] || bad+=" unpack $i printed $(cat "$tmp/out$i");"
done
if [ -z "$bad" ]; then
	ok "eight unpacks started together each return the whole tree"
else
	not_ok "eight unpacks started together each return the whole tree" "$bad"
fi

# A tree an interrupted unpack left (no .unpacked mark) is unpacked again.
d=$(cat "$tmp/out1")
rm -f "$d/.unpacked" "$d/sub/f17"
if unpack "$tmp/src.tar.xz" "$tmp/out" "$tmp/err" && [ -e "$d/sub/f17" ] && [ -e "$d/.unpacked" ]; then
	ok "a tree without its unpacked mark is unpacked again"
else
	not_ok "a tree without its unpacked mark is unpacked again" "$(cat "$tmp/err")"
fi
