#!/usr/bin/env bash
# A real, throwaway Kubernetes cluster for keyshift's tests: etcd, kube-apiserver,
# kube-controller-manager and kube-scheduler (built from upstream by
# hack/build-control-plane.sh) and one real node -- containerd + runc + the CNI
# ptp plugin (hack/build-node.sh) and a real kubelet -- running inside a
# network namespace of its own. The keyshift image is built from this checkout
# (hack/build-image.sh) and imported into the node's containerd.
#
#   eval "$(hack/testenv.sh up)"   # start (idempotent); stdout is `export KUBECONFIG=...`
#                                  # and `export KEYSHIFT_IMAGE=...` (the image's reference)
#   hack/testenv.sh status         # what runs; exit 0 only if /readyz answers "ok"
#   hack/testenv.sh down           # stop everything, remove netns and state (idempotent)
#   hack/testenv.sh restart-apiserver [S]  # stop kube-apiserver, wait S s, start it (outage tests)
#
# Must run as root (network namespaces). Everything it prints besides the
# export line goes to stderr.
#
# Network layout (all addresses stay on the project's own veth pair; S is
# $KEYSHIFT_SUBNET, default 213):
#
#   host  ── $VETH_HOST 10.S.0.1/16 ══ veth ══ $NETNS_IF 10.S.0.2/16 ── netns $NETNS
#                                                      default via 10.S.0.1
#   inside the netns: etcd on 127.0.0.1:2379/2380, kube-apiserver on :6443
#   (advertised as 10.S.0.2), kube-controller-manager on 127.0.0.1:10257,
#   kube-scheduler on 127.0.0.1:10259, containerd (socket in the state dir),
#   the kubelet on 10.S.0.2:10250 (node IP 10.S.0.2).
#   Pods: one point-to-point veth each (CNI ptp, host-local IPAM over
#   10.S.64.0/18, gateway 10.S.64.1 on the netns side of every veth), routed,
#   not bridged: a pod's only neighbour is its gateway. (On a bridge every pod
#   would ARP for every peer, and the kernel's neighbour table is shared by
#   all network namespaces: a 200-worker shuffle mesh overflows its default
#   1024 entries.) The host routes 10.S.64.0/18 via 10.S.0.2; the netns
#   forwards (net.ipv4.ip_forward is per netns).
#   Service ClusterIPs: 10.S.255.0/24. No kube-proxy: the one Service pods need,
#   "kubernetes" (10.S.255.1:443), is DNAT-ed to the apiserver inside the netns.
#
# containerd and the kubelet enter only the netns's *network* namespace
# (nsenter --net), not a mount namespace of their own (ip netns exec makes one),
# so the volumes the kubelet mounts (Secrets, projected tokens) are the ones
# runc bind-mounts into containers. Pod cgroups live under /keyshift-<netns>
# (the kubelet's cgroupRoot), so two environments never share /kubepods.
# The kubelet rewrites a few host-wide sysctls when it starts
# (vm.overcommit_memory, vm.panic_on_oom, kernel.panic, kernel.panic_on_oops,
# kernel.keys.root_max*); `up` records them and `down` puts them back.
#
# The host reaches the apiserver at https://10.S.0.2:6443 through the veth,
# and pods at their addresses through the route above. IP forwarding on
# the host is not touched, so nothing in the netns can reach beyond the host.
#
# Several environments can run side by side (e.g. two checkouts running
# hack/test.sh at once) when each has its own KEYSHIFT_SUBNET, KEYSHIFT_NETNS,
# KEYSHIFT_VETH_HOST and KEYSHIFT_TESTENV_DIR, e.g.
#   KEYSHIFT_SUBNET=214 KEYSHIFT_NETNS=keyshift-helm KEYSHIFT_VETH_HOST=kshelm0 \
#     KEYSHIFT_TESTENV_DIR=/tmp/keyshift-helm-env hack/test.sh
# `up` refuses to start when the netns is in use by another environment or
# another host interface already holds an address in 10.S.0.0/16.
#
# State dir ($KEYSHIFT_TESTENV_DIR, default /tmp/keyshift-testenv):
#   certs/  pki: CA, apiserver serving cert, admin and controller-manager client
#           certs, front-proxy CA + client, service-account key pair (sa.key/sa.pub)
#   pids/   <component>.pid of every process started (each is a process-group leader)
#   logs/   <component>.log
#   etcd/   etcd data
#   kubelet/  the kubelet's root dir (pods, volumes; unmounted at `down`)
#   containerd/  containerd's root, state, socket and config
#   cni/     CNI config and host-local IPAM state
#   pod-logs/  container logs (what `kubectl logs` reads)
#   sysctl.saved  host sysctls before the kubelet started
#   flexvolume/  kube-controller-manager's flex-volume dir (kept out of /usr)
#   kubeconfig                       admin (CN=admin, O=system:masters)
#   kube-controller-manager.kubeconfig
#   env     shell-sourceable description (KUBECONFIG, netns, interface, IPs, binaries)
#
# Environment:
#   KEYSHIFT_SUBNET        second octet of the environment's 10.S.0.0/16 (default 213);
#                          every address below derives from it
#   KEYSHIFT_TESTENV_DIR   state dir (default /tmp/keyshift-testenv)
#   KEYSHIFT_NETNS         netns name (default keyshift-test)
#   KEYSHIFT_VETH_HOST     host side veth name (default keyshift0)
#   KEYSHIFT_NETNS_IF      netns side interface name (default eth0)
#   KEYSHIFT_NODE=none     bring up the control plane only (no scheduler, node or image)
#   KEYSHIFT_SERVICE_CIDR  service ClusterIP range (default 10.S.255.0/24)
#   KEYSHIFT_TESTENV_TAKEOVER=1  let `up` tear down a netns of the same name whose
#                          processes belong to another state dir (a killed run's leftovers)
#   KEYSHIFT_CACHE, KEYSHIFT_K8S_VERSION, KEYSHIFT_ETCD_VERSION: see build-control-plane.sh
set -euo pipefail

