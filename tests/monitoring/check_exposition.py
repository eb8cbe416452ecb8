"""Parses a keyshift /metrics endpoint with Prometheus' reference parser (the Python client's
OpenMetrics parser) and checks the names against Prometheus' conventions:

* every family is keyshift_operator_*, keyshift_job_* or keyshift_worker_*;
* counters' samples end in _total, and nothing else does;
* base units: nothing in milliseconds (no _ms, no milli), durations, intervals and timestamps
  end in _seconds, sizes in _bytes;
* no label is named job or instance (Prometheus' own target labels).

Usage: check_exposition.py URL. Prints one "name type" line per family; exits 1 with every
violation on stderr.
"""

import re
import sys
import urllib.request

from prometheus_client.openmetrics.parser import text_string_to_metric_families

PREFIXES = ("keyshift_operator_", "keyshift_job_", "keyshift_worker_")


def violations(family):
    name, kind = family.name, family.type
    out = []
    if not name.startswith(PREFIXES) and name != "keyshift_build":
        out.append(f"{name}: not keyshift_build nor a keyshift_operator_/keyshift_job_/keyshift_worker_ name")
    if re.search(r"(^|_)(ms|millis|milliseconds)(_|$)", name) or "milli" in name:
        out.append(f"{name}: milliseconds; use seconds")
    if re.search(r"(duration|interval|timestamp|_age|latency)", name) and not name.endswith("_seconds"):
        out.append(f"{name}: a time must end in _seconds")
    if re.search(r"(bytes|size)", name) and not name.endswith("_bytes"):
        out.append(f"{name}: a size must end in _bytes")
    for s in family.samples:
        if kind == "counter":
            if not s.name.endswith("_total") and not s.name.endswith("_created"):
                out.append(f"{s.name}: a counter's sample must end in _total")
        elif s.name.endswith("_total"):
            out.append(f"{s.name}: only counters end in _total ({kind})")
        for label in s.labels:
            if label in ("job", "instance"):
                out.append(f"{s.name}: label {label} clashes with Prometheus' target labels")
    return out


def main():
    text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
    problems = []
    for family in text_string_to_metric_families(text):
        print(family.name, family.type)
        problems.extend(violations(family))
    if problems:
        print("\n".join(problems), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
