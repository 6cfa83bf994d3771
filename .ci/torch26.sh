#!/usr/bin/env bash
# Prints the root of a Debian 13 (trixie) chroot that holds torch 2.6,
# torchvision 0.21, onnx 1.17, onnxruntime 1.21 and safetensors: the PyTorch
# people run today, beside Debian 12's torch 1.13 that `make deps` installs.
# Built once (measured 3.5 minutes, up to 6 on a slower mirror; 1.5 GB
# after apt-get clean; needs root) into $ABN_TORCH26_ROOT (default
# /var/cache/abnconvert/trixie) and reused while its stamp matches the
# package list below. Never committed. Run a command inside it with
#   .ci/torch26.sh --run python3 fixtures/interop.py ...
# which bind-mounts the repository (and ../shared, and /tmp) at the same
# paths, so that paths the caller passes work on both sides.
#
# Every mount (the build's and each run's) is made in a private mount
# namespace (unshare -m): it disappears with the process, however that ends,
# and is never visible to the host, so no later `rm -rf` of the root can
# reach through a leftover bind mount into /dev or the repository.
# Concurrent callers wait for one build (flock on $ROOT.lock).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${ABN_TORCH26_ROOT:-/var/cache/abnconvert/trixie}
PKGS="python3-torch python3-torchvision python3-numpy python3-setuptools python3-onnx python3-onnxruntime python3-safetensors"
STAMP="$ROOT/.abnconvert-stamp"

fresh() { [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PKGS" ]; }

# Refuses to go on while anything is mounted under $1 (a run of an older
# version of this script, which mounted on the host, may have left one).
no_mounts_under() {
	if findmnt -rn -o TARGET | grep -qF -- "$1/"; then
		echo "torch26: something is still mounted under $1; unmount it first:" >&2
		findmnt -rn -o TARGET | grep -F -- "$1/" >&2
		exit 1
	fi
}

build() {
	command -v debootstrap >/dev/null || {
		echo "torch26: installing debootstrap" >&2
		apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >&2
	}
	local part="$ROOT.partial"
	no_mounts_under "$part"
	rm -rf "$part"
	echo "torch26: debootstrap trixie into $part (about 1 minute)" >&2
	debootstrap --variant=minbase trixie "$part" >&2
	echo "torch26: installing $PKGS (about 5 minutes)" >&2
	unshare --mount --propagation private bash -c '
		set -e
		mount -t proc proc "$1/proc"
		mount --bind /dev "$1/dev"
		chroot "$1" bash -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $2 >/dev/null && apt-get clean"
	' torch26-build "$part" "$PKGS" >&2
	echo "$PKGS" > "$part/.abnconvert-stamp"
	no_mounts_under "$ROOT"
	rm -rf "$ROOT"
	mv "$part" "$ROOT"
}

if ! fresh; then
	if [ "$(id -u)" != 0 ]; then
		echo "torch26: building $ROOT needs root (debootstrap, mount, chroot)" >&2
		exit 1
	fi
	mkdir -p "$(dirname "$ROOT")"
	exec 9>"$ROOT.lock"
	flock 9
	fresh || build # another caller may have built it while this one waited
	exec 9>&-
fi

if [ "${1:-}" != "--run" ]; then
	echo "$ROOT"
	exit 0
fi
shift
[ $# -gt 0 ] || { echo "usage: .ci/torch26.sh [--run CMD...]" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "torch26: --run needs root (mount, chroot)" >&2; exit 1; }
repo=$PWD
shared=$(cd .. && pwd)/shared
exec unshare --mount --propagation private bash -c '
	set -e
	root=$1 repo=$2 shared=$3 ci=$4
	shift 4
	bindmount() { mkdir -p "$2" && mount --bind "$1" "$2"; }
	mount -t proc proc "$root/proc"
	mount --rbind /dev "$root/dev" # with /dev/shm and /dev/pts
	bindmount /tmp "$root/tmp"
	bindmount "$repo" "$root$repo"
	if [ -d "$shared" ]; then bindmount "$shared" "$root$shared"; fi
	exec chroot "$root" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 CI="$ci" \
		bash -c "cd \"\$0\" && exec \"\$@\"" "$repo" "$@"
' torch26-run "$ROOT" "$repo" "$shared" "${CI:-}" "$@"
