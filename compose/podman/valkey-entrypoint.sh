#!/bin/bash
# As valkey/valkey's entrypoint: a server started without a config file takes connections
# from other containers (protected mode would refuse all but loopback).
set -euo pipefail
if [ "${1:-}" = "valkey-server" ]; then
  shift
  exec valkey-server --protected-mode no "$@"
fi
exec "$@"