# stdout is reserved for the final `export` line; everything else -> stderr.
exec 3>&1 1>&2

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${KEYSHIFT_TESTENV_DIR:-/tmp/keyshift-testenv}"
NETNS="${KEYSHIFT_NETNS:-keyshift-test}"
VETH_HOST="${KEYSHIFT_VETH_HOST:-keyshift0}"
NETNS_IF="${KEYSHIFT_NETNS_IF:-eth0}"
SUBNET="${KEYSHIFT_SUBNET:-213}"
HOST_IP="10.$SUBNET.0.1"
NS_IP="10.$SUBNET.0.2"
PREFIX=16
# ClusterIPs come from the netns's own /16 as well: nothing implements them
# (no kube-proxy), but should anything dial one (e.g. a process using
# in-cluster config dials the "kubernetes" Service IP), the packet is routed
# into our veth and dropped there instead of leaving through the host's
# default route.
SERVICE_CIDR="${KEYSHIFT_SERVICE_CIDR:-10.$SUBNET.255.0/24}"
# First address of an IPv4 CIDR (network address + 1): the "kubernetes" Service IP.
first_ip() {
  local ip="${1%/*}" bits="${1#*/}" a b c d n
  IFS=. read -r a b c d <<<"$ip"
  n=$(( ((a << 24) | (b << 16) | (c << 8) | d) & (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF ))
  n=$((n + 1))
  echo "$((n >> 24 & 255)).$((n >> 16 & 255)).$((n >> 8 & 255)).$((n & 255))"
}
FIRST_SERVICE_IP="$(first_ip "$SERVICE_CIDR")"
APISERVER_PORT=6443
APISERVER_URL="https://$NS_IP:$APISERVER_PORT"
ETCD_URL=http://127.0.0.1:2379
ETCD_PEER_URL=http://127.0.0.1:2380
KCM_PORT=10257
STOP_TIMEOUT="${KEYSHIFT_STOP_TIMEOUT:-20}"   # seconds between TERM and KILL
READY_TIMEOUT="${KEYSHIFT_READY_TIMEOUT:-90}" # seconds to wait for kube-apiserver /readyz
MARKER="$DIR/.keyshift-testenv"               # proves $DIR is ours before rm -rf
NODE="${KEYSHIFT_NODE:-real}"
NODE_NAME=keyshift-node
POD_CIDR="10.$SUBNET.64.0/18"
POD_GATEWAY="10.$SUBNET.64.1"
SCHED_PORT=10259
CGROUP_ROOT="/keyshift-$NETNS"
KUBELET_SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes)
CONTAINERD_SOCK="$DIR/containerd/containerd.sock"
# Start order; `down` stops in reverse.
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet)

log() { printf '[testenv] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ "$(id -u)" == 0 ]] || die "must run as root (network namespaces)"
[[ -n "$DIR" && "$DIR" != / ]] || die "refusing state dir '$DIR'"
[[ "$SUBNET" =~ ^(0|[1-9][0-9]{0,2})$ ]] && ((SUBNET <= 255)) || die "KEYSHIFT_SUBNET must be 0..255, got '$SUBNET'"
[[ "$NETNS" =~ ^[A-Za-z0-9_.-]+$ ]] || die "KEYSHIFT_NETNS must be a plain name, got '$NETNS'"
[[ "$NODE" == real || "$NODE" == none ]] || die "KEYSHIFT_NODE must be real or none, got '$NODE'"

# One testenv.sh at a time per network namespace, whichever checkout it runs
# from: the netns, its veth and its subnet are what environments share on a
# host. The lock file lives in /run/lock (tmpfs); children never see the
# descriptor (start() closes it).
LOCK_DIR=/run/lock
[[ -d "$LOCK_DIR" && -w "$LOCK_DIR" ]] || LOCK_DIR=/tmp
exec 8>"$LOCK_DIR/keyshift-testenv.$NETNS.lock"
flock 8

# ---------------------------------------------------------------------------------
# process bookkeeping
# ---------------------------------------------------------------------------------

pidfile() { echo "$DIR/pids/$1.pid"; }

# Prints the recorded pid of component $1 if that process still runs and is
# still the one we started (its start time matches what we recorded).
live_pid() {
  local f pid start
  f="$(pidfile "$1")"
  [[ -f "$f" ]] || return 1
  read -r pid start <"$f" || true
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [[ -e "/proc/$pid" ]] || return 1
  [[ -z "${start:-}" || "$(proc_start "$pid")" == "$start" ]] || return 1
  # A zombie no longer runs.
  [[ "$(proc_stat_field "$pid" 3)" != Z ]] || return 1
  echo "$pid"
}

# proc_stat_field PID N : field N (N >= 3) of /proc/PID/stat.
proc_stat_field() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 0
  stat="${stat##*) }"                    # drop "pid (comm) "; comm may contain spaces
  awk -v n="$(($2 - 2))" '{print $n}' <<<"$stat"
}

# Start time of PID in clock ticks since boot (field 22 of /proc/PID/stat).
proc_start() { proc_stat_field "$1" 22; }

