"""The model runner computes one engine step for the running sequences.

Every sequence's decoder describes its next forward as a `ForwardRequest` (`next_forward`; the one
decoder protocol, `diffusion/parts/protocol.py`) and takes its answer (`receive`).

Autoregressive sequences: their forwards are causal continuations (`ForwardRequest.extends`): the
prompts of newly admitted sequences and the token each other one sampled last run as **one flat
forward** (`[1, T]`, no padding) over the paged KV store, each sequence with its own positions and
page table (`Sequence.block_table`, `paged_kv.py`); each then samples its next token with its own
settings and generator.

Diffusion sequences: each decoder describes its next forward as a `ForwardRequest` (`next_forward`;
`diffusion/parts/stepper.py`). On LLaDA / Dream (`spec.segmented`) the requests of every running
sequence go into **one packed forward** `[1, N]` (`stepper.run_forwards`, `varlen.PackedAttention`),
each attending over its own keys through its own cache and mask, its RoPE at its own positions
(Elastic-Cache's rows change between layers: `varlen.PackedLayers`); the block-causal models
(SDAR, LLaDA2, Fast-dLLM v2) stack the requests whose caches pack (`ForwardRequest.stacks`). A
request of inputs no packed forward takes runs alone; APD's verifier forwards (causal continuations of
another model) run as one flat forward of that model, each over its own cache; DiffusionGemma's decoder
forwards (and its encoder forwards of one length) stack, each over its own cache (`CanvasRows`). The
runner hands each its rows (`receive`); each sequence commits with its own rule and generator,
greedy block decoders of one rule together (`receive_together`, row by row as alone).

With `batch_invariant` each request's linears are the GEMM problems its own forward poses
(`batch_invariant.py`: one flat GEMM where this CPU's BLAS is measured row-invariant, per-sequence
GEMMs below that size; on CUDA a row-invariant Triton GEMM). With `cuda_graphs` the uncached
full forwards of one length replay a CUDA graph captured per batch bucket and length
(`cuda_graphs.py`); every other forward runs eagerly. A failure inside one sequence's forward or
commit fails that sequence only (`failed`); a failed packed forward fails the sequences in it.
"""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch

from remask.models.hf_compat import dynamic_cache, lm_output
from remask.models.spec import ModelSpec

from remask.diffusion.parts.stepper import ForwardRequest, call_model, run_forwards

