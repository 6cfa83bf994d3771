#!/usr/bin/env bash
# Prints the root of a Debian 13 (trixie) chroot that holds torch 2.6,
# torchvision 0.21, onnx 1.17, onnxruntime 1.21 and safetensors: the PyTorch
# people run today, beside Debian 12's torch 1.13 that `make deps` installs.
# Built once (about 6 minutes, 3.8 GB; needs root) into $ABN_TORCH26_ROOT
# (default /var/cache/abnconvert/trixie) and reused while its stamp matches
# the package list below. Never committed. Run a command inside it with
#   .ci/torch26.sh --run python3 fixtures/interop.py ...
# which bind-mounts the repository (and ../shared) at the same paths.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${ABN_TORCH26_ROOT:-/var/cache/abnconvert/trixie}
PKGS="python3-torch python3-torchvision python3-numpy python3-setuptools python3-onnx python3-onnxruntime python3-safetensors"
STAMP="$ROOT/.abnconvert-stamp"

build() {
	command -v debootstrap >/dev/null || {
		echo "torch26: installing debootstrap" >&2
		apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >&2
	}
	rm -rf "$ROOT.partial"
	mkdir -p "$(dirname "$ROOT")"
	echo "torch26: debootstrap trixie into $ROOT (about 1 minute)" >&2
	debootstrap --variant=minbase trixie "$ROOT.partial" >&2
	mount -t proc proc "$ROOT.partial/proc"
	mount --bind /dev "$ROOT.partial/dev"
	trap 'umount "$ROOT.partial/proc" "$ROOT.partial/dev" 2>/dev/null || true' EXIT
	echo "torch26: installing $PKGS (about 5 minutes)" >&2
	chroot "$ROOT.partial" bash -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $PKGS >/dev/null && apt-get clean" >&2
	umount "$ROOT.partial/proc" "$ROOT.partial/dev"
	trap - EXIT
	echo "$PKGS" > "$ROOT.partial/.abnconvert-stamp"
	rm -rf "$ROOT"
	mv "$ROOT.partial" "$ROOT"
}

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$PKGS" ]; then
	build
fi

if [ "${1:-}" != "--run" ]; then
	echo "$ROOT"
	exit 0
fi
shift
# Run a command inside the chroot, in this repository at the same path, with
# ../shared beside it and /tmp shared, so paths the caller passes still work.
repo=$PWD
shared=$(cd .. && pwd)/shared
mounts=()
cleanup() { for ((i=${#mounts[@]}-1; i>=0; i--)); do umount "${mounts[$i]}" 2>/dev/null || true; done; }
trap cleanup EXIT
bindmount() { # src dst
	mkdir -p "$2"
	mount --bind "$1" "$2"
	mounts+=("$2")
}
mount -t proc proc "$ROOT/proc"; mounts+=("$ROOT/proc")
bindmount /dev "$ROOT/dev"
bindmount /tmp "$ROOT/tmp"
bindmount "$repo" "$ROOT$repo"
[ -d "$shared" ] && bindmount "$shared" "$ROOT$shared"
status=0
chroot "$ROOT" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 CI="${CI:-}" \
	bash -c 'cd "$0" && exec "$@"' "$repo" "$@" || status=$?
exit $status
