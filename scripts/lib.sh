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
