# The set-up the second-environment scripts share (run_transformers_451.sh, run_vllm.sh), sourced by both: each
# runs echospec's tests in a venv of its own in the repository root, made once and reused.
#     make_venv DIR                        DIR, with the CPU torch, if it is not there yet; venv_is_new says whether
#     update_venv DIR EXTRAS [REQ ...]     echospec's EXTRAS (editable), pytest and REQ, on every run, so a
#                                          dependency added since the venv was made is there too (seconds when
#                                          nothing is missing)
cd "$(dirname "${BASH_SOURCE[0]}")/.."

make_venv() {
    venv_is_new=false
    if [ ! -x "$1/bin/python" ]; then
        python3 -m venv "$1"
        "$1/bin/python" -m pip install -q torch==2.13.0  # the CPU wheel: a bare `torch` pulls a multi-GB CUDA build
        venv_is_new=true
    fi
}

update_venv() {
    local venv=$1 extras=$2
    shift 2
    "$venv/bin/python" -m pip install -q -e ".[$extras]" 'pytest>=8' 'pytest-timeout>=2.3' "$@"
}