# start NAME CMD... : run CMD inside the netns as a new session (so it is the
# leader of its own process group and survives this script), log to
# logs/NAME.log, record "pid starttime" in pids/NAME.pid. With NET_ONLY=1 the
# process enters only the netns's network namespace (see the header).
start() {
  local name="$1"; shift
  local enter=(ip netns exec "$NETNS")
  [[ "${NET_ONLY:-}" == 1 ]] && enter=(nsenter "--net=/run/netns/$NETNS" --)
  local logf="$DIR/logs/$name.log"
  log "starting $name (log: $logf)"
  # No job control here, so the background child is not a group leader and
  # setsid execs in place: $! is the pid of the final program (ip netns exec
  # execs too), which leads its own session and process group.
  # Inherited descriptors above 2 are closed first: e.g. fd 3 (our real
  # stdout) would otherwise keep the caller's `$(testenv.sh up)` waiting forever.
  (
    for fd in /proc/"$BASHPID"/fd/*; do
      fd="${fd##*/}"
      if ((fd > 2)); then eval "exec $fd>&-" 2>/dev/null || true; fi
    done
    exec setsid "${enter[@]}" "$@"
  ) >>"$logf" 2>&1 </dev/null &
  local pid=$!
  sleep 0.2
  echo "$pid $(proc_start "$pid")" >"$(pidfile "$name")"
}

# Stop component $1: TERM its process group, KILL after $STOP_TIMEOUT s.
stop() {
  local name="$1" pid
  pid="$(live_pid "$name")" || { rm -f "$(pidfile "$name")"; return 0; }
  log "stopping $name (pid $pid)"
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + STOP_TIMEOUT))
  while [[ -e "/proc/$pid" ]] && live_pid "$name" >/dev/null && ((SECONDS < deadline)); do
    sleep 0.2
  done
  if live_pid "$name" >/dev/null; then
    log "  $name did not exit after ${STOP_TIMEOUT}s, sending KILL"
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    sleep 0.5
  fi
  # Children that left the group but are still in the netns are handled by
  # kill_netns_leftovers.
  rm -f "$(pidfile "$name")"
}

# Any process still inside our netns was started by us (e.g. by the kubelet).
kill_netns_leftovers() {
  netns_exists || return 0
  local pids
  pids="$(ip netns pids "$NETNS" 2>/dev/null | tr '\n' ' ')"
  [[ -n "${pids// /}" ]] || return 0
  log "killing leftover processes in netns $NETNS: $pids"
  # shellcheck disable=SC2086
  kill -TERM $pids 2>/dev/null || true
  local deadline=$((SECONDS + 5))
  while [[ -n "$(ip netns pids "$NETNS" 2>/dev/null)" ]] && ((SECONDS < deadline)); do sleep 0.2; done
  pids="$(ip netns pids "$NETNS" 2>/dev/null | tr '\n' ' ')"
  # shellcheck disable=SC2086
  [[ -z "${pids// /}" ]] || kill -KILL $pids 2>/dev/null || true
}

# ---------------------------------------------------------------------------------
# network namespace
# ---------------------------------------------------------------------------------

# (Output is captured before matching: `cmd | grep -q` can fail under pipefail.)
netns_exists() {
  local list
  list="$(ip netns list 2>/dev/null)" || return 1
  awk -v ns="$NETNS" '$1 == ns { found = 1 } END { exit !found }' <<<"$list"
}

netns_up() {
  if ! netns_exists; then
    log "creating netns $NETNS"
    ip netns add "$NETNS"
  fi
  ip -n "$NETNS" link set lo up
  if ! ip link show "$VETH_HOST" >/dev/null 2>&1; then
    log "creating veth $VETH_HOST <-> $NETNS/$NETNS_IF"
    # Create the peer under a temporary name and rename it inside the netns,
    # so a host interface called $NETNS_IF (e.g. eth0) does not clash.
    ip link add "$VETH_HOST" type veth peer name "ksns$$" netns "$NETNS"
    ip -n "$NETNS" link set "ksns$$" name "$NETNS_IF"
  fi
  ip addr replace "$HOST_IP/$PREFIX" dev "$VETH_HOST"
  ip link set "$VETH_HOST" up
  ip -n "$NETNS" addr replace "$NS_IP/$PREFIX" dev "$NETNS_IF"
  ip -n "$NETNS" link set "$NETNS_IF" up
  # kube-apiserver picks its advertise address from the default route's
  # interface and refuses to start without one.
  ip -n "$NETNS" route replace default via "$HOST_IP" dev "$NETNS_IF"
}

# Refuse to touch an environment that is not ours: processes live in $NETNS
# but $DIR holds no state of ours (another checkout or state dir uses the same
# names), or another host interface already has an address in our /16.
check_not_shared() {
  if netns_exists && [[ ! -f "$MARKER" && -n "$(ip netns pids "$NETNS" 2>/dev/null)" ]] &&
    [[ "${KEYSHIFT_TESTENV_TAKEOVER:-}" != 1 ]]; then
    die "netns $NETNS has running processes but $DIR is not their state dir: another environment uses it.
  Pick other names (KEYSHIFT_SUBNET, KEYSHIFT_NETNS, KEYSHIFT_VETH_HOST, KEYSHIFT_TESTENV_DIR),
  stop that one ('hack/testenv.sh down' with its KEYSHIFT_TESTENV_DIR), or, if it is a leftover
  of a killed run, set KEYSHIFT_TESTENV_TAKEOVER=1 to tear it down."
  fi
  local other
  other="$(ip -4 -o addr show to "10.$SUBNET.0.0/$PREFIX" 2>/dev/null | awk -v mine="$VETH_HOST" '$2 != mine { print $2 " " $4 }')"
  if [[ -n "$other" ]]; then
    die "10.$SUBNET.0.0/$PREFIX is already in use on this host ($other); set KEYSHIFT_SUBNET to a free one"
  fi
}

