"""SpeculativeSession: the step-level API (propose -> verify -> accept -> compact) on a Hugging Face causal LM.

The KV cache holds every token except the newest one (`pending`). A step feeds `pending` (the tree's root)
and the N tree nodes in one forward, with a 4D tree-attention mask and per-node positions; the policy
walks the logits; the accepted nodes' keys and values are gathered into place right after the root and
the rest cropped, on transformers' own DynamicCache. The prefix is never run again. Batch size 1 only.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from ..retriever.tree import MAX_DEPTH, CandidateTree
from . import compat
from .budget import NODES, FixedBudget, NodeBudget
from .errors import DecoderInputError, UnsupportedModelError
from .gqa import copies_grouped_heads, grouped_query_attention
from .policies import ExactGreedy, Policy, VerifiedTree
from .sampling import NodeState
from .stats import GenerationStats
from .support import check_model
from .vocab import SpeechVocab, eos_ids


class SpeculativeSession:
    """One utterance's decoding state (batch size 1). `prefill` once, then `step` until `finished`.

        session = SpeculativeSession(llm.llm.model, retriever, ExactGreedy(), head=llm.llm_decoder,
                                     speech_embedding=llm.speech_embedding,
                                     speech=SpeechVocab(0, 6561, (6561, 6562, 6563)), max_new_tokens=500)
        session.prefill(inputs_embeds=lm_input)
        while not session.finished:
            new_tokens = session.step()

    or a loop of your own over the four stages, as `step` runs them:

            tree = session.propose()                     # the retriever's tree, cut to the budget's cap
            verified = session.verify(tree)              # one forward over the root and the tree's nodes
            path, bonus = session.accept(verified)       # the policy's walk
            emitted = session.emit([verified.tokens[i] for i in path] + ([] if bonus is None else [bonus]))
            session.compact(len(tree), path[: len(emitted) - 1])  # keep the emitted nodes' keys and values

    or `for speech_tokens in session.stream(inputs_embeds=lm_input): ...` (tokens as they are accepted).

    The model is never modified. `head` (optional) maps the backbone's final hidden states to logits over
    the speech ids and stops, for models with their own speech head (CosyVoice's `llm_decoder`): the
    backbone's base model runs and `head` scores its output; `model` may then be the bare backbone.
    `speech_embedding` (a table or callable) embeds generated tokens when they have their own table.
    `min_length_stop_ids` are the stop ids masked while fewer than `min_new_tokens` are generated (None:
    all of them, as Hugging Face does; CosyVoice masks only its first, see `presets`).
    How many tree nodes a step verifies: `max_nodes` (an int: that many, the most probable; 0: plain steps),
    or `budget`, a `budget.NodeBudget` (`FixedBudget`, or `AdaptiveBudget(rates)`: the cap measured fastest by a
    `CapRates` you share between sessions); neither: `FixedBudget(NODES)`. A fixed cap keeps the session's
    tokens a function of its model, store, inputs, policy and seed alone. A retriever that raises, or under a
    lossless policy takes longer than `retriever_timeout` seconds, makes that step autoregressive. `generated`
    holds the model ids emitted so far.
    """

    def __init__(self, model, retriever=None, policy: Policy | None = None, *, head=None,
                 speech: SpeechVocab | None = None, speech_embedding=None, speaker=None, prompt_speech=None,
                 max_new_tokens: int = 2048, min_new_tokens: int = 0, min_length_stop_ids=None,
                 max_nodes: int | None = None, budget: NodeBudget | None = None, max_depth: int = MAX_DEPTH,
                 token_rate: float = 25.0, retriever_timeout: float = 0.1):
        check_model(model, head)
        self.model, self.retriever, self.speaker, self.head = model, retriever, speaker, head
        # read once: a model's .device and .dtype walk its parameters, some 10 us each on a CPU, and a step
        # needs them several times (the model must stay where it is while a session decodes with it)
        self.device, self.dtype = model.device, model.dtype
        self.backbone = model if head is None else model.base_model
        self._cache_argument = compat.cache_argument(self.backbone)
        self._copies_grouped_heads = copies_grouped_heads(model)
        self.policy = policy or ExactGreedy()
        self.vocab_size = self._output_size()
        self.speech = speech or SpeechVocab(0, self.vocab_size, eos_ids(model.generation_config))
        self._check_vocabulary()
        self.speech_embedding = speech_embedding
        self._embedding_rows = _rows(speech_embedding)
        self.prompt_speech = None if prompt_speech is None else [int(t) for t in prompt_speech]
        stops = self.speech.stop_ids if min_length_stop_ids is None else tuple(int(t) for t in min_length_stop_ids)
        if set(stops) - set(self.speech.stop_ids):
            raise DecoderInputError(f"min_length_stop_ids {sorted(set(stops) - set(self.speech.stop_ids))} "
                                    f"are not stop ids of {self.speech}")
        self.min_length_stop_ids = stops
        self.budget = _budget(max_nodes, budget)
        if max_new_tokens < 1 or min_new_tokens < 0:
            raise DecoderInputError(f"need max_new_tokens >= 1 and min_new_tokens >= 0, "
                                    f"got {max_new_tokens} and {min_new_tokens}")
        self.max_new_tokens, self.min_new_tokens = max_new_tokens, min_new_tokens
        self.max_depth, self.retriever_timeout = max_depth, retriever_timeout
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 62
        self.stats = GenerationStats(token_rate=token_rate)
        table = self._output_table()
        self.policy.bind(None if table is None else (lambda ids: table[ids.to(table.device)]))
        self.cache = compat.new_cache(model.config)
        self.cached = 0  # tokens in the KV cache
        self._prompt_length = 0
        self.prompt_ids: list[int] = []
        self.generated: list[int] = []  # model ids emitted; the last one is pending (not yet in the cache)
        self._history: list[int] = []  # prompt ids + generated: what samplers may look back at
        self.context: list[int] = []  # the retriever's context: store-local speech ids
        self.finished = False

    # ---- the model's vocabulary ---------------------------------------------------------------------

    def _output_size(self) -> int:
        """How many logits the model (or `head`) gives per position."""
        if self.head is None:
            table = self.model.get_output_embeddings()
            return int(table.weight.shape[0]) if table is not None else int(self.model.config.vocab_size)
        probe = torch.zeros(1, 1, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            return int(self.head(probe).shape[-1])

    def _output_table(self) -> torch.Tensor | None:
        """The output embedding rows (for SimilarityGroups): the head's weight, or the LM head's."""
        head = self.head if self.head is not None else self.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        return weight if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None

    def _check_vocabulary(self) -> None:
        speech, source = self.speech, "the head's" if self.head is not None else "the model's"
        if speech.offset + speech.size > self.vocab_size:
            raise DecoderInputError(
                f"{source} {self.vocab_size} output ids do not cover the speech ids {speech.offset}.."
                f"{speech.offset + speech.size - 1} of {speech}" + (
                    "" if self.head is not None else "; a model with its own speech head needs head=..."))
        outside = [t for t in speech.stop_ids if not 0 <= t < self.vocab_size]
        if outside:
            raise DecoderInputError(f"stop ids {outside} are outside {source} {self.vocab_size} output ids")
        layout = getattr(getattr(self.retriever, "datastore", None), "codebooks", None)
        if layout is not None and layout != speech.codebooks:
            raise DecoderInputError(f"the retriever's store interleaves {layout} codebooks, {speech} says "
                                    f"{speech.codebooks}: build the store with --codebooks {speech.codebooks}")

    # ---- inputs -------------------------------------------------------------------------------------

    def _embed(self, ids: list[int]) -> torch.Tensor:
        rows = self._embedding_rows
        if rows is not None and max(ids) >= rows:
            raise DecoderInputError(f"generated id {max(ids)} falls outside speech_embedding's {rows} rows")
        table, tensor = self.speech_embedding, torch.tensor(ids, device=self.device)
        vectors = table[tensor.to(table.device)] if isinstance(table, torch.Tensor) else table(tensor)
        return vectors.to(device=self.device, dtype=self.dtype)[None]

    def _logits(self, inputs: dict, last_only: bool = False, **kwargs) -> torch.Tensor:
        """The model's logits [1, T, V] as float32 on its device (only the last position's with `last_only`),
        filling the cache. The policy reads them there in one batched pass; what comes back to the host is the
        few numbers its walk needs."""
        start = time.perf_counter()
        cache = {self._cache_argument: self.cache}  # `cache` in transformers 5, `past_key_values` in 4
        if self.head is None:
            logits = self.model(**inputs, **cache, use_cache=True, logits_to_keep=int(last_only),
                                **kwargs).logits
        else:
            hidden = self.backbone(**inputs, **cache, use_cache=True, **kwargs).last_hidden_state
            logits = self.head(hidden[:, -1:] if last_only else hidden)
        logits = logits.float()
        if logits.is_cuda:  # a GPU's call returns before the forward has run: time the forward, not its launch
            torch.cuda.synchronize(logits.device)
        self.stats.forward_seconds += time.perf_counter() - start
        self.stats.target_forwards += 1
        return logits

    def _forward(self, ids: list[int], positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        inputs = {"inputs_embeds": self._embed(ids)} if self.speech_embedding is not None else {
            "input_ids": torch.tensor([ids], device=self.device)}
        tree = mask is not None and self._copies_grouped_heads
        with grouped_query_attention() if tree else contextlib.nullcontext():
            return self._logits(inputs, attention_mask=mask, position_ids=positions[None].to(self.device))[0]

    # ---- prefill ------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids=None, inputs_embeds=None) -> list[int]:
        """Run the prompt (ids or embeddings, batch 1) and emit the first token; returns the tokens emitted."""
        if (input_ids is None) == (inputs_embeds is None):
            raise DecoderInputError("pass exactly one of input_ids or inputs_embeds")
        if self.cached or self.generated:
            raise DecoderInputError("this session has already been prefilled; start a new session per utterance")
        device = self.device
        if input_ids is not None:
            input_ids = torch.as_tensor(input_ids, device=device)
            input_ids = input_ids[None] if input_ids.dim() == 1 else input_ids
            _check_batch(input_ids.shape, 2, "input_ids")
            length, inputs = input_ids.shape[1], {"input_ids": input_ids}
            self.prompt_ids = input_ids[0].tolist()
            self._history = list(self.prompt_ids)
        else:
            inputs_embeds = torch.as_tensor(inputs_embeds, device=device)
            inputs_embeds = inputs_embeds[None] if inputs_embeds.dim() == 2 else inputs_embeds
            _check_batch(inputs_embeds.shape, 3, "inputs_embeds")
            length, inputs = inputs_embeds.shape[1], {"inputs_embeds": inputs_embeds.to(self.dtype)}
        if length == 0:
            raise DecoderInputError("the prompt is empty")
        if length >= self.max_positions:
            raise DecoderInputError(f"the prompt has {length} tokens; the model takes at most "
                                    f"{self.max_positions} positions")
        prompt_speech = self.prompt_speech if self.prompt_speech is not None else self.speech.to_local(self.prompt_ids)
        self.context = list(prompt_speech)
        logits = self._logits(inputs, last_only=True)[0, -1:]
        if not compat.keeps_every_token(self.cache):
            raise UnsupportedModelError("the model's cache has layers other than full-attention DynamicLayer")
        self.cached = self._prompt_length = length
        _, bonus = self.accept(VerifiedTree(logits, [], [], self._root_state()))
        return self.emit([bonus])

    def run(self, input_ids=None, inputs_embeds=None) -> Iterator[list[int]]:
        """Prefill, then step until finished, yielding the model ids each forward emits (never an empty list).

        `stats.wall_seconds` counts the time spent in here, not the time the caller spends between tokens.
        """
        start = time.perf_counter()
        emitted = self.prefill(input_ids=input_ids, inputs_embeds=inputs_embeds)
        while True:
            self.stats.wall_seconds += time.perf_counter() - start
            if emitted:
                yield emitted
            if self.finished:
                return
            start = time.perf_counter()
            emitted = self.step()

    def stream(self, input_ids=None, inputs_embeds=None) -> Iterator[list[int]]:
        """The speech tokens as they are accepted, in chunks: store-local ids without the stop token or other
        non-speech ids — what a TTS pipeline hands its vocoder or flow model while the LM is still running."""
        for emitted in self.run(input_ids=input_ids, inputs_embeds=inputs_embeds):
            speech = self.speech.to_local(emitted)
            if speech:
                yield speech

    # ---- the four stages ----------------------------------------------------------------------------

    def propose(self) -> CandidateTree:
        """Ask the retriever for a tree and cut it to what this step can use and its budget allows (may be empty)."""
        if self.retriever is None or self.finished:
            return CandidateTree.empty()
        cap = self.budget.cap(len(self.generated))
        self.stats.node_caps.append(cap)
        depth_cap = self._depth_cap(len(self.generated))
        if depth_cap <= 0 or cap == 0:
            return CandidateTree.empty()
        start = time.perf_counter()
        try:
            tree = self.retriever.propose(np.asarray(self.context, np.int64), speaker=self.speaker,
                                          max_nodes=cap, max_depth=depth_cap)
        except Exception as exc:  # noqa: BLE001 — any retriever failure only costs speed
            self.stats.retriever_errors += 1
            warnings.warn(f"retriever failed ({type(exc).__name__}: {exc}); this step runs autoregressively")
            return CandidateTree.empty()
        finally:
            elapsed = time.perf_counter() - start
            self.stats.propose_seconds += elapsed
        if elapsed > self.retriever_timeout and self.policy.exact:
            # a late tree is dropped only where that cannot change the tokens: a relaxed policy's depend on
            # the tree, and then on how loaded the machine was
            self.stats.retriever_timeouts += 1
            return CandidateTree.empty()
        return self._cut(tree, cap, depth_cap)

    def _depth_cap(self, position: int) -> int:
        """How deep a tree may go at a step `position` tokens into the utterance."""
        cached = self._prompt_length + position - 1  # every token but the newest is in the cache
        return min(self.max_depth, self.max_new_tokens - position, self.max_positions - 1 - cached)

    def _cut(self, tree: CandidateTree, cap: int, depth_cap: int) -> CandidateTree:
        """The retriever's `tree` cut to `depth_cap` and the `cap` most probable nodes."""
        if not isinstance(tree, CandidateTree):
            raise DecoderInputError(f"the retriever returned {type(tree).__name__}, not a CandidateTree")
        self.speech.to_model(tree.tokens)  # raises on ids outside the store's vocabulary
        tree = self._usable(tree, depth_cap)
        return tree if len(tree) <= cap else tree.subtree(tree.prune_order()[:cap])

    def _usable(self, tree: CandidateTree, depth_cap: int) -> CandidateTree:
        """Drop nodes deeper than this step may go and everything below a stop token."""
        stops = set(self.speech.stop_ids)
        if int(tree.depths.max(initial=0)) <= depth_cap and not any(self.speech.is_speech(t) for t in stops):
            return tree  # the usual case (stores hold speech ids only): nothing to drop, no loop over nodes
        open_nodes = {-1}  # nodes whose children may be kept
        keep = []
        for i in range(len(tree)):
            if tree.depths[i] <= depth_cap and int(tree.parents[i]) in open_nodes:
                keep.append(i)
                if int(tree.tokens[i]) + self.speech.offset not in stops:
                    open_nodes.add(i)
        return tree if len(keep) == len(tree) else tree.subtree(keep)

    @torch.no_grad()
    def verify(self, tree: CandidateTree) -> VerifiedTree:
        """One forward over the root and every tree node; returns the logits at each position."""
        n = len(tree)
        tokens = self.speech.to_model(tree.tokens)
        positions = self.cached + torch.tensor([0] + tree.depths.tolist(), dtype=torch.long)
        logits = self._forward([self.generated[-1]] + tokens, positions, self._tree_mask(tree) if n else None)
        return VerifiedTree(logits, tokens, tree.parents, self._root_state())

    def _tree_mask(self, tree: CandidateTree) -> torch.Tensor:
        """Additive float mask [1, 1, 1+N, cached+1+N]: 0 where attending, the dtype's minimum elsewhere.

        Additive, not boolean: eager attention adds the mask to the scores, so a boolean mask would be
        silently wrong there; SDPA takes either form.
        """
        n, dtype, start = len(tree), self.dtype, self.cached + 1
        # built in NumPy and converted once: per-op torch overhead dominates at this size. The dtype's
        # minimum is exact in float32 for float16 and bfloat16 alike.
        mask = np.zeros((1, 1, n + 1, start + n), np.float32)  # the prefix and the root are visible to every row
        block = mask[0, 0, :, start:]
        blocked = float(torch.finfo(dtype).min)
        block[0] = blocked  # the root sees no tree node
        block[1:][~tree.mask] = blocked  # a node sees only itself and its ancestors
        return torch.from_numpy(mask).to(device=self.device, dtype=dtype)

    def accept(self, verified: VerifiedTree) -> tuple[list[int], int | None]:
        """The policy's walk: accepted node indices and the bonus token (None after a stop token)."""
        start = time.perf_counter()
        try:
            return self.policy.walk(verified)
        finally:
            self.stats.accept_seconds += time.perf_counter() - start

    def compact(self, n_nodes: int, path: list[int]) -> None:
        """Keep the root and the nodes on `path` in the cache, in order; crop the other nodes of the tree.

        The cache holds every emitted token but the newest: pass the path's nodes whose tokens were emitted,
        less the last emitted token's node (`path[: len(emitted) - 1]`)."""
        root = self.cached
        # nodes already in place (path[i] == i: the path runs down the tree's first branch) need no move
        moved = next((i for i, node in enumerate(path) if node != i), len(path))
        if moved < len(path):
            source = torch.tensor(path[moved:], device=self.device) + root + 1
            target = slice(root + 1 + moved, root + 1 + len(path))
            for keys, values in compat.layer_tensors(self.cache):
                keys[..., target, :] = keys.index_select(-2, source)
                values[..., target, :] = values.index_select(-2, source)
        if n_nodes > len(path):
            self.cache.crop(-(n_nodes - len(path)))
        self.cached = root + 1 + len(path)

    @torch.no_grad()
    def step(self) -> list[int]:
        """propose -> verify -> accept -> compact; returns the tokens emitted (model ids)."""
        if self.finished:
            return []
        if not self.generated:
            raise DecoderInputError("call prefill() before step()")
        if self.cached >= self.max_positions:
            self.finished = True
            self._close_budget()
            return []
        start = time.perf_counter()
        tree = self.propose()
        verified = self.verify(tree)
        path, bonus = self.accept(verified)
        emitted = self.emit([verified.tokens[i] for i in path] + ([] if bonus is None else [bonus]))
        self.compact(len(tree), path[: len(emitted) - 1])
        self.budget.observe(len(emitted), time.perf_counter() - start)
        if self.finished:
            self._close_budget()
        self.stats.accepted_lengths.append(len(path))
        self.stats.node_budgets.append(len(tree))
        return emitted

    # ---- bookkeeping --------------------------------------------------------------------------------

    def _close_budget(self) -> None:
        self.budget.finish()
        summary = getattr(self.budget, "summary", None)
        self.stats.budget = summary() if summary else None

    def _root_state(self) -> NodeState:
        """The sampler's view at the position after the emitted tokens (a tree's nodes extend it by their paths)."""
        return NodeState(self._history, len(self.generated), self.speech.stop_ids, self.min_length_stop_ids,
                         self.min_new_tokens)

    def emit(self, tokens: list[int]) -> list[int]:
        """Append `tokens` (model ids: a step's accepted path and bonus token) to `generated`, up to a stop
        token or `max_new_tokens`; returns those emitted and sets `finished` at the end of the utterance."""
        emitted = []
        for token in tokens:
            if len(self.generated) >= self.max_new_tokens:
                self.finished = True
                break
            self.generated.append(token)
            self._history.append(token)
            emitted.append(token)
            if self.speech.is_speech(token):
                self.context.append(token - self.speech.offset)
            if token in self.speech.stop_ids:
                self.finished = True
                break
        if len(self.generated) >= self.max_new_tokens:
            self.finished = True
        self.stats.new_tokens = len(self.generated)
        return emitted


def _budget(max_nodes, budget) -> NodeBudget:
    if budget is not None:
        if max_nodes is not None:
            raise DecoderInputError("pass max_nodes (a fixed cap) or budget, not both")
        return budget
    if max_nodes is None:
        return FixedBudget(NODES)
    if not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 0:
        raise DecoderInputError(f"max_nodes must be a non-negative int, got {max_nodes!r} (for a cap measured "
                                f"as it runs, pass budget=AdaptiveBudget(rates))")
    return FixedBudget(max_nodes)


def _check_batch(shape, dims: int, name: str) -> None:
    if len(shape) != dims:
        raise DecoderInputError(f"{name} must have {dims} dimensions (batch, ...), got shape {tuple(shape)}")
    if shape[0] != 1:
        raise DecoderInputError(f"echospec decodes batch size 1 only; {name} has batch size {shape[0]}")


def _rows(table) -> int | None:
    """How many ids an embedding table (a tensor, an nn.Embedding) holds; None for another callable."""
    if isinstance(table, torch.Tensor):
        return int(table.shape[0])
    weight = getattr(table, "weight", None)
    return int(weight.shape[0]) if isinstance(table, torch.nn.Embedding) and weight is not None else None
