"""A vLLM proposer that always drafts the same ids: a probe of the engine's rejection sampler. Whatever is drafted,
lossless verification must leave the sampled distribution the model's own, so a fixed id the model seldom says
must stay rare in the output (tests/retriever/test_vllm.py)."""

DRAFTED_ID = 6000  # a CosyVoice-layout speech id the shaped replica never says
K = 3


class FixedDraft:
    def __init__(self, vllm_config):
        pass

    def load_model(self, *args, **kwargs) -> None:
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_):
        return [[DRAFTED_ID] * K if len(sampled) else [] for sampled in sampled_token_ids]
