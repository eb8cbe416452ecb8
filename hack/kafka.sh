#!/usr/bin/env bash
# A real Apache Kafka broker on 127.0.0.1 for the Kafka source/sink tests: Kafka 4.4.0 in KRaft
# mode, one process that is both broker and controller, run straight from its Maven artifacts
# (there is no binary distribution to download here, so no bin/*.sh scripts: we call the main
# classes with `java -cp`).
#
#   hack/kafka.sh fetch                   # resolve the jars once (Maven), cached by version
#   eval "$(hack/kafka.sh start)"         # formats the storage, starts the broker, waits until
#                                         # it serves metadata and transactions, prints the exports
#   cargo test --features kafka --test kafka_local
#   hack/kafka.sh restart                 # stop (SIGTERM, clean shutdown) + start on the same
#                                         # port and log dirs: "a broker restarted mid-run"
#   hack/kafka.sh kill                    # SIGKILL, no clean shutdown (then `start` again)
#   hack/kafka.sh stop
#   hack/kafka.sh env                     # the exports of a running broker
#   hack/kafka.sh tool CLASS ARGS...      # any main class on the broker's class path, e.g.
#                                         # org.apache.kafka.tools.ProducerPerformance
#
# `start` is idempotent: a broker already running from this state dir is reused. A stopped
# broker's data (log dirs) is kept across `stop`/`start` of the same state dir; `stop --wipe`
# removes it.
# Settings (env): KEYSHIFT_KAFKA_STATE (state dir, default ${TMPDIR:-/tmp}/keyshift-kafka),
# KEYSHIFT_KAFKA_PORT (default: a free port; kept across restarts), KEYSHIFT_KAFKA_HOST (address to
# listen on and advertise, default 127.0.0.1), KEYSHIFT_KAFKA_POD_HOST (optional: a second
# listener on all addresses, advertised at this address, for clients in another network namespace
# such as the test cluster's pods; it requires SASL PLAIN, so the credentials path from a Secret
# is exercised; exported as KEYSHIFT_KAFKA_POD_BOOTSTRAP, KEYSHIFT_KAFKA_POD_USERNAME and
# KEYSHIFT_KAFKA_POD_PASSWORD),
# KEYSHIFT_CACHE (cache root, default
# ~/.cache/keyshift), KEYSHIFT_KAFKA_HEAP (default 512m), JAVA (default java), MVN (default mvn).
set -euo pipefail

KAFKA_VERSION="4.4.0"
SCALA_VERSION="2.13"
CACHE="${KEYSHIFT_CACHE:-$HOME/.cache/keyshift}"
JARS="$CACHE/kafka-$KAFKA_VERSION/libs"
state="${KEYSHIFT_KAFKA_STATE:-${TMPDIR:-/tmp}/keyshift-kafka}"
host="${KEYSHIFT_KAFKA_HOST:-127.0.0.1}"
pod_host="${KEYSHIFT_KAFKA_POD_HOST:-}"
java="${JAVA:-java}"
mvn="${MVN:-mvn}"
heap="${KEYSHIFT_KAFKA_HEAP:-512m}"
PIDS=(pid)
# shellcheck source=hack/test-server-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/test-server-lib.sh"

