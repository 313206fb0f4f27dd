#!/usr/bin/env bash
# ctest entry for the npm client tests: installs the pinned `openai` and
# `@anthropic-ai/sdk` packages (npm ci, from package-lock.json) into a scratch
# copy under the build tree and runs openai_client.mjs and agent_clients.mjs
# (tool calling through both SDKs) against a real `flashmoe serve`.
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
node openai_client.mjs "$bin" "$model"
exec node agent_clients.mjs "$bin" "$model" "$template"
