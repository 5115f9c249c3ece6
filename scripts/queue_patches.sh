#!/usr/bin/env bash
# Prints the queued patches (docs/design/QUEUE; not its variants) as the comma list PATCHES
# takes: docs/design/<name>.patch,... in the order they apply.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
sed -e 's/#.*//' docs/design/QUEUE | grep -v -- '<-' | sed 's/[[:space:]]//g; /^$/d' |
  sed 's#.*#docs/design/&.patch#' | paste -sd, -