netns_down() {
  kill_netns_leftovers
  if netns_exists; then
    log "deleting netns $NETNS"
    ip netns del "$NETNS" || true
  fi
  # Deleting the netns destroys the veth pair; clean up in case it did not.
  if ip link show "$VETH_HOST" >/dev/null 2>&1; then
    ip link del "$VETH_HOST" 2>/dev/null || true
  fi
}

# ---------------------------------------------------------------------------------
# certificates and kubeconfigs
# ---------------------------------------------------------------------------------

# sign NAME SUBJECT EXTENSIONS : key + cert signed by our CA ($CA, default "ca")
sign() {
  local name="$1" subj="$2" ext="$3" c="$DIR/certs" ca="${CA:-ca}"
  openssl req -new -newkey rsa:2048 -nodes -keyout "$c/$name.key" -subj "$subj" \
    -out "$c/$name.csr" 2>/dev/null
  printf '%s\n' "$ext" >"$c/$name.ext"
  openssl x509 -req -in "$c/$name.csr" -CA "$c/$ca.crt" -CAkey "$c/$ca.key" -CAcreateserial \
    -days 365 -sha256 -extfile "$c/$name.ext" -out "$c/$name.crt" 2>/dev/null
  rm -f "$c/$name.csr" "$c/$name.ext"
}

