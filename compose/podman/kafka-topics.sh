#!/bin/bash
# The compose healthcheck's command: the embedded stack has no kafka-tools jar, so this only
# checks that the broker's listener (--bootstrap-server HOST:PORT) accepts a connection.
set -euo pipefail
server=localhost:9092
while [ $# -gt 0 ]; do
  case $1 in --bootstrap-server) server=$2; shift ;; esac
  shift
done
exec 3<>"/dev/tcp/${server%:*}/${server##*:}"
