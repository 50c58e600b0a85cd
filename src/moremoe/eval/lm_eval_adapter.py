"""A moremoe model as an lm-evaluation-harness LM, registered as ``moremoe``.

- loglikelihood: lm-eval encodes context and continuation (TemplateLM._encode_pair: the
  continuation's tokens are those of context+continuation past the context's), the sequence
  is cut from the left to max_seq_len + 1 tokens, and the continuation's log-probabilities
  are summed from one forward pass; requests run longest first in right-padded batches
  (padding after the last real token changes no earlier logit of a causal model).
- loglikelihood_rolling: disjoint windows of max_seq_len (lm-eval's
  get_rolling_token_windows / make_disjoint_window), each token predicted once.
- generate_until: greedy decoding through the fast path of model/static.py, one request at
  a time, until a stop string appears in the decoded text, <|endoftext|>, or max_gen_toks:
  one StaticDecoder of one row and max_seq_len positions serves every request, so on a GPU
  the decode step is captured once as a CUDA graph and each token of every request is one
  replay. Its tokens are those of model/generate.py's eager loop (tests/eval).

The tokenizer is GPT-2's (tiktoken). lm_eval is imported here at module level: import this
module lazily (the ``eval`` extra).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as err:
    raise ImportError(f"lm-eval is needed: pip install 'moremoe[eval]' ({err})") from err

from ..model.static import StaticDecoder
from ..tasks.tokenizer import EOT_ID, gpt2_encoding
from ..runtime import autocast_dtype, progress_bar, resolve_device
from .zero_shot import load_eval_model

@register_model("moremoe")
class MoremoeLM(TemplateLM):
    def __init__(self, model=None, pretrained: str | None = None, batch_size: int | str = 8,
                 device: str | None = None, max_gen_toks: int = 256, max_batch_size=None,
                 progress: bool = False):
        """model: a Transformer (in memory), or pretrained: a path load_eval_model reads.
        lm-eval passes batch_size, max_batch_size (unused) and device itself. progress: a
        bar per request type on stderr (unless lm-eval passes disable_tqdm)."""
        super().__init__()
        self.progress = progress
        if (model is None) == (pretrained is None):
            raise ValueError("give exactly one of model (a Transformer) or pretrained (a path)")
        self._device = resolve_device(device or "auto")
        model = model if model is not None else load_eval_model(pretrained, self._device)
        self.model = model.to(self._device).eval()
        self.max_length = model.config.max_seq_len
        self.batch_size = 8 if batch_size in (None, "auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.tokenizer = gpt2_encoding()
        self.decoder: StaticDecoder | None = None     # built at the first generate_until
        if model.config.vocab < self.tokenizer.n_vocab:
            raise ValueError(f"the model's vocab={model.config.vocab} is smaller than the GPT-2 "
                             f"tokenizer's {self.tokenizer.n_vocab}")

    @property
    def eot_token_id(self) -> int:
        return EOT_ID

    @property
    def tokenizer_name(self) -> str:
        return "gpt2"

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, allowed_special="all")

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(list(tokens))

    def _autocast(self):
        """bf16 autocast on a GPU, without autocast's cache of cast weights: a cast weight
        cached while the step is captured would be freed when the context exits, under the
        graph that replays it (a forward uses each weight once, so nothing is lost)."""
        dtype = autocast_dtype(self._device)
        return torch.autocast(self._device.type, dtype=dtype, enabled=dtype is not None,
                              cache_enabled=False)

    def _logits(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), self._autocast():
            return self.model(tokens_BT.to(self._device)).logits

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        rows = []
        for _, context, continuation in requests:
            if not continuation or len(continuation) > self.max_length:
                raise ValueError(f"a continuation must have 1 to max_seq_len={self.max_length} "
                                 f"tokens, got {len(continuation)}")
            rows.append(((list(context) + list(continuation))[-(self.max_length + 1):][:-1],
                         list(continuation)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list = [None] * len(rows)
        bar = progress_bar(len(rows), desc="loglikelihood requests",
                           enabled=self.progress and not disable_tqdm)
        for at in range(0, len(order), self.batch_size):
            batch = order[at:at + self.batch_size]
            T = len(rows[batch[0]][0])
            tokens_BT = torch.zeros(len(batch), T, dtype=torch.long)
            for b, i in enumerate(batch):
                tokens_BT[b, :len(rows[i][0])] = torch.tensor(rows[i][0])
            logits_BTV = self._logits(tokens_BT)
            for b, i in enumerate(batch):
                inp, cont = rows[i]
                logp_CV = F.log_softmax(logits_BTV[b, len(inp) - len(cont):len(inp)].float(), -1)
                cont_C = torch.tensor(cont, device=logp_CV.device)
                logp = float(logp_CV.gather(-1, cont_C[:, None]).sum())
                results[i] = (logp, bool((logp_CV.argmax(-1) == cont_C).all()))
            bar.update(len(batch))
        bar.close()
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        bar = progress_bar(len(requests), desc="rolling loglikelihood requests",
                           enabled=self.progress and not disable_tqdm)
        for (string,) in (req.args for req in requests):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(lp for lp, _ in self._loglikelihood_tokens(
                [(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
            bar.update()
        bar.close()
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        bar = progress_bar(len(requests), desc="generate_until requests",
                           enabled=self.progress and not disable_tqdm)
        for context, gen_kwargs in (req.args for req in requests):
            kw = dict(gen_kwargs)
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            until.append(self.tok_decode([EOT_ID]))
            max_gen = int(kw.pop("max_gen_toks", self.max_gen_toks))
            if kw.get("do_sample") or kw.get("temperature", 0.0) > 0:
                raise ValueError(f"generate_until decodes greedily; got {gen_kwargs}")
            max_gen = min(max_gen, self.max_length - 1)
            ctx = self.tok_encode(context)[-(self.max_length - max_gen):] or [EOT_ID]
            with self._autocast():
                if self.decoder is None:       # under autocast: the cache in its dtype
                    self.decoder = StaticDecoder(self.model, 1, self.max_length)
                new = self.decoder.generate(
                    torch.tensor([ctx], device=self._device), max_gen, eos_id=EOT_ID,
                    stop_fn=lambda row: any(s in self.tok_decode(row) for s in until))[0]
            text = self.tok_decode(new)
            for s in until:
                text = text.split(s)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
            bar.update()
        bar.close()
        return out
