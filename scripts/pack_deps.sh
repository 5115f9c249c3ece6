#!/usr/bin/env bash
# Packs GoogleTest from this machine's Debian packages (libgtest-dev, libgmock-dev, googletest)
# into .deps/ for the GPU machine, which has no GoogleTest and no internet:
#
#   .deps/gtest/include/{gtest,gmock}/     headers
#   .deps/gtest/lib/lib{gtest,gtest_main,gmock,gmock_main}.a
#   .deps/googletest-src/                  the sources, for scripts/device_run.sh to rebuild
#                                          GoogleTest there if these libraries do not link
#
# CMake's FindGTest takes the layout through -DGTEST_ROOT=.deps/gtest (or -DGTest_ROOT=...).
# .deps/ is ignored by git: name it in the device run's `carry` list. Re-running replaces it.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$REPO/.deps"
LIBDIR="${GTEST_LIBDIR:-/usr/lib/x86_64-linux-gnu}"

die() { printf 'pack_deps: error: %s\n' "$*" >&2; exit 1; }

[[ -f /usr/include/gtest/gtest.h ]] || die "no /usr/include/gtest: run scripts/setup.sh first"
[[ -f "$LIBDIR/libgtest.a" && -f "$LIBDIR/libgtest_main.a" ]] ||
  die "no $LIBDIR/libgtest.a / libgtest_main.a: run scripts/setup.sh first"

rm -rf "$DEST/gtest" "$DEST/googletest-src"
mkdir -p "$DEST/gtest/include" "$DEST/gtest/lib"
cp -r /usr/include/gtest "$DEST/gtest/include/"
if [[ -d /usr/include/gmock ]]; then cp -r /usr/include/gmock "$DEST/gtest/include/"; fi
for lib in gtest gtest_main gmock gmock_main; do
  if [[ -f "$LIBDIR/lib$lib.a" ]]; then cp "$LIBDIR/lib$lib.a" "$DEST/gtest/lib/"; fi
done
if [[ -d /usr/src/googletest ]]; then
  cp -r /usr/src/googletest "$DEST/googletest-src"
fi

{
  echo "packed $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
  dpkg-query -W -f='${Package} ${Version}\n' libgtest-dev libgmock-dev googletest 2>/dev/null ||
    true
  "${CXX:-c++}" --version 2>/dev/null | head -n 1 || true
} >"$DEST/gtest/PACKED"

echo "pack_deps: $(du -sh "$DEST" | cut -f1) in $DEST" \
  "($(find "$DEST/gtest/lib" -name '*.a' | wc -l) libraries," \
  "sources: $([[ -d $DEST/googletest-src ]] && echo yes || echo no))"
