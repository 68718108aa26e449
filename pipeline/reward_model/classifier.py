"""A sequence classifier as the reward model: transformers'
AutoModelForSequenceClassification with one label, whose logit at the last
token of prompt + completion is the score (the layout of the Bradley-Terry
reward models practitioners train, e.g. TRL's RewardTrainer output).

Inference only: eval mode, no gradients, nothing ever writes its weights.
A batch is scored in micro-batches of like lengths (longest first), so that
little of each forward is padding; the model pools the last non-pad token of
each row, so a row's score does not depend on what it was batched with.
"""
from __future__ import annotations

import torch

from pipeline.core.types import Prompt
from pipeline.inputs.models import ModelError, check_model_dir, check_reward_model
from pipeline.core.weights_digest import state_digest
from pipeline.reward_model.common import conversation


class ClassifierScorer:
    def __init__(self, path: str, *, batch_size: int = 16, dtype: str = "fp32"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        check_model_dir(path)
        check_reward_model(path, "classifier")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
        self.model.requires_grad_(False)
        pad = self.model.config.pad_token_id
        if pad is None:
            tok = self.tokenizer
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            if pad is None:
                raise ModelError(f"model directory {path!r}: neither its config nor its tokenizer names a pad "
                                 "or end-of-text token, which batching needs")
            self.model.config.pad_token_id = pad
        self.pad = pad
        self.batch_size = batch_size
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))

    def _ids(self, prompt: Prompt, completion: str) -> list[int]:
        turns = conversation(prompt, completion) if self.chat else None
        if turns is not None:
            text = self.tokenizer.apply_chat_template(turns, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        return self.tokenizer(prompt.text + completion).input_ids

    def score(self, prompts: list[Prompt], completions: list[str]) -> list[tuple[float, str]]:
        """(score, why it failed or "") per sample; an input longer than the model's context fails alone."""
        ids = [self._ids(p, c) for p, c in zip(prompts, completions, strict=True)]
        out: list[tuple[float, str]] = [(0.0, "")] * len(ids)
        fits = []
        for i, row in enumerate(ids):
            if self.context and len(row) > self.context:
                out[i] = (0.0, f"prompt {prompts[i].id}: {len(row)} tokens for the reward model, whose context "
                               f"is {self.context}")
            else:
                fits.append(i)
        fits.sort(key=lambda i: -len(ids[i]))
        with torch.inference_mode():
            for start in range(0, len(fits), self.batch_size):
                rows = fits[start:start + self.batch_size]
                width = len(ids[rows[0]])
                batch = torch.full((len(rows), width), self.pad, dtype=torch.long)
                mask = torch.zeros((len(rows), width), dtype=torch.long)
                for k, i in enumerate(rows):
                    batch[k, :len(ids[i])] = torch.tensor(ids[i])
                    mask[k, :len(ids[i])] = 1
                logits = self.model(input_ids=batch, attention_mask=mask).logits[:, 0].float().tolist()
                for i, value in zip(rows, logits):
                    out[i] = (value, "")
        return out

    def digest(self) -> str:
        return state_digest(self.model.state_dict())

    def close(self) -> None:
        del self.model
