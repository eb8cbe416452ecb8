#!/usr/bin/env bash
# Checks the chart's monitoring objects (monitoring.* values) with Prometheus' own tools:
#   1. renders the chart with every monitoring object on (charts/keyshift/ci/monitoring-values.yaml);
#   2. hack/monitoring-check (Prometheus' promql parser and rulefmt): the dashboard is valid JSON
#      whose every query parses, the rules parse, every metric they use is one keyshift exposes
#      (tests/monitoring/metric-names.txt, kept current by a unit test), every alert has a unit
#      test that fires it and one that does not, the PodMonitor scrapes the control port;
#   3. `promtool check rules` on the rendered rules;
#   4. `promtool test rules` with tests/monitoring/rules-test.yaml: each alert fires on synthetic
#      series showing its condition and stays silent on healthy ones.
# promtool and the checker are built by hack/build-promtool.sh (cached).
set -euo pipefail
cd "$(dirname "$0")/.."

built="$(hack/build-promtool.sh)"
PROMTOOL="$(sed -n 's/^PROMTOOL=//p' <<<"$built")"
MONITORING_CHECK="$(sed -n 's/^MONITORING_CHECK=//p' <<<"$built")"
HELM="${KEYSHIFT_HELM:-$(hack/get-helm.sh)}"
HELM="${HELM#HELM=}"

work="$(mktemp -d /tmp/keyshift-monitoring.XXXXXX)"
trap 'rm -rf -- "$work"' EXIT

"$HELM" template keyshift charts/keyshift --namespace keyshift-system \
  -f charts/keyshift/ci/monitoring-values.yaml \
  --api-versions monitoring.coreos.com/v1/ServiceMonitor \
  --api-versions monitoring.coreos.com/v1/PodMonitor \
  --api-versions monitoring.coreos.com/v1/PrometheusRule \
  >"$work/rendered.yaml"

"$MONITORING_CHECK" -manifests "$work/rendered.yaml" -names tests/monitoring/metric-names.txt \
  -rule-tests tests/monitoring/rules-test.yaml -out "$work"
"$PROMTOOL" check rules "$work/rules.yaml"
cp tests/monitoring/rules-test.yaml "$work/"
"$PROMTOOL" test rules "$work/rules-test.yaml"
