"""`echospec bench` on any Hugging Face checkpoint (the build's --speech-offset/--vocab-size/--stop-id, prompts as
input_ids or as embeddings files), and through the Python API on a model with its own head (CosyVoice)."""

import json

import numpy as np
import pytest
import replicas
import torch
from click.testing import CliRunner

from echospec.datastore import build
from echospec.decoder import NODES, presets
from echospec.tools.bench import BenchSpec, Inputs, bench
from echospec.tools.cli import main


def corpus_store(tmp_path, corpus, preset):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": f"u{i}", "tokens": u}) + "\n" for i, u in enumerate(corpus)))
    build(path, tmp_path / "store", per_speaker=False, faiss=False, progress=False, **preset.build_options())
    return tmp_path / "store"


def lossless(systems, *names):
    for name in names:
        assert systems[name]["identical_to_baseline"] == 1.0, name
        assert systems[name]["tokens_per_forward"] > 1.2, (name, systems[name]["tokens_per_forward"])


@pytest.fixture(scope="module")
def llasa_checkpoint(tmp_path_factory):
    """A LLaSA replica saved as a plain Hugging Face checkpoint, its store built with the build's options."""
    folder = tmp_path_factory.mktemp("llasa")
    replica = replicas.llasa()
    replica.model.save_pretrained(folder / "ckpt")
    store = corpus_store(folder, replica.corpus, presets.LLASA)
    prompt = presets.LLASA.prompt(replica.tokenizer, "the cat sat")["input_ids"]
    return folder, store, replica, [prompt + u[:4] for u in replica.heldout[:2]]


def test_bench_runs_any_hugging_face_checkpoint(llasa_checkpoint):
    folder, store, _, prompts = llasa_checkpoint
    (folder / "ids.jsonl").write_text("".join(json.dumps({"id": i, "input_ids": p}) + "\n" for i, p in enumerate(prompts)))
    out = folder / "out-ids"
    result = CliRunner().invoke(main, [
        "bench", str(folder / "ckpt"), "--store", str(store), "--prompts", str(folder / "ids.jsonl"),
        "--speech-offset", "128264", "--vocab-size", "65536", "--stop-id", "128261", "--token-rate", "50",
        "--policy", "exact-greedy", "--stores", "general", "--max-new-tokens", "30", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    assert set(report["systems"]) == {"autoregressive", "hf-prompt-lookup", "exact-greedy/general"}
    lossless(report["systems"], "exact-greedy/general")
    assert report["setup"]["speech"] == {"offset": 128264, "size": 65536, "stop_ids": [128261], "codebooks": 1}
    assert report["setup"]["max_nodes"] == NODES  # the command's default budget is generate's


def test_bench_samples_with_a_presets_sampler_and_says_which(llasa_checkpoint):
    folder, store, _, prompts = llasa_checkpoint
    (folder / "ids1.jsonl").write_text(json.dumps({"id": 0, "input_ids": prompts[0]}) + "\n")
    out = folder / "out-sampler"
    command = ["bench", str(folder / "ckpt"), "--store", str(store), "--prompts", str(folder / "ids1.jsonl"),
               "--policy", "exact-sampling", "--stores", "general", "--max-new-tokens", "30", "--out", str(out)]
    result = CliRunner().invoke(main, [*command, "--sampler", "llasa"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    assert report["setup"]["sampler"] == {"preset": "llasa", "rule": repr(presets.LLASA.sampler)}
    assert report["systems"]["exact-sampling/general"]["identical_to_baseline"] == 1.0  # against ar-sampling
    result = CliRunner().invoke(main, [*command, "--sampler", "nope"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "no preset sampler 'nope'; choose one of ras, cosyvoice" in result.output
    help_text = " ".join(CliRunner().invoke(main, ["bench", "--help"]).output.split())
    assert all(name in help_text for name in presets.SAMPLERS)  # the help lists every preset's sampler


def test_bench_takes_embeddings_prompts_from_files(llasa_checkpoint):
    folder, store, replica, prompts = llasa_checkpoint
    lines = []
    for i, ids in enumerate(prompts):
        embeds = replica.model.get_input_embeddings()(torch.tensor(ids)).detach()
        np.save(folder / f"p{i}.npy", embeds.numpy())
        speech = presets.LLASA.speech.to_local(ids)
        lines.append(json.dumps({"id": i, "inputs_embeds": f"p{i}.npy", "prompt_speech": speech}) + "\n")
    (folder / "embeds.jsonl").write_text("".join(lines))
    out = folder / "out-embeds"
    result = CliRunner().invoke(main, [
        "bench", str(folder / "ckpt"), "--store", str(store), "--prompts", str(folder / "embeds.jsonl"),
        "--policy", "exact-greedy", "--stores", "general", "--max-new-tokens", "30", "--out", str(out)])
    assert result.exit_code == 0, result.output
    systems = json.loads((out / "bench.json").read_text())["systems"]
    # Hugging Face generate cannot take these prompts' retrieval context: echospec's own loop is the baseline
    assert set(systems) == {"autoregressive", "exact-greedy/general"}
    lossless(systems, "exact-greedy/general")
    bad = folder / "bad.jsonl"
    bad.write_text(json.dumps({"inputs_embeds": "missing.npy"}) + "\n")
    result = CliRunner().invoke(main, ["bench", str(folder / "ckpt"), "--store", str(store), "--prompts", str(bad),
                                       "--out", str(folder / "o")])
    assert result.exit_code == 1 and "bad.jsonl:1" in result.output and "Traceback" not in result.output


def test_bench_python_api_with_a_head_and_embeddings(tmp_path):
    replica = replicas.cosyvoice(2)
    llm, preset = replica.llm, presets.COSYVOICE2
    store = corpus_store(tmp_path, replica.corpus, preset)
    made = [preset.prompt(llm, [11, 12, 13, 14], [], u[:8]) for u in replica.heldout[:3]]
    torch.save(made[0]["inputs_embeds"], tmp_path / "p0.pt")
    prompts = [{"id": "file", "inputs_embeds": str(tmp_path / "p0.pt"), "prompt_speech": made[0]["prompt_speech"]},
               {"id": "callable", "inputs_embeds": lambda: made[1]["inputs_embeds"],
                "prompt_speech": made[1]["prompt_speech"]},
               {"id": "tensor", **made[2]}]
    inputs = Inputs(llm.llm.model, store, prompts, speech=preset.speech, head=llm.llm_decoder,
                    speech_embedding=llm.speech_embedding, token_rate=preset.token_rate)
    report = bench(BenchSpec(inputs, policies=("exact-greedy", "exact-sampling"), stores=("general",),
                             sampler=preset.sampler, max_new_tokens=30, progress=False))
    systems = report["systems"]
    assert set(systems) == {"autoregressive", "ar-sampling", "exact-greedy/general", "exact-sampling/general"}
    lossless(systems, "exact-greedy/general", "exact-sampling/general")
    assert all(np.isfinite(s["log_likelihood"]["mean"]) for s in systems.values())
    assert report["setup"]["sampler"] == {"preset": None, "rule": repr(preset.sampler)}
