"""ExactGreedy is token for token Hugging Face greedy decoding; the compacted cache is the full forward's."""

import os

import pytest
import torch
from decoder_testing import PromptLookup, Scripted, tiny_model

from echospec.decoder import ExactGreedy, SpeculativeSession, SpeechVocab, compat, generate
from echospec.retriever import CandidateTree

VOCAB = 64
needs_gqa_switch = pytest.mark.skipif(not compat.sdpa_reads_gqa_switch(),
                                      reason="this transformers (4.51) copies grouped heads whatever the switch says")
CASES = [(f, a, p) for f in ("llama", "qwen2") for a in ("sdpa", "eager") for p in ("ids", "embeds")]


def hf_greedy(model, ids, prompt, max_new, min_new=0, eos=None):
    # an explicit all-ones mask: otherwise HF would mask prompt tokens equal to the pad id
    kwargs = dict(do_sample=False, max_new_tokens=max_new, min_new_tokens=min_new, eos_token_id=eos, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    if prompt == "ids":
        return model.generate(ids, **kwargs)[0, ids.shape[1]:].tolist()
    return model.generate(inputs_embeds=model.get_input_embeddings()(ids), **kwargs)[0].tolist()


def ours(model, ids, prompt, retriever, max_new, min_new=0, eos=None, max_nodes=16):
    speech = SpeechVocab(0, VOCAB, () if eos is None else (eos,))
    prompt_kw = {"input_ids": ids} if prompt == "ids" else {"inputs_embeds": model.get_input_embeddings()(ids)}
    return generate(model, retriever, policy=ExactGreedy(), speech=speech, max_new_tokens=max_new,
                    min_new_tokens=min_new, max_nodes=max_nodes, **prompt_kw)


@pytest.mark.parametrize("family,attn,prompt", CASES)
def test_exact_greedy_equals_hf_generate(family, attn, prompt):
    model = tiny_model(family, attn, VOCAB, seed=1)
    gen = torch.Generator().manual_seed(7)
    forwards = tokens = 0
    for trial in range(4):
        ids = torch.randint(0, VOCAB, (1, 6 + 3 * trial), generator=gen)
        reference = hf_greedy(model, ids, prompt, 40)
        skip = ids.shape[1] if prompt == "ids" else 0
        retrievers = [None, PromptLookup(), Scripted(reference, skip, VOCAB, seed=trial),
                      Scripted(reference, skip, VOCAB, seed=trial, right=False)]
        for retriever in retrievers:
            result = ours(model, ids, prompt, retriever, 40)
            assert result.tokens == reference, (trial, type(retriever).__name__)
            forwards += result.stats.target_forwards
            tokens += len(result.tokens)
        # a stop token inside the trees, with and without a minimum length; a length limit inside a tree
        stop = reference[9]
        for min_new in (0, 12):
            expected = hf_greedy(model, ids, prompt, 40, min_new, eos=stop)
            scripted = Scripted(expected, skip, VOCAB, depth=8, seed=trial)
            assert ours(model, ids, prompt, scripted, 40, min_new, eos=stop).tokens == expected
        for limit in (1, 3, 7):
            scripted = Scripted(reference, skip, VOCAB, depth=8, seed=trial)
            assert ours(model, ids, prompt, scripted, limit).tokens == reference[:limit]
    assert tokens / forwards > 1.5  # the trees were used, not just survived


@pytest.mark.parametrize("family,attn", [(f, a) for f in ("llama", "qwen2") for a in ("sdpa", "eager")])
@pytest.mark.parametrize("speech_table", [False, True])
def test_compacted_cache_matches_full_forward(family, attn, speech_table):
    """After gathers and crops, the next-token logits equal a fresh forward over the accepted sequence."""
    model = tiny_model(family, attn, VOCAB, seed=2)
    table = torch.nn.Embedding(VOCAB, 32) if speech_table else None
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    reference = ours(model, ids, "ids", None, 30).tokens if table is None else None
    retriever = Scripted(reference, 9, VOCAB, seed=5) if reference else PromptLookup()
    prompt_embeds = model.get_input_embeddings()(ids)
    session = SpeculativeSession(model, retriever, ExactGreedy(), speech=SpeechVocab(0, VOCAB), speech_embedding=table,
                                 max_new_tokens=30)
    session.prefill(inputs_embeds=prompt_embeds) if table is not None else session.prefill(input_ids=ids)
    reordered = 0
    while not session.finished:
        tree = session.propose()
        verified = session.verify(tree)
        path, bonus = session.accept(verified)
        reordered += path != list(range(len(path)))
        emitted = session.emit([verified.tokens[i] for i in path] + [bonus])  # public calls only: a custom loop
        session.compact(len(tree), path[: len(emitted) - 1])
    assert session.cached == ids.shape[1] + len(session.generated) - 1  # all but the pending token
    with torch.no_grad():
        last = session.verify(CandidateTree.empty()).logits[0]
        generated = torch.tensor(session.generated)
        if table is None:
            full = model(torch.cat([ids[0], generated])[None]).logits[0, -1]
        else:
            full = model(inputs_embeds=torch.cat([prompt_embeds[0], table(generated)])[None]).logits[0, -1]
    assert float((last - full).abs().max()) <= 1e-4
    if table is None:
        assert reordered > 0  # gathers out of order happened


def test_cosyvoice_style_speech_table_and_offset():
    """Speech ids at an offset, embedded by a separate table; output equals plain greedy decoding with it."""
    model = tiny_model("qwen2", "sdpa", VOCAB, seed=4)
    table = torch.nn.Embedding(VOCAB, 32)
    speech = SpeechVocab(offset=4, size=60, stop_ids=(63,))
    embeds = model.get_input_embeddings()(torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1)))
    plain = generate(model, None, inputs_embeds=embeds, speech=speech, speech_embedding=table, max_new_tokens=30)
    assert plain.speech_tokens == [t - 4 for t in plain.tokens if 4 <= t < 64]
    scripted = Scripted(plain.speech_tokens, 0, speech.size, seed=2)
    trees = generate(model, scripted, inputs_embeds=embeds, speech=speech, speech_embedding=table, max_new_tokens=30)
    assert trees.tokens == plain.tokens
    assert all(speech.is_speech(t) for t in plain.tokens) and trees.stats.tokens_per_forward > 1.5


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bfloat16_model_decodes_with_trees(attn):
    # bfloat16 end to end: the tree mask in the model's dtype (its minimum, not -inf), embeddings cast;
    # peaked distributions leave no near-tie for bfloat16 rounding to flip, so the output is greedy's
    model = tiny_model("qwen2", attn, VOCAB, seed=3, sharpen=8.0).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    for trial in range(3):
        ids = torch.randint(0, VOCAB, (1, 8), generator=gen)
        reference = hf_greedy(model, ids, "ids", 30)
        scripted = Scripted(reference, ids.shape[1], VOCAB, seed=trial)
        result = ours(model, ids, "ids", scripted, 30, max_nodes=8)
        assert result.tokens == reference and result.stats.tokens_per_forward > 1.5
    session = SpeculativeSession(model, None, ExactGreedy(), speech=SpeechVocab(0, VOCAB), max_new_tokens=4)
    session.prefill(input_ids=ids)
    mask = session._tree_mask(CandidateTree.from_sequences([[1, 2], [3]]))
    assert mask.dtype == torch.bfloat16 and float(mask.min()) == torch.finfo(torch.bfloat16).min