gen_certs() {
  local c="$DIR/certs"
  [[ -f "$c/.done" ]] && return 0
  log "generating certificates in $c"
  mkdir -p "$c"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$c/ca.key" -out "$c/ca.crt" -days 3650 \
    -sha256 -subj "/CN=keyshift-testenv-ca" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" 2>/dev/null
  local client="basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  sign apiserver "/CN=kube-apiserver" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:$NS_IP,IP:127.0.0.1,IP:$FIRST_SERVICE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  sign admin "/O=system:masters/CN=admin" "$client"
  # Front-proxy (request-header) CA and client: without them kube-apiserver
  # publishes no requestheader CA in kube-system/extension-apiserver-authentication
  # and every delegating component (kube-controller-manager, aggregated API
  # servers) logs errors; with them the aggregation layer works too.
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$c/front-proxy-ca.key" -out "$c/front-proxy-ca.crt" \
    -days 3650 -sha256 -subj "/CN=keyshift-testenv-front-proxy-ca" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" 2>/dev/null
  CA=front-proxy-ca sign front-proxy-client "/CN=front-proxy-client" "$client"
  sign kube-controller-manager "/CN=system:kube-controller-manager" "$client"
  # Service-account token signing key pair.
  openssl genrsa -out "$c/sa.key" 2048 2>/dev/null
  openssl rsa -in "$c/sa.key" -pubout -out "$c/sa.pub" 2>/dev/null
  chmod 600 "$c"/*.key
  touch "$c/.done"
}

# write_kubeconfig FILE USER CERTNAME : a kubeconfig with embedded CA + client cert
write_kubeconfig() {
  local file="$1" user="$2" cert="$3" c="$DIR/certs"
  cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: keyshift-testenv
  cluster:
    server: $APISERVER_URL
    certificate-authority-data: $(base64 -w0 "$c/ca.crt")
users:
- name: $user
  user:
    client-certificate-data: $(base64 -w0 "$c/$cert.crt")
    client-key-data: $(base64 -w0 "$c/$cert.key")
contexts:
- name: keyshift-testenv
  context:
    cluster: keyshift-testenv
    user: $user
current-context: keyshift-testenv
EOF
  chmod 600 "$file"
}

# ---------------------------------------------------------------------------------
# health checks
# ---------------------------------------------------------------------------------

# GET PATH on the apiserver as admin; prints the body.
api_get() {
  local c="$DIR/certs"
  curl -sS --max-time 5 --cacert "$c/ca.crt" --cert "$c/admin.crt" --key "$c/admin.key" \
    "$APISERVER_URL$1" 2>/dev/null
}

# Succeeds if GET PATH answers 2xx.
api_ok() {
  local c="$DIR/certs"
  curl -sSf -o /dev/null --max-time 5 --cacert "$c/ca.crt" --cert "$c/admin.crt" --key "$c/admin.key" \
    "$APISERVER_URL$1" 2>/dev/null
}

apiserver_ready() { [[ -f "$DIR/certs/admin.key" && "$(api_get /readyz)" == ok ]]; }

etcd_healthy() {
  local out
  out="$(ip netns exec "$NETNS" curl -sS --max-time 3 "$ETCD_URL/health" 2>/dev/null)" || return 1
  [[ "$out" == *'"health":"true"'* ]]
}

kcm_healthy() {
  [[ "$(ip netns exec "$NETNS" curl -sk --max-time 3 "https://127.0.0.1:$KCM_PORT/healthz" 2>/dev/null)" == ok ]]
}

# wait_for WHAT TIMEOUT COMPONENT CMD... : poll CMD, fail early if COMPONENT dies.
wait_for() {
  local what="$1" timeout="$2" comp="$3"; shift 3
  local t0=$SECONDS
  until "$@"; do
    if ! live_pid "$comp" >/dev/null; then
      tail -n 30 "$DIR/logs/$comp.log" >&2 || true
      die "$comp exited while waiting for $what (log: $DIR/logs/$comp.log)"
    fi
    if ((SECONDS - t0 >= timeout)); then
      tail -n 30 "$DIR/logs/$comp.log" >&2 || true
      die "timed out after ${timeout}s waiting for $what (log: $DIR/logs/$comp.log)"
    fi
    sleep 0.5
  done
  log "$what after $((SECONDS - t0)) s"
}

# Everything that `up` starts (the node unless KEYSHIFT_NODE=none) runs and the
# apiserver answers /readyz.
all_up() {
  netns_exists || return 1
  local comp
  for comp in etcd kube-apiserver kube-controller-manager; do
    live_pid "$comp" >/dev/null || return 1
  done
  if [[ "$NODE" == real ]]; then
    for comp in kube-scheduler containerd kubelet; do
      live_pid "$comp" >/dev/null || return 1
    done
    [[ -f "$DIR/env" ]] || return 1
  fi
  apiserver_ready
}

# ---------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------

emit_export() {
  printf 'export KUBECONFIG=%q\n' "$DIR/kubeconfig" >&3
  local image=""
  [[ -f "$DIR/env" ]] && image="$(sed -n 's/^export KEYSHIFT_IMAGE=//p' "$DIR/env")"
  if [[ -n "$image" ]]; then printf 'export KEYSHIFT_IMAGE=%q\n' "$image" >&3; fi
}

# ---------------------------------------------------------------------------------
# the node: kube-scheduler, containerd, kubelet
# ---------------------------------------------------------------------------------

# The value of NAME=VALUE line $1 in the build script output $2.
out_var() { sed -n "s/^$1=//p" <<<"$2"; }

node_ready() {
  local body
  body="$(api_get "/api/v1/nodes/$NODE_NAME")" || return 1
  # The Ready condition's status, whatever the field order.
  python3 -c '
import json, sys
node = json.loads(sys.stdin.read())
ready = [c for c in node.get("status", {}).get("conditions", []) if c.get("type") == "Ready"]
sys.exit(0 if ready and ready[0].get("status") == "True" else 1)' <<<"$body" 2>/dev/null
}

scheduler_healthy() {
  [[ "$(ip netns exec "$NETNS" curl -sk --max-time 3 "https://127.0.0.1:$SCHED_PORT/healthz" 2>/dev/null)" == ok ]]
}

crictl_() { "$CRICTL" --runtime-endpoint "unix://$CONTAINERD_SOCK" "$@"; }

containerd_up() { [[ -S "$CONTAINERD_SOCK" ]] && crictl_ version >/dev/null 2>&1; }

ctr_() { "$CONTAINERD_BIN/ctr" --address "$CONTAINERD_SOCK" -n k8s.io "$@"; }

# Host sysctls the kubelet rewrites: saved once per environment, put back at down.
save_sysctls() {
  [[ -f "$DIR/sysctl.saved" ]] && return 0
  local k
  for k in "${KUBELET_SYSCTLS[@]}"; do
    printf '%s=%s\n' "$k" "$(sysctl -n "$k" 2>/dev/null || echo '')"
  done >"$DIR/sysctl.saved"
}
restore_sysctls() {
  [[ -f "$DIR/sysctl.saved" ]] || return 0
  local line
  while IFS= read -r line; do
    if [[ -n "${line#*=}" ]]; then sysctl -qw "$line" 2>/dev/null || true; fi
  done <"$DIR/sysctl.saved"
}

# The cgroup root of this environment's pods in every cgroup v1 hierarchy (or the v2 tree).
cgroup_dirs() {
  local d
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
    echo "/sys/fs/cgroup$CGROUP_ROOT"
  else
    for d in /sys/fs/cgroup/*/; do
      [[ -f "$d/cgroup.procs" ]] && echo "${d%/}$CGROUP_ROOT"
    done
  fi
  return 0
}

# Kills every process left in this environment's pod cgroups and removes them.
cgroups_down() {
  local d pids
  while read -r d; do
    [[ -d "$d" ]] || continue
    pids="$(find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u | tr '\n' ' ')"
    if [[ -n "${pids// /}" ]]; then
      log "killing processes left in $d: $pids"
      # shellcheck disable=SC2086
      kill -KILL $pids 2>/dev/null || true
      sleep 0.5
    fi
    # Children first.
    find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done < <(cgroup_dirs)
}

# Unmounts everything under $DIR (the kubelet's root dir and pod volumes), deepest first.
unmount_all() {
  local m
  while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done < <(awk -v dir="$DIR/" 'index($2 "/", dir) == 1 { print $2 }' /proc/self/mounts | sort -r)
}

write_node_config() {
  mkdir -p "$DIR"/{containerd,cni/net.d,cni/ipam,kubelet}
  cat >"$DIR/containerd/config.toml" <<EOF
# Written by hack/testenv.sh up
version = 3
root = "$DIR/containerd/root"
state = "$DIR/containerd/state"

[grpc]
  address = "$CONTAINERD_SOCK"

[ttrpc]
  address = "$DIR/containerd/containerd.sock.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "$DIR/containerd/opt"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    # No registry is reachable: the sandbox image is built by hack/build-node.sh.
    sandbox = "$PAUSE_IMAGE"

[plugins."io.containerd.cri.v1.runtime"]
  # This host refuses lowering oom_score_adj; without this runc init fails.
  restrict_oom_score_adj = true
  # Pod network namespaces are mounted under the state dir, not the host's /var/run/netns,
  # so `down` finds (and unmounts) every one of them even if a sandbox was never removed.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "$RUNC"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["$CNI_BIN"]
    conf_dir = "$DIR/cni/net.d"
    max_conf_num = 1
EOF
  cat >"$DIR/cni/net.d/10-keyshift.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "keyshift",
  "plugins": [
    {
      "type": "ptp",
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "dataDir": "$DIR/cni/ipam",
        "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$POD_GATEWAY"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    }
  ]
}
EOF
  cat >"$DIR/kubelet/config.yaml" <<EOF
