"""tools/ as a whole: importing it changes nothing, and each command names the extra it is missing.

A missing extra is simulated by `sys.modules[name] = None` in a fresh interpreter, which makes
`import name` fail as it does where the package is not installed.
"""

import json
import subprocess
import sys

import pytest

from echospec.tools.corpus import SAMPLE_MODEL_DIR, SAMPLE_PROMPTS


def run_echospec(commands, missing=(), cwd=None):
    """Run `echospec` on each argument list in `commands`, in one fresh interpreter where the `missing`
    modules cannot be imported; stops at the first command that exits with an error."""
    code = ("import sys\n"
            f"for name in {list(missing)!r}: sys.modules[name] = None\n"
            "from echospec.tools.cli import main\n"
            f"for args in {[[str(a) for a in c] for c in commands]!r}:\n"
            "    try:\n"
            "        main(args, prog_name='echospec')\n"
            "    except SystemExit as e:\n"
            "        if e.code: raise\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.slow  # imports torch, transformers, matplotlib and the web framework in a fresh interpreter
def test_importing_any_tools_module_leaves_the_environment_alone():
    # transformers sets TORCHINDUCTOR_CACHE_DIR when its Llama model is imported: theirs, not ours, so first
    code = """
import importlib, json, os, pkgutil
from transformers import LlamaForCausalLM
import echospec.tools
changed = {}
for module in pkgutil.walk_packages(echospec.tools.__path__, "echospec.tools."):
    before = dict(os.environ)
    importlib.import_module(module.name)
    if dict(os.environ) != before:
        changed[module.name] = sorted(set(os.environ.items()) ^ set(before.items()))
print(json.dumps({"changed": changed, "modules": sorted(m for m in __import__("sys").modules if m.startswith("echospec.tools."))}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(done.stdout)
    assert report["changed"] == {}
    assert {"echospec.tools.benchmarks.bench_retriever", "echospec.tools.benchmarks.bench_service",
            "echospec.tools.cli.store", "echospec.tools.corpus.train_model"} <= set(report["modules"])


@pytest.mark.parametrize("args, missing, extra", [
    (["bench", SAMPLE_MODEL_DIR, "--store", ".", "--prompts", SAMPLE_PROMPTS], ["torch"], "bench"),
    (["demo"], ["matplotlib"], "bench"),
    (["train-model", ".", "model-out"], ["transformers"], "decoder"),
    (["serve", "store"], ["fastapi"], "service"),
])
def test_a_command_names_the_extra_it_needs(args, missing, extra, tmp_path):
    done = run_echospec([args], missing, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    command = args[0]
    assert done.stderr.strip() == (f"Error: echospec {command} needs the {extra} extra ({missing[0]} is not "
                                   f"installed): pip install -e '.[{extra}]' in a checkout")
    assert list(tmp_path.iterdir()) == []  # refused before doing anything


def test_store_commands_need_only_the_core_install(tmp_path):
    web_and_models = ["torch", "transformers", "fastapi", "uvicorn", "starlette", "prometheus_client", "matplotlib"]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"u{i}", "speaker": "ann", "tokens": [1, 2, 3, 4, i]}) + "\n"
                              for i in range(20)))
    done = run_echospec([["build", corpus, tmp_path / "store", "--quiet"],
                         ["query", tmp_path / "store", "--context", "1 2 3", "--json"]], web_and_models)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["tree"]["tokens"][0] == 4  # what followed 1 2 3 every time


def _options():
    """(command, option) for every option of every `echospec` command, and of `echospec` itself."""
    import click

    from echospec.tools.cli import main

    commands = [("echospec", main)] + [(name, command) for name, command in main.commands.items()]
    return [(name, param) for name, command in commands for param in command.params if isinstance(param, click.Option)]


def test_every_option_says_what_it_does_and_shows_its_default_one_way():
    import re

    assert len(_options()) > 60
    assert [f"{name} {option.opts[0]}" for name, option in _options() if not (option.help or "").strip()] == []
    # a default is click's [default: ...] (show_default), never written into the help as "default: x" or "[x]"
    assert [f"{name} {option.opts[0]}: {option.help}" for name, option in _options()
            if re.search(r"\bdefault: |\[[^\]]*\]\.?$", option.help)] == []


def test_node_and_depth_budgets_are_spelled_one_way():
    from click.testing import CliRunner

    from echospec.tools.cli import main

    spelled = {name: {o for _, option in _options() for o in option.opts if _ == name} for name in main.commands}
    for command in ("bench", "query", "serve"):
        assert {"--max-nodes", "--max-depth"} <= spelled[command], command
    # bench's earlier spellings still work, and --help shows only the one name
    assert {"--nodes", "--depth"} <= spelled["bench"]
    shown = CliRunner().invoke(main, ["bench", "--help"]).output
    assert "--max-nodes" in shown and "--nodes" not in shown.replace("--max-nodes", "").replace("--sweep-nodes", "")
    # bench's budget is generate's default (bench() resolves None to it), and its help shows that number
    from echospec.decoder import NODES

    [nodes] = [option for name, option in _options() if name == "bench" and "--max-nodes" in option.opts]
    assert nodes.show_default.startswith(f"{NODES}, ")
