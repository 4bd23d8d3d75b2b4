#!/usr/bin/env bash
# The crate graph's "never" rules that cargo can check (docs/architecture.md): the router,
# the contracts, the plumbing and the text layer link no engine and no candle; the router
# links no node and no KV plane; the engine knows no transport. Run by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

fail=0
refuse() {  # refuse CRATE PATTERN WHY
    local found
    found=$(cargo tree --offline -p "$1" -e normal --prefix none --format '{p}' |
        awk '{print $1}' | sort -u | grep -E "^($2)\$" || true)
    if [ -n "$found" ]; then
        echo "crate graph: $1 depends on $(echo "$found" | tr '\n' ' ')- $3" >&2
        fail=1
    fi
}

refuse router 'engine|candle-.*|prefill-node|decode-node|kvwire' "the router links no candle and speaks to workers only through the contracts"
refuse proto 'engine|candle-.*' "contracts compile without the model"
for c in runtime tls discovery hub; do
    refuse "$c" 'engine|candle-.*' "plumbing loads no model"
done
refuse text 'engine|candle-.*' "the text layer links no candle"
refuse engine 'proto|tonic|kvwire|router|runtime' "the engine knows no transport"
refuse prefill-node 'decode-node' "P and D meet only through the contracts"
refuse intake "kvwire|prefill-node|decode-node|router" "intake checks requests; it is no KV plane and no node"
refuse decode-node 'prefill-node' "P and D meet only through the contracts"
[ "$fail" = 0 ] && echo "crate graph: every rule holds"
exit "$fail"