log() { printf 'kafka: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

exports() {
  local port="$1"
  cat <<EOF
export KEYSHIFT_KAFKA_BOOTSTRAP=${host}:${port}
export KEYSHIFT_KAFKA_STATE=${state}
EOF
  if [[ -s "$state/pod-bootstrap" ]]; then
    echo "export KEYSHIFT_KAFKA_POD_BOOTSTRAP=$(cat "$state/pod-bootstrap")"
    echo "export KEYSHIFT_KAFKA_POD_USERNAME=keyshift"
    echo "export KEYSHIFT_KAFKA_POD_PASSWORD=$(cat "$state/pod-password")"
  fi
}

# ---- fetch: the broker's jars, resolved by Maven from a generated pom, cached by version.
fetch() {
  mkdir -p "$CACHE"
  exec 8>"$CACHE/.kafka-$KAFKA_VERSION.lock"
  flock 8
  if [[ -f "$JARS/.complete" ]]; then
    return
  fi
  command -v "$mvn" >/dev/null || die "Maven ($mvn) is needed to fetch Kafka's jars"
  local tmp
  tmp="$(mktemp -d)"
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" RETURN
  # kafka_2.13: the broker (kafka.Kafka) and the storage formatter (kafka.tools.StorageTool);
  # kafka-tools: the admin and perf tools (TopicCommand, ProducerPerformance,
  # ConsumerPerformance) the benchmark and debugging use; slf4j-reload4j: the broker's log output
  # (without a binding it logs nothing).
  cat >"$tmp/pom.xml" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.keyshift.hack</groupId>
  <artifactId>kafka-runtime</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_${SCALA_VERSION}</artifactId>
      <version>${KAFKA_VERSION}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka-tools</artifactId>
      <version>${KAFKA_VERSION}</version>
    </dependency>
    <dependency>
      <groupId>org.slf4j</groupId>
      <artifactId>slf4j-reload4j</artifactId>
      <version>1.7.36</version>
    </dependency>
  </dependencies>
</project>
EOF
  log "resolving org.apache.kafka:kafka_${SCALA_VERSION}:${KAFKA_VERSION} and its dependencies with Maven"
  "$mvn" -q -B -f "$tmp/pom.xml" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$tmp/libs" >&2 \
    || die "mvn dependency:copy-dependencies failed"
  ls "$tmp/libs"/kafka_${SCALA_VERSION}-${KAFKA_VERSION}.jar >/dev/null 2>&1 \
    || die "the resolved jars lack kafka_${SCALA_VERSION}-${KAFKA_VERSION}.jar"
  rm -rf "$JARS"
  mkdir -p "$(dirname "$JARS")"
  mv "$tmp/libs" "$JARS"
  touch "$JARS/.complete"
  log "cached $(find "$JARS" -name '*.jar' | wc -l) jars in $JARS"
}

classpath() { printf '%s/*' "$JARS"; }


# Writes server.properties for the ports (client port, controller port, pod listener port or
# empty).
write_config() {
  local port="$1" cport="$2" pport="${3:-}"
  local listeners="PLAINTEXT://${host}:${port},CONTROLLER://${host}:${cport}"
  local advertised="PLAINTEXT://${host}:${port}"
  local pods_sasl=""
  if [[ -n "$pport" ]]; then
    # The pods' listener: every address, advertised at the host's address in their network;
    # SASL PLAIN with one user, whose password is made once per state dir.
    listeners+=",PODS://0.0.0.0:${pport}"
    advertised+=",PODS://${pod_host}:${pport}"
    [[ -s "$state/pod-password" ]] || od -An -tx1 -N12 /dev/urandom | tr -d ' \n' >"$state/pod-password"
    local pw
    pw="$(cat "$state/pod-password")"
    pods_sasl="listener.name.pods.sasl.enabled.mechanisms=PLAIN
listener.name.pods.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_keyshift=\"${pw}\";"
  fi
  cat >"$state/server.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=${host}:${cport}
listeners=${listeners}
advertised.listeners=${advertised}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,PODS:SASL_PLAINTEXT
${pods_sasl}
log.dirs=${state}/data
num.partitions=1
default.replication.factor=1
min.insync.replicas=1
# One node: the internal topics must have one replica, or transactions and consumer groups never
# become available.
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
# Tests abort transactions of killed writers by fencing; a lost writer's open transaction is
# aborted by the coordinator after this long (the client's transaction.timeout.ms may not exceed
# it).
transaction.max.timeout.ms=900000
auto.create.topics.enable=false
delete.topic.enable=true
log.segment.bytes=16777216
log.retention.check.interval.ms=300000
# Flush nothing synchronously beyond Kafka's defaults: a clean stop (SIGTERM) writes everything,
# and tests restart it cleanly.
EOF
}

wait_ready() {
  local port="$1" deadline=$((SECONDS + 120))
  # Ready = the admin client lists topics (metadata served by the broker and its controller).
  until "$java" -Xmx128m -cp "$(classpath)" -Dlog4j.configuration=file:"$state/log4j-tools.properties" -Dlog4j2.configurationFile="$state/log4j2.properties" \
      org.apache.kafka.tools.TopicCommand --bootstrap-server "${host}:${port}" --list \
      >/dev/null 2>&1; do
    if ! running; then
      log "broker exited; log follows"
      tail -n 60 "$state/server.log" >&2
      exit 1
    fi
    if ((SECONDS > deadline)); then
      log "broker did not answer on ${host}:${port} within 120 s; log in $state/server.log"
      stop
      exit 1
    fi
    sleep 0.5
  done
}

write_log4j() {
  cat >"$state/log4j.properties" <<EOF
log4j.rootLogger=INFO, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.request.logger=WARN
log4j.logger.org.apache.kafka.controller=INFO
log4j.logger.kafka.log.LogCleaner=WARN
log4j.logger.state.change.logger=WARN
EOF
  # Kafka's own log4j2 calls (its log level controller): a console config, so it does not
  # complain of having none.
  cat >"$state/log4j2.properties" <<EOF
rootLogger.level=WARN
rootLogger.appenderRef.stderr.ref=STDERR
appender.stderr.type=Console
appender.stderr.name=STDERR
appender.stderr.target=SYSTEM_ERR
appender.stderr.layout.type=PatternLayout
appender.stderr.layout.pattern=[%d] %p %m (%c)%n
EOF
  cat >"$state/log4j-tools.properties" <<EOF
log4j.rootLogger=ERROR, stderr
log4j.appender.stderr=org.apache.log4j.ConsoleAppender
log4j.appender.stderr.Target=System.err
log4j.appender.stderr.layout=org.apache.log4j.PatternLayout
log4j.appender.stderr.layout.ConversionPattern=[%d] %p %m (%c)%n
EOF
}

start() {
  mkdir -p "$state"
  if running; then
    log "already running (pid $(cat "$state/pid"), port $(cat "$state/port"))"
    exports "$(cat "$state/port")"
    return
  fi
  command -v "$java" >/dev/null || die "Java 17+ ($java) is needed for the broker"
  ( fetch )
  local port cport pport=""
  # A restarted broker keeps its ports: clients reconnect to the same bootstrap address.
  if [[ -f "$state/ports" ]]; then
    read -r port cport pport <"$state/ports"
    # The pods' listener keeps its advertised address across restarts too.
    if [[ -n "$pport" && -s "$state/pod-bootstrap" ]]; then
      pod_host="$(cut -d: -f1 "$state/pod-bootstrap")"
    fi
  else
    port="${KEYSHIFT_KAFKA_PORT:-$(free_port "$host")}"
    cport="$(free_port "$host")"
    while [[ "$cport" == "$port" ]]; do cport="$(free_port "$host")"; done
    if [[ -n "$pod_host" ]]; then
      pport="$(free_port "$host")"
      while [[ "$pport" == "$port" || "$pport" == "$cport" ]]; do pport="$(free_port "$host")"; done
      echo "${pod_host}:${pport}" >"$state/pod-bootstrap"
    fi
    echo "$port $cport $pport" >"$state/ports"
  fi
  write_config "$port" "$cport" "$pport"
  write_log4j
  if [[ ! -f "$state/data/meta.properties" ]]; then
    local cluster_id
    cluster_id="$("$java" -cp "$(classpath)" -Dlog4j.configuration=file:"$state/log4j-tools.properties" -Dlog4j2.configurationFile="$state/log4j2.properties" \
      kafka.tools.StorageTool random-uuid)"
    "$java" -cp "$(classpath)" -Dlog4j.configuration=file:"$state/log4j-tools.properties" -Dlog4j2.configurationFile="$state/log4j2.properties" \
      kafka.tools.StorageTool format --standalone -t "$cluster_id" \
      -c "$state/server.properties" >"$state/format.log" 2>&1 \
      || { cat "$state/format.log" >&2; die "formatting the storage in $state/data failed"; }
  fi
  # setsid: its own session, so the caller's job control or Ctrl-C does not take it down.
  setsid "$java" -Xms"$heap" -Xmx"$heap" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -Djava.awt.headless=true -Dlog4j.configuration=file:"$state/log4j.properties" \
    -Dlog4j2.configurationFile="$state/log4j2.properties" \
    -cp "$(classpath)" kafka.Kafka "$state/server.properties" \
    >>"$state/server.log" 2>&1 </dev/null &
  echo $! >"$state/pid"
  echo "$port" >"$state/port"
  wait_ready "$port"
  log "Kafka $KAFKA_VERSION (KRaft, one node) on ${host}:${port} (pid $(cat "$state/pid")), data in $state/data"
  exports "$port"
}

# stop_kafka [--wipe]: SIGTERM (a clean shutdown, which may take a few seconds; KILL after 30 s),
# and with --wipe its data too.
stop_kafka() {
  stop_with TERM 30
  if [[ "${1:-}" == "--wipe" ]]; then
    rm -rf -- "$state/data" "$state/ports"
  fi
}

case "${1:-}" in
  fetch) ( fetch ); log "jars in $JARS" ;;
  start) start ;;
  stop) shift; stop_kafka "$@" ;;
  kill) stop_with KILL 30 ;;
  restart)
    stop_with TERM 30
    start
    ;;
  env)
    running || { log "not running"; exit 1; }
    exports "$(cat "$state/port")"
    ;;
  tool)
    shift
    [[ $# -ge 1 ]] || die "usage: $0 tool CLASS ARGS..."
    ( fetch )
    mkdir -p "$state"
    write_log4j
    cls="$1"
    shift
    exec "$java" -cp "$(classpath)" -Dlog4j.configuration=file:"$state/log4j-tools.properties" -Dlog4j2.configurationFile="$state/log4j2.properties" "$cls" "$@"
    ;;
  *)
    echo "usage: $0 fetch|start|stop [--wipe]|kill|restart|env|tool CLASS ARGS..." >&2
    exit 2
    ;;
esac
