#!/usr/bin/env bash
# The link `make demo` runs on, printed on stdout: $PACMPI_DEMO_LINK (default 100mbit, where
# communication is over 90% of the dense step on this workload) when pacmpi-run --link can
# shape one here -- decided by the launcher's own check (probe_testbed: root, ip, tc, network
# namespaces, tbf) -- else "none", with one line on stderr saying why.
set -euo pipefail
link=${PACMPI_DEMO_LINK:-100mbit}
if [[ $link == none ]]; then
  echo "demo: running unshaped (PACMPI_DEMO_LINK=none)" >&2
else
  problem=$(python -c 'from pacmpi.launch.testbed import probe_testbed; print(probe_testbed() or "")')
  if [[ -n $problem ]]; then
    echo "demo: cannot shape a $link link here, so running unshaped (every method then" \
      "shows about the same time per step): $problem" >&2
    link=none
  fi
fi
echo "$link"