def test_prepacked_model_decodes_the_same():
    # oneDNN-prepacked linear layers compute the same function; the LM head stays a table policies can read
    from echospec.decoder import prepack

    model = tiny_model("llama", "sdpa", VOCAB, seed=4, sharpen=8.0)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    reference = hf_greedy(model, ids, "ids", 30)
    prepack(model)
    assert type(model.model.layers[0].mlp.gate_proj).__name__ == "MkldnnLinear"
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)
    assert ours(model, ids, "ids", Scripted(reference, 8, VOCAB), 30, max_nodes=8).tokens == reference


@needs_gqa_switch
def test_tree_forward_hands_grouped_heads_to_sdpa_uncopied(monkeypatch):
    # on a CPU a tree forward's sdpa attention takes the 2 key/value heads as they are instead of copying the
    # cache per query head (transformers' switch, set only around the forward); the logits are the copy's
    import transformers.integrations.sdpa_attention as sdpa

    from echospec.decoder.gqa import SWITCH

    monkeypatch.delenv(SWITCH, raising=False)
    copies, repeat_kv = [], sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda *args: copies.append(1) or repeat_kv(*args))
    model = tiny_model("qwen2", "sdpa", VOCAB, seed=3)
    switch = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: switch.append(os.environ.get(SWITCH)))
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    tree = CandidateTree.from_sequences([[1, 2, 3], [4, 5], [1, 6]])

    def tree_logits():
        session = SpeculativeSession(model, None, ExactGreedy(), speech=SpeechVocab(0, VOCAB), max_new_tokens=4)
        session.prefill(input_ids=ids)
        return session.verify(tree).logits

    grouped = tree_logits()
    assert not copies and switch == [None, "1"] and SWITCH not in os.environ
    monkeypatch.setenv(SWITCH, "0")  # a process that set the switch keeps transformers' way: every layer copies
    copied = tree_logits()
    assert len(copies) == 2 * 2 and switch[2:] == ["0", "0"]
    torch.testing.assert_close(grouped, copied, rtol=0, atol=1e-6)


@needs_gqa_switch
def test_grouped_head_switch_is_for_cpu_sdpa_with_grouped_heads_and_nests(monkeypatch):
    from echospec.decoder.gqa import SWITCH, copies_grouped_heads, grouped_query_attention

    monkeypatch.delenv(SWITCH, raising=False)
    assert copies_grouped_heads(tiny_model("llama", "sdpa", VOCAB))
    assert not copies_grouped_heads(tiny_model("llama", "eager", VOCAB))  # eager attention always copies
    ungrouped = tiny_model("llama", "sdpa", VOCAB)
    ungrouped.config.num_key_value_heads = ungrouped.config.num_attention_heads
    assert not copies_grouped_heads(ungrouped)
    with grouped_query_attention():  # sessions on two threads: set until the last forward ends
        assert copies_grouped_heads(tiny_model("llama", "sdpa", VOCAB))  # our own setting is not the user's
        with grouped_query_attention():
            assert os.environ[SWITCH] == "1"
        assert os.environ[SWITCH] == "1"
    assert SWITCH not in os.environ