# Written by hack/testenv.sh up
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This host has cgroup v1, which the kubelet refuses unless told.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: $CGROUP_ROOT
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
address: $NS_IP
port: 10250
readOnlyPort: 0
# Container logs stay in this environment's dir (the default is the host's /var/log/pods).
podLogsDir: $DIR/pod-logs
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
failSwapOn: false
enforceNodeAllocatable: []
localStorageCapacityIsolation: false
# The 200-subtask scenario runs 200 worker pods on this one node.
maxPods: 256
kubeAPIQPS: 100
kubeAPIBurst: 200
serializeImagePulls: false
# Imported images are never garbage-collected (nothing could pull them back).
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "1%"
  imagefs.available: "1%"
  nodefs.inodesFree: "1%"
EOF
}

start_node() {
  [[ "$NODE" == real ]] || return 0
  local out
  out="$("$HACK_DIR/build-node.sh")" || die "hack/build-node.sh failed"
  CONTAINERD_BIN="$(out_var CONTAINERD_BIN "$out")"
  RUNC="$(out_var RUNC "$out")"
  CNI_BIN="$(out_var CNI_BIN "$out")"
  CRICTL="$(out_var CRICTL "$out")"
  PAUSE_TAR="$(out_var PAUSE_TAR "$out")"
  PAUSE_IMAGE="$(out_var PAUSE_IMAGE "$out")"
  out="$("$HACK_DIR/build-image.sh")" || die "hack/build-image.sh failed"
  IMAGE="$(out_var IMAGE "$out")"
  IMAGE_TAR="$(out_var IMAGE_TAR "$out")"
  JOB_IMAGE="$(out_var JOB_IMAGE "$out")"
  JOB_IMAGE_TAR="$(out_var JOB_IMAGE_TAR "$out")"

  # Pod network: the host routes the pod range into the netns, which routes to each pod's veth;
  # the "kubernetes" Service is DNAT-ed to the apiserver (there is no kube-proxy).
  ip route replace "$POD_CIDR" via "$NS_IP" dev "$VETH_HOST"
  ip netns exec "$NETNS" sysctl -qw net.ipv4.ip_forward=1
  ip netns exec "$NETNS" iptables -t nat -C PREROUTING -d "$FIRST_SERVICE_IP" -p tcp --dport 443 \
    -j DNAT --to-destination "$NS_IP:$APISERVER_PORT" 2>/dev/null ||
    ip netns exec "$NETNS" iptables -t nat -A PREROUTING -d "$FIRST_SERVICE_IP" -p tcp --dport 443 \
      -j DNAT --to-destination "$NS_IP:$APISERVER_PORT"

  write_node_config
  # kube-scheduler: the admin kubeconfig (a throwaway cluster), no leader election.
  start kube-scheduler "$K8S_BIN/kube-scheduler" \
    --kubeconfig="$DIR/kubeconfig" --authentication-kubeconfig="$DIR/kubeconfig" \
    --authorization-kubeconfig="$DIR/kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" --leader-elect=false --profiling=false
  wait_for "kube-scheduler /healthz" 60 kube-scheduler scheduler_healthy

  NET_ONLY=1 start containerd env "PATH=$CONTAINERD_BIN:$PATH" \
    "$CONTAINERD_BIN/containerd" --config "$DIR/containerd/config.toml"
  wait_for "containerd (CRI)" 60 containerd containerd_up
  local t0=$SECONDS
  ctr_ images import "$PAUSE_TAR" >/dev/null || die "importing the sandbox image failed"
  ctr_ images import "$IMAGE_TAR" >/dev/null || die "importing $IMAGE failed"
  ctr_ images import "$JOB_IMAGE_TAR" >/dev/null || die "importing $JOB_IMAGE failed"
  log "imported $PAUSE_IMAGE, $IMAGE and $JOB_IMAGE in $((SECONDS - t0)) s"

  save_sysctls
  local d
  while read -r d; do mkdir -p "$d"; done < <(cgroup_dirs)
  NET_ONLY=1 start kubelet "$K8S_BIN/kubelet" \
    --config="$DIR/kubelet/config.yaml" --kubeconfig="$DIR/kubeconfig" \
    --root-dir="$DIR/kubelet" --cert-dir="$DIR/kubelet/pki" \
    --hostname-override="$NODE_NAME" --node-ip="$NS_IP" --v=1
  wait_for "node $NODE_NAME Ready" 90 kubelet node_ready
}