from . import cuda_graphs as graphing
from remask.kernels.batch_invariant import batch_invariant_linear
from remask.caches.page_manager import PageManager
from .paged_kv import ForwardBatch, PagedKVStore, SequenceSlice, paged_forward
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: torch.nn.Module, spec: ModelSpec, batch_invariant: bool = True,
                 pages: PageManager | None = None, cuda_graphs: bool = False, max_num_seqs: int = 64,
                 varlen_attention: bool = False) -> None:
        if varlen_attention and not spec.segmented and spec.attention == "bidirectional":   # DiffusionGemma
            raise ValueError(f"varlen_attention=True: the {spec.kind!r} model's forwards do not pack through "
                             "remask's attention seams; use varlen_attention=False")
        self.model, self.spec, self.batch_invariant = model, spec, batch_invariant
        self.varlen_attention = varlen_attention
        self.device = next(model.parameters()).device
        self.forwards = 0      # model calls, for the benchmark
        self.store = PagedKVStore(pages) if pages is not None else None
        # make_backend refuses a model off CUDA (ValueError naming cuda_graphs)
        self.graphs = graphing.GraphedForward(graphing.make_backend(self.device), max_num_seqs) \
            if cuda_graphs else None

    def _invariant(self, batch: int, token_groups=None):
        # on CUDA a lone sequence runs the invariant GEMM too: cuBLAS and it differ in their bits,
        # so a request alone and the same request batched must take the same kernel
        on = self.batch_invariant and (batch > 1 or self.device.type == "cuda")
        # batched forwards on one CPU thread; a lone one too where the thread count sets the model's bits
        one_thread = self.device.type == "cpu" and (on or (self.batch_invariant and self.spec.thread_sensitive))
        return batch_invariant_linear(on, single_thread=one_thread, token_groups=token_groups)

    @torch.no_grad()
    def step(self, seqs: list[Sequence]) -> dict[Sequence, str]:
        """Advance every sequence by one step; returns the failed ones with their error."""
        failed: dict[Sequence, str] = {}
        packed: dict[Any, list[tuple[Sequence, ForwardRequest]]] = defaultdict(list)
        for seq in seqs:
            try:
                if seq.state is None:
                    seq.stats.start()
                    seq.state = seq.decoder.start(seq.prompt_ids)
                # The decoder describes its forward; the requests that pack share one model call.
                request = seq.decoder.next_forward(seq.state, seq.generator, seq.stats)
                if request is not None and request.extends and (self.store is not None or request.module is not None):
                    # causal continuations of one model in one flat forward: over the page store (autoregressive)
                    # or each over its own cache (APD's verifier)
                    packed[("causal", id(request.module))].append((seq, request))
                elif request is not None:   # a CUDA graph's, else a packed forward's, else its own
                    key = self._graph_key(seq, request) or (
                        request.pack_key() if self.spec.segmented or request.stacks else None)
                    packed[("alone", id(seq)) if key is None else ("pack", key)].append((seq, request))
            except Exception as err:  # noqa: BLE001 - one request's failure must not stop the others
                failed[seq] = f"{type(err).__name__}: {err}"
        received: list[Sequence] = []   # every forward first, then one `_receive`: commits batch across packs
        answered: list[Any] = []
        for key, members in packed.items():
            try:
                requests = [request for _, request in members]
                if key[0] == "causal":
                    answers = self._causal_forward(members)
                elif key[0] == "pack" and key[1][0] == "graph":
                    # uncached full forwards of one length: one captured graph per (bucket, length)
                    x = torch.cat([r.input_ids for r in requests])
                    logits = self.graphs(x, lambda x: call_model(self.model, requests[0], x), key=key[1][1:],
                                         context=self._invariant)
                    answers = list(logits.split([r.batch for r in requests]))
                else:
                    answers = run_forwards(self.model, requests, self._invariant if self.batch_invariant else None,
                                           self.spec, self.varlen_attention)
                self.forwards += 1
            except Exception as err:  # noqa: BLE001
                failed.update({seq: f"{type(err).__name__}: {err}" for seq, _ in members})
                continue
            received += [seq for seq, _ in members]
            answered += answers
        self._receive(received, answered, failed)
        return failed

    def _graph_key(self, seq: Sequence, request: ForwardRequest) -> tuple | None:
        """With `cuda_graphs`: a key for a forward a CUDA graph can replay — a pure function of one
        static-shape input (no cache, no tensor inputs but the tokens) — else None."""
        if (self.graphs is None or request.cache is not None or request.per_row or request.input_ids is None
                or request.rows is not None or request.output != "logits"
                or any(torch.is_tensor(v) for v in request.shared.values())):
            return None
        return ("graph", type(seq.decoder).__name__, request.input_ids.shape[1], request.spec is not None,
                tuple(sorted(request.shared.items())))

    def _receive(self, group: list[Sequence], answers: list[torch.Tensor], failed: dict[Sequence, str]) -> None:
        """Each sequence takes its answer. Decoders that say their commits batch (equal `commit_key`)
        receive together in one call (`receive_together`: one scoring and one selection for the lot,
        row by row as each alone); the rest alone."""
        batched: dict[Any, list[tuple[Sequence, torch.Tensor]]] = defaultdict(list)
        for seq, answer in zip(group, answers):
            key = seq.decoder.commit_key()
            batched[id(seq) if key is None else (type(seq.decoder), key)].append((seq, answer))
        for members in batched.values():
            seqs, answers = zip(*members)
            try:
                seqs[0].decoder.receive_together([s.decoder for s in seqs], [s.state for s in seqs], list(answers),
                                                 [s.generator for s in seqs], [s.stats for s in seqs])
            except Exception as err:  # noqa: BLE001
                failed.update({seq: f"{type(err).__name__}: {err}" for seq in seqs})

    # ---- causal continuations: one flat forward over the paged store or the sequences' own caches ----

    def _causal_forward(self, members: list[tuple[Sequence, ForwardRequest]]) -> list[Any]:
        """The causal continuations (`ForwardRequest.extends`) of one model in one flat forward `[1, T]`, each
        sequence's new ids at its own positions. The engine's model: over each one's page table (its prompt's pages
        found in the prefix cache where they match). Another model (APD's verifier, `module`): over each request's
        own cache (a new one at its first forward), appended to as its own forward appends. Answers: a model output
        with each one's logits `[1, k, V]` (its last position, or the positions its `rows` asks for) and its own cache."""
        module = members[0][1].module
        model = self.model if module is None else module
        slices: list[SequenceSlice] = []
        ids, positions, keep = [], [], []   # the flat forward's token ids, their positions, the rows kept
        for seq, request in members:
            feed, cache, shared = request.input_ids[0].tolist(), None, 0
            if module is not None:   # its own cache (a new one at its first forward)
                cache = request.cache if request.cache is not None else dynamic_cache(module)
                past, table = cache.get_seq_length(), []
            elif seq.block_table is None:   # its prompt: pages shared with an equal prompt's where they can be
                past, table = seq.kv_len, self.store.manager.allocate(feed)
                seq.block_table, shared = table, self.store.manager.last_hits
            else:
                past, table = seq.kv_len, seq.block_table
                self.store.manager.extend(table, past + len(feed))
            slices.append(SequenceSlice(start=len(ids), q_len=len(feed), ctx_len=past + len(feed), table=table,
                                        shared=shared, cache=cache))
            keep.append([len(ids) + row for row in range(len(feed))[request.rows or slice(-1, None)]])
            ids.extend(feed)
            positions.extend(range(past, past + len(feed)))
        batch = ForwardBatch(slices, self.store if module is None else None, self.device, self.varlen_attention)
        input_ids, position_ids, rows = (torch.tensor(v, dtype=torch.long, device=self.device)
                                         for v in ([ids], [positions], [r for k in keep for r in k]))
        with self._invariant(len(slices), batch.token_groups), paged_forward(model, batch):
            logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                           logits_to_keep=rows).logits[0]
        if module is None:
            for (seq, _), s in zip(members, slices):
                seq.kv_len = s.ctx_len
            # the model output's one field `receive` reads (a transformers output per row costs more than its sample)
            return [SimpleNamespace(logits=row[None, None]) for row in logits]
        return [lm_output(logits=part[None], cache=s.cache)
                for part, s in zip(logits.split([len(k) for k in keep]), slices)]
