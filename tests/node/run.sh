#!/usr/bin/env bash
# ctest entry for the npm client tests: installs the pinned `openai` and
# `@anthropic-ai/sdk` packages (npm ci, from package-lock.json) into a scratch
# copy under the build tree and runs openai_client.mjs and agent_clients.mjs
# (tool calling through both SDKs) against a real `flashmoe serve`; under
# FLASHMOE_SANITIZER, agent_clients.mjs only.
# Usage: run.sh FLASHMOE_BINARY MODEL_DIR WORK_DIR. Exits 77 (ctest: skipped)
# only when node is not installed.
set -euo pipefail
bin=$1 model=$2 work=$3
if ! command -v node >/dev/null 2>&1; then
  echo "node is not installed: skipping the openai client test"
  exit 77
fi
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"
cp "$here/package.json" "$here/package-lock.json" "$here/serve.mjs" "$here/openai_client.mjs" "$here/agent_clients.mjs" "$work/"
template="$here/../fixtures/tokenizers/qwen3/tokenizer_config.json"
cd "$work"
npm ci --no-audit --no-fund --loglevel=error
# Under the sanitizers (make test-asan) only the tool-calling round trips:
# the plain chat and completion requests of openai_client.mjs take the
# server paths ServerE2E.* already run there, and the SDKs' side is the
# same as in the Release run.
if [ -z "${FLASHMOE_SANITIZER:-}" ]; then
  node openai_client.mjs "$bin" "$model"
fi
exec node agent_clients.mjs "$bin" "$model" "$template"
