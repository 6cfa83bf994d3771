#!/usr/bin/env bash
# Prints a directory that holds cuda.h, for CGO_CFLAGS=-I<dir>: the CUDA build
# (make cuda cuda-test emudriver) needs the header only, never a CUDA library.
# Where none is installed, this takes the one header out of Debian's
# nvidia-cuda-dev (CUDA 11.8, non-free: a 774 MB download, about 45 s)
# without installing the 2.8 GB toolkit, into build/cuda/include. Needs root
# only when the non-free component has to be added to apt's sources.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in ${CUDA_HOME:+"$CUDA_HOME/include"} /usr/include /usr/local/cuda/include "$PWD/build/cuda/include"; do
	if [ -f "$d/cuda.h" ]; then
		echo "$d"
		exit 0
	fi
done
# Whether any source offers the package: `apt-cache show` exits 0 for a name
# that is only referenced (another package suggests it), with no candidate.
if [ -z "$(apt-cache madison nvidia-cuda-dev 2>/dev/null)" ]; then
	. /etc/os-release
	echo "cuda-headers: adding Debian's non-free component for $VERSION_CODENAME (nvidia-cuda-dev)" >&2
	cat >/etc/apt/sources.list.d/abnconvert-non-free.sources <<SRC
Types: deb
URIs: http://deb.debian.org/debian
Suites: $VERSION_CODENAME
Components: non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
	apt-get update -qq >&2
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "cuda-headers: downloading nvidia-cuda-dev for cuda.h" >&2
(cd "$tmp" && apt-get download -qq nvidia-cuda-dev 2>&1 | grep -v 'unsandboxed' >&2 || true)
deb=$(ls "$tmp"/nvidia-cuda-dev_*.deb)
dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$tmp" ./usr/include/cuda.h
mkdir -p build/cuda/include
mv "$tmp/usr/include/cuda.h" build/cuda/include/cuda.h
echo "$PWD/build/cuda/include"
