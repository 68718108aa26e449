"""The teacher's logprobs by a transformers forward: AutoModelForCausalLM on
prompt + response ids, each response token's logprob under the teacher at the
sampling temperature (as the trainer scores the student's).

A forward of the token ids the trajectory holds, not vLLM's prompt logprobs:
the ids are scored exactly as sampled (no detokenize-retokenize round trip),
multi-turn and agent samples need nothing but their ids, and the teacher
needs no KV cache or engine of its own, only one forward per micro-batch.

Inference only: eval mode, no gradients, nothing ever writes its weights.
Rows are scored in micro-batches of like lengths (longest first), right
padded, so a row's logprobs do not depend on what it was batched with.
With `topk` (distill.loss topk_kl) it also keeps, at each response token's
position, the teacher's k likeliest token ids and their logprobs.
"""
from __future__ import annotations

import torch

from pipeline.core.types import TeacherScores
from pipeline.inputs.models import check_model_dir
from pipeline.core.weights_digest import state_digest


class TeacherForward:
    def __init__(self, path: str, *, batch_size: int = 16, dtype: str = "fp32", temperature: float = 1.0,
                 topk: int = 0):
        from transformers import AutoModelForCausalLM
        check_model_dir(path)
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
        self.model.requires_grad_(False)
        self.batch_size, self.temperature, self.topk = batch_size, temperature, topk
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None

    def score(self, prompts: list[list[int]], responses: list[list[int]]) -> TeacherScores:
        """The teacher's logprob of each response token of each row, given its prompt and the tokens
        before it; with topk, its top-k ids and logprobs at the same positions."""
        rows = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
        for i, row in enumerate(rows):
            if self.context and len(row) > self.context:
                raise ValueError(f"row {i}: {len(row)} tokens for the teacher, whose context is {self.context}")
        taken_out: list[list[float]] = [[] for _ in rows]
        ids_out: list[list[list[int]]] = [[] for _ in rows]
        lps_out: list[list[list[float]]] = [[] for _ in rows]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                width = len(rows[chunk[0]])
                ids = torch.zeros((len(chunk), width), dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for k, i in enumerate(chunk):
                    ids[k, :len(rows[i])] = torch.tensor(rows[i])
                    mask[k, :len(rows[i])] = 1
                logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
                logp = torch.log_softmax(logits[:, :-1] / self.temperature, dim=-1)
                taken = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
                top = logp.topk(self.topk, dim=-1) if self.topk else None
                for k, i in enumerate(chunk):
                    first = len(prompts[i])  # response token t sits at first + t, predicted from first + t - 1
                    window = slice(first - 1, first - 1 + len(responses[i]))
                    taken_out[i] = taken[k, window].tolist()
                    if top is not None:
                        ids_out[i], lps_out[i] = top.indices[k, window].tolist(), top.values[k, window].tolist()
        return TeacherScores(taken_out, ids_out, lps_out) if self.topk else TeacherScores(taken_out)

    def digest(self) -> str:
        return state_digest(self.model.state_dict())

    def close(self) -> None:
        del self.model
