"""The bench tells rounding from bugs: the logits behind each token, the first divergence, and a plain forward's
logits there."""

import torch
from decoder_testing import PromptLookup, tiny_model

from echospec.decoder import ExactGreedy, SpeechVocab, generate
from echospec.tools.bench.divergence import divergence, first_divergence, plain_logits, record_logits

VOCAB = 64


def test_recorded_rows_are_the_plain_forwards_and_a_divergence_is_located():
    model = tiny_model("llama", "sdpa", VOCAB, seed=2)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    policy = ExactGreedy()
    record = record_logits(policy)
    result = generate(model, PromptLookup(), policy=policy, input_ids=ids, speech=SpeechVocab(0, VOCAB),
                      max_new_tokens=20, max_nodes=8)
    tokens, rows = result.tokens, record.rows
    assert len(rows) >= len(tokens)  # one row per token chosen (the walk may choose past the length limit)
    assert 0 < record.seconds < result.stats.wall_seconds  # the copying's time, which the bench leaves out
    prompt = ids[0].tolist()
    for position in (0, 5, 19):  # a tree forward's row and a one-token forward's agree up to rounding
        assert torch.allclose(rows[position], plain_logits(model, prompt, tokens, position), atol=1e-4)
        assert int(rows[position].argmax()) == tokens[position]
    assert first_divergence(tokens, tokens) is None and divergence(model, prompt, tokens, tokens, rows) is None
    changed = tokens[:7] + [(tokens[7] + 1) % VOCAB] + tokens[8:]
    found = divergence(model, prompt, tokens, changed, rows)
    assert found["position"] == 7 and found["system_token"] == tokens[7] and found["baseline_token"] == changed[7]
    assert found["max_logit_difference"] < 1e-4 and found["top2_gap"] > 0
    assert first_divergence(tokens, tokens[:10]) == 10  # one output a prefix of the other
    assert divergence(None, prompt, tokens, changed, rows)["max_logit_difference"] is None  # no model: position only
