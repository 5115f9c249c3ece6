#!/usr/bin/env bash
# On the GPU machine: unpacks prebuilt-NAME/ (scripts/prebuild.sh) in place, and links the path
# the tests were built to run mkrun from to the carried mkrun.
#   bash scripts/unpack_prebuilt.sh NAME...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for name in "$@"; do
  dir="$PWD/prebuilt-$name"
  [[ -d "$dir" ]] || { echo "unpack_prebuilt.sh: no $dir (carry it)" >&2; exit 1; }
  for f in "$dir"/*.xz; do [[ -e "$f" ]] && xz -d -f -T0 "$f"; done
  find "$dir" -maxdepth 1 -type f ! -name '*.*' ! -name COMMIT ! -name MKRUN_PATH -exec chmod +x {} +
  if [[ -f "$dir/MKRUN_PATH" && -x "$dir/mkrun" ]]; then
    path="$(cat "$dir/MKRUN_PATH")"
    mkdir -p "$(dirname "$path")" && ln -sf "$dir/mkrun" "$path"
  fi
  echo "unpack_prebuilt.sh: $dir ($(cat "$dir/COMMIT" 2>/dev/null || echo '?'))"
done
