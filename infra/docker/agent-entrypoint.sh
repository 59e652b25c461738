#!/bin/bash
# The agent image's entrypoint:  agent-entrypoint.sh INIT-ARGS… [-- RUN-ARGS…]
#
# INIT-ARGS go to `sparecycles agent init` (at least --broker HOST:PORT; the provider key
# comes from $SPARECYCLES_API_KEY). It rewrites agent.toml in $SPARECYCLES_AGENT_HOME at
# every start (--force), so the container's arguments are its whole configuration; the
# machine's identity key beside it is kept (mount a volume there), so the broker knows the
# machine across restarts. RUN-ARGS go to `sparecycles agent run` (e.g. --devices all
# --metrics-addr 0.0.0.0:9464). `agent run` then replaces this shell, so SIGTERM reaches it
# and drains (running jobs finish, no new ones come).
set -euo pipefail
init=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do init+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
case " ${init[*]:-} " in
  *" --broker "*|*" --broker="*) ;;
  *) echo "agent-entrypoint: give the broker's agent address: --broker HOST:PORT" \
          "(several replicas: HOST:PORT,HOST:PORT)" >&2; exit 2 ;;
esac
if [ -z "${SPARECYCLES_API_KEY:-}" ]; then
  echo "agent-entrypoint: set SPARECYCLES_API_KEY to a provider API key" \
       "(an admin makes one: sparecycles broker create-key --role provider)" >&2
  exit 2
fi
sparecycles agent init --force "${init[@]}"
exec sparecycles agent run "$@"
