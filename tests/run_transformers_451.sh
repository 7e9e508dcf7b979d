#!/usr/bin/env bash
# The lossless tests again on transformers 4.51.3, the release CosyVoice 2/3 pin (OuteTTS pins 4.52.3):
# echospec must install and decode exactly beside them as well as on the current release. A second venv,
# .venv-tf451 in the repository root, made once and reused; the slow end-to-end tests stay with the main run.
#     bash tests/run_transformers_451.sh [pytest options]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-tf451
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q torch==2.13.0  # the CPU wheel: a bare `torch` pulls a multi-GB CUDA build
fi
# every run, so a dependency added since the venv was made is there too (seconds when nothing is missing)
"$venv/bin/python" -m pip install -q -e '.[decoder]' 'transformers==4.51.3' 'pytest>=8' 'pytest-timeout>=2.3' 'ftfy>=6'
"$venv/bin/python" -c "import transformers; assert transformers.__version__ == '4.51.3', transformers.__version__"
exec "$venv/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider \
    tests/decoder/test_decoder_greedy.py tests/decoder/test_decoder_sampling.py tests/decoder/test_attach.py \
    tests/decoder/test_presets.py tests/datastore/test_codebooks.py "$@"