# Removes every pod sandbox through CRI (CNI teardown, network namespaces), then stops the
# node's processes and leaves nothing of it on the host.
stop_node() {
  if [[ -z "${CRICTL:-}" && -f "$DIR/env" ]]; then
    CRICTL="$(sed -n 's/^export KEYSHIFT_CRICTL=//p' "$DIR/env")"
  fi
  stop kubelet
  if live_pid containerd >/dev/null && [[ -n "${CRICTL:-}" && -x "$CRICTL" ]]; then
    log "removing pod sandboxes"
    local t0=$SECONDS
    timeout 180 "$CRICTL" --runtime-endpoint "unix://$CONTAINERD_SOCK" --timeout 30s rmp -fa \
      >"$DIR/logs/crictl-rmp.log" 2>&1 || {
      log "warning: crictl rmp -fa failed:"
      tail -n 5 "$DIR/logs/crictl-rmp.log" >&2 || true
    }
    log "  in $((SECONDS - t0)) s"
  fi
  stop containerd
  cgroups_down
  unmount_all
  restore_sysctls
}

# start_apiserver K8S_BIN : start kube-apiserver with this environment's flags.
start_apiserver() {
  local c="$DIR/certs"
  local APISERVER_ARGS=(
    # What controller-runtime's envtest passes ...
    --etcd-servers="$ETCD_URL"
    --cert-dir="$c"
    --tls-cert-file="$c/apiserver.crt" --tls-private-key-file="$c/apiserver.key"
    --client-ca-file="$c/ca.crt"
    --secure-port="$APISERVER_PORT"
    --service-cluster-ip-range="$SERVICE_CIDR"
    --authorization-mode=RBAC
    --allow-privileged=true
    --service-account-issuer=https://kubernetes.default.svc.cluster.local
    --service-account-key-file="$c/sa.pub"
    --service-account-signing-key-file="$c/sa.key"
    # ... but served on the netns address (a loopback advertise address is
    # refused), without maintaining Endpoints for the "kubernetes" Service.
    --bind-address=0.0.0.0
    --advertise-address="$NS_IP"
    --endpoint-reconciler-type=none
    # Webhooks and aggregated APIs are dialled at their pod IPs (inside the
    # netns), not at ClusterIPs, which nothing implements here.
    --enable-aggregator-routing=true
    # Front-proxy / request-header authentication (see gen_certs).
    --requestheader-client-ca-file="$c/front-proxy-ca.crt"
    --requestheader-allowed-names=front-proxy-client
    --requestheader-username-headers=X-Remote-User
    --requestheader-group-headers=X-Remote-Group
    --requestheader-extra-headers-prefix=X-Remote-Extra-
    --proxy-client-cert-file="$c/front-proxy-client.crt"
    --proxy-client-key-file="$c/front-proxy-client.key"
    # `kubectl logs`/`exec` dial the kubelet at the node's IP (its name does not resolve).
    --kubelet-preferred-address-types=InternalIP
    --profiling=false
  )
  start kube-apiserver "$1/kube-apiserver" "${APISERVER_ARGS[@]}"
}

# Stops kube-apiserver, keeps it down for $1 seconds (default 0), starts it again
# and waits for /readyz: an API server restart as clients see it (refused
# connections, broken watches), for the outage tests. etcd keeps every object.
cmd_restart_apiserver() {
  local down="${1:-0}"
  [[ "$down" =~ ^[0-9]+$ ]] || die "restart-apiserver: seconds down must be a number, got '$down'"
  [[ -f "$DIR/env" ]] || die "no environment at $DIR (run up first)"
  local k8s_bin
  k8s_bin="$(sed -n 's/^export KEYSHIFT_K8S_BIN=//p' "$DIR/env")"
  [[ -x "$k8s_bin/kube-apiserver" ]] || die "no kube-apiserver recorded in $DIR/env"
  stop kube-apiserver
  sleep "$down"
  start_apiserver "$k8s_bin"
  wait_for "kube-apiserver /readyz" "$READY_TIMEOUT" kube-apiserver apiserver_ready
  log "kube-apiserver restarted after ${down}s down"
}

