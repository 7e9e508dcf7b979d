#!/usr/bin/env bash
# The lossless tests again on transformers 4.51.3, the release CosyVoice 2/3 pin (OuteTTS pins 4.52.3):
# echospec must install and decode exactly beside them as well as on the current release, and load the shipped
# sample checkpoint through the decoder's compatibility layer and decode it (test_sample_model). A second venv,
# .venv-tf451 in the repository root, made once and reused; the slow end-to-end tests stay with the main run.
#     bash tests/run_transformers_451.sh [pytest options]
set -euo pipefail
source "$(dirname "$0")/venv.sh"
venv=.venv-tf451
make_venv "$venv"
update_venv "$venv" decoder 'transformers==4.51.3' 'ftfy>=6' 'espeakng-loader>=0.2'  # the sample's phoneme front end
"$venv/bin/python" -c "import transformers; assert transformers.__version__ == '4.51.3', transformers.__version__"
exec "$venv/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider \
    tests/decoder/test_decoder_greedy.py tests/decoder/test_decoder_sampling.py tests/decoder/test_attach.py \
    tests/decoder/test_presets.py tests/decoder/test_sample_model.py tests/datastore/test_codebooks.py "$@"
