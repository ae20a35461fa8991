#!/bin/bash
# apache/kafka's convention: each KAFKA_FOO_BAR variable is the broker property foo.bar; the
# log directory is formatted on first start.
set -euo pipefail
conf=/tmp/server.properties
: > "$conf"
for var in $(compgen -e | grep '^KAFKA_' || true); do
  case $var in KAFKA_HEAP_OPTS|KAFKA_OPTS|KAFKA_CLUSTER_ID) continue ;; esac
  echo "$(echo "${var#KAFKA_}" | tr 'A-Z_' 'a-z.')=${!var}" >> "$conf"
done
dir=$(sed -n 's/^log\.dirs=//p' "$conf")
dir=${dir:-/var/lib/kafka/data}
if [ ! -f "$dir/meta.properties" ]; then
  java -Xmx256m -cp '/opt/kafka/libs/*' kafka.tools.StorageTool format \
    -t "${KAFKA_CLUSTER_ID:-5L6g3nShT-eMCtK--X86sw}" -c "$conf"
fi
exec java ${KAFKA_HEAP_OPTS:--Xms64m -Xmx512m} -XX:+ExitOnOutOfMemoryError \
  -cp '/opt/kafka/libs/*' kafka.Kafka "$conf"