cmd_up() {
  local t0=$SECONDS
  if all_up; then
    log "already up ($APISERVER_URL)"
    emit_export
    return 0
  fi
  check_not_shared
  if [[ -e "$DIR" ]] || netns_exists || ip link show "$VETH_HOST" >/dev/null 2>&1; then
    log "found a partial or dead environment; tearing it down first"
    cmd_down
  fi

  # Binaries (cache hits take well under a second).
  local out k8s_bin etcd_bin helm=""
  out="$("$HACK_DIR/build-control-plane.sh")" || die "hack/build-control-plane.sh failed"
  k8s_bin="$(out_var K8S_BIN "$out")"
  K8S_BIN="$k8s_bin"
  etcd_bin="$(out_var ETCD_BIN "$out")"
  [[ -x "$k8s_bin/kube-apiserver" && -x "$etcd_bin/etcd" ]] || die "build-control-plane.sh gave no binaries"
  # Helm is not needed by the control plane, only by tests; fetch it here so
  # it is cached, but do not fail the environment over it.
  if out="$("$HACK_DIR/get-helm.sh")"; then helm="${out#HELM=}"; else log "warning: get-helm.sh failed; continuing without helm"; fi

  mkdir -p "$DIR"/{pids,logs,etcd}
  touch "$MARKER"
  chmod 700 "$DIR/etcd"
  netns_up
  gen_certs
  write_kubeconfig "$DIR/kubeconfig" admin admin
  write_kubeconfig "$DIR/kube-controller-manager.kubeconfig" system:kube-controller-manager kube-controller-manager
  local c="$DIR/certs"

  local etcd_args=(
    --name=keyshift-testenv
    --data-dir="$DIR/etcd"
    --listen-client-urls="$ETCD_URL" --advertise-client-urls="$ETCD_URL"
    --listen-peer-urls="$ETCD_PEER_URL" --initial-advertise-peer-urls="$ETCD_PEER_URL"
    --initial-cluster="keyshift-testenv=$ETCD_PEER_URL"
    --unsafe-no-fsync=true   # throwaway data: trade durability for test speed
    --log-level=warn
  )
  start etcd "$etcd_bin/etcd" "${etcd_args[@]}"
  wait_for "etcd healthy" 30 etcd etcd_healthy

  start_apiserver "$k8s_bin"
  wait_for "kube-apiserver /readyz" "$READY_TIMEOUT" kube-apiserver apiserver_ready

  local kcm_kubeconfig="$DIR/kube-controller-manager.kubeconfig"
  local kcm_args=(
    --kubeconfig="$kcm_kubeconfig"
    --authentication-kubeconfig="$kcm_kubeconfig"
    --authorization-kubeconfig="$kcm_kubeconfig"
    --bind-address=127.0.0.1 --secure-port="$KCM_PORT"
    --leader-elect=false
    # Each controller runs as its own ServiceAccount, with tokens signed by
    # the key the apiserver verifies with.
    --use-service-account-credentials=true
    --service-account-private-key-file="$c/sa.key"
    --root-ca-file="$c/ca.crt"   # published as kube-root-ca.crt in every namespace
    --cluster-signing-cert-file="$c/ca.crt" --cluster-signing-key-file="$c/ca.key"
    --service-cluster-ip-range="$SERVICE_CIDR"
    --cluster-name=keyshift-testenv
    # All default controllers (service accounts and tokens, garbage
    # collector, namespace, workload controllers, node lifecycle, ...). The
    # cloud and node-IPAM controllers are off by default and need nothing.
    --controllers='*'
    # The default (/usr/libexec/kubernetes/...) would be created on the host.
    --flex-volume-plugin-dir="$DIR/flexvolume"
    --profiling=false
  )
  start kube-controller-manager "$k8s_bin/kube-controller-manager" "${kcm_args[@]}"
  wait_for "kube-controller-manager /healthz" 60 kube-controller-manager kcm_healthy
  # The service-account controller creating "default" in "default" shows the
  # controllers actually run.
  wait_for "default ServiceAccount" 60 kube-controller-manager \
    api_ok /api/v1/namespaces/default/serviceaccounts/default

  start_node

  cat >"$DIR/env" <<EOF
# Written by hack/testenv.sh up
export KUBECONFIG=$DIR/kubeconfig
export KEYSHIFT_TESTENV_DIR=$DIR
export KEYSHIFT_NETNS=$NETNS
export KEYSHIFT_NETNS_IF=$NETNS_IF
export KEYSHIFT_VETH_HOST=$VETH_HOST
export KEYSHIFT_SUBNET=$SUBNET
export KEYSHIFT_HOST_IP=$HOST_IP
export KEYSHIFT_NODE_IP=$NS_IP
export KEYSHIFT_APISERVER=$APISERVER_URL
export KEYSHIFT_SERVICE_CIDR=$SERVICE_CIDR
export KEYSHIFT_K8S_BIN=$k8s_bin
export KEYSHIFT_ETCD_BIN=$etcd_bin
export KEYSHIFT_HELM=$helm
export KEYSHIFT_NODE=$NODE
export KEYSHIFT_NODE_NAME=$NODE_NAME
export KEYSHIFT_POD_CIDR=$POD_CIDR
export KEYSHIFT_CONTAINERD_SOCK=$CONTAINERD_SOCK
export KEYSHIFT_CONTAINERD_BIN=${CONTAINERD_BIN:-}
export KEYSHIFT_CRICTL=${CRICTL:-}
export KEYSHIFT_IMAGE=${IMAGE:-}
export KEYSHIFT_IMAGE_TAR=${IMAGE_TAR:-}
export KEYSHIFT_JOB_IMAGE=${JOB_IMAGE:-}
export KEYSHIFT_JOB_IMAGE_TAR=${JOB_IMAGE_TAR:-}
EOF
  log "up in $((SECONDS - t0)) s: $APISERVER_URL (state: $DIR)"
  emit_export
}

cmd_down() {
  local i
  stop_node
  for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do
    stop "${COMPONENTS[i]}"
  done
  netns_down
  if [[ -d "$DIR" ]]; then
    if [[ -f "$MARKER" ]] || [[ -z "$(ls -A "$DIR")" ]]; then
      log "removing $DIR"
      rm -rf -- "$DIR"
    else
      log "warning: $DIR has no $(basename "$MARKER") marker; not removing it"
    fi
  fi
  log "down"
}

cmd_status() {
  local comp pid rc=0
  if netns_exists; then log "netns $NETNS: present"; else log "netns $NETNS: absent"; rc=1; fi
  for comp in "${COMPONENTS[@]}"; do
    if pid="$(live_pid "$comp")"; then
      log "$comp: running (pid $pid)"
    elif [[ "$NODE" == none && ! -f "$(pidfile "$comp")" ]]; then
      log "$comp: not started (KEYSHIFT_NODE=none)"
    else
      log "$comp: NOT running"; rc=1
    fi
  done
  if apiserver_ready; then
    log "$APISERVER_URL/readyz: ok"
  else
    log "$APISERVER_URL/readyz: not ready"; rc=1
  fi
  if ((rc == 0)); then log "up; KUBECONFIG=$DIR/kubeconfig"; else log "not up"; fi
  return "$rc"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  restart-apiserver) cmd_restart_apiserver "${2:-0}" ;;
  *) echo "usage: $0 up|down|status|restart-apiserver [SECONDS_DOWN]" >&2; exit 2 ;;
esac
