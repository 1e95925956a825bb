"""Token adjacency table: the top-k successors the target predicted after
each token (Token Recycling; Graft's retrieval matrix).

One ``[vocab_size, k]`` int32 tensor lives on the engine's device and is
shared by the requests that draft from it (one tenant's, see
``adjacency_drafter.py``): transitions seen in one request help the next. A row
is overwritten whole whenever its token is verified again, so the table
follows the current context. Rows never written hold -1 ("untouched") rather
than Token Recycling's zeros, so an expansion can tell "no evidence" from
"token 0" and drop those nodes instead of wasting verification slots.

Memory: ``vocab_size * k * 4`` bytes, e.g. 1.5 MiB for a 49k vocab at k=8.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

logger = logging.getLogger(__name__)

UNTOUCHED = -1
FILE_FORMAT = "specplug-adjacency"
FILE_VERSION = "1"


class AdjacencyTable:
    """``table[v]`` = the target's top-k next tokens after token ``v``."""

    def __init__(
        self,
        vocab_size: int,
        k: int = 8,
        device: torch.device | str = "cpu",
        model_id: str = "",
    ) -> None:
        if vocab_size < 1 or k < 1:
            raise ValueError(f"bad table shape [{vocab_size}, {k}]")
        self.table = torch.full((vocab_size, k), UNTOUCHED, dtype=torch.int32, device=device)
        self.model_id = model_id

    @property
    def vocab_size(self) -> int:
        return self.table.shape[0]

    @property
    def k(self) -> int:
        return self.table.shape[1]

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def num_filled(self) -> int:
        """Rows written at least once (a host sync; for logs and tests)."""
        return int((self.table[:, 0] != UNTOUCHED).sum())

    def clone(self) -> AdjacencyTable:
        new = AdjacencyTable.__new__(AdjacencyTable)
        new.table = self.table.clone()
        new.model_id = self.model_id
        return new

    def reset(self) -> None:
        self.table.fill_(UNTOUCHED)

    # ------------------------------------------------------------ update
    def update(self, tokens: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """``table[tokens[i]] = topk_ids[i]``; the last occurrence of a token wins.

        ``topk_ids`` columns must be sorted best first (``torch.topk``
        order). Wider rows are cut to ``k``; narrower ones are padded with
        -1. Tokens outside the vocabulary are ignored. Deterministic: equal
        inputs give equal tables on every tensor-parallel rank.
        """
        tokens = tokens.reshape(-1).to(device=self.device, dtype=torch.long)
        if tokens.numel() == 0:
            return
        if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens.shape[0]:
            raise ValueError(
                f"topk_ids must be [{tokens.shape[0]}, k], got {tuple(topk_ids.shape)}"
            )
        topk_ids = topk_ids.to(device=self.device, dtype=torch.int32)
        if topk_ids.shape[1] > self.k:
            topk_ids = topk_ids[:, : self.k]
        elif topk_ids.shape[1] < self.k:
            pad = topk_ids.new_full((tokens.shape[0], self.k - topk_ids.shape[1]), UNTOUCHED)
            topk_ids = torch.cat([topk_ids, pad], dim=1)
        if self.table.device.type != "cpu":
            from vllm_specplug.kernels import adjacency as kernels

            # Other accelerators take the kernels' own torch reference.
            if self.table.is_cuda:
                update = kernels.adjacency_update_triton
            else:
                update = kernels.adjacency_update_ref
            update(self.table, tokens, topk_ids.contiguous())
            return
        # numpy, not torch: on CPU a handful of tiny torch ops cost more in
        # dispatch than the whole update.
        tok, rows, table = tokens.numpy(), topk_ids.numpy(), self.table.numpy()
        valid = (tok >= 0) & (tok < self.vocab_size)
        if not valid.all():
            tok, rows = tok[valid], rows[valid]
        # A fancy assignment with repeated indices has no guaranteed winner:
        # keep each token's last occurrence explicitly (first in reverse).
        _, first_rev = np.unique(tok[::-1], return_index=True)
        win = len(tok) - 1 - first_rev
        table[tok[win]] = rows[win]

    def lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[n, k]`` successors of ``tokens`` (-1 rows for unknown tokens)."""
        tokens = tokens.reshape(-1).to(device=self.device, dtype=torch.long)
        ok = (tokens >= 0) & (tokens < self.vocab_size)
        rows = self.table[tokens.clamp(0, self.vocab_size - 1)]
        return torch.where(ok[:, None], rows, UNTOUCHED)

    # ------------------------------------------------------------ files
    def save(self, path: str, **extra: str | int) -> None:
        """Write a safetensors file; the header carries vocab size, k, model id
        and any ``extra`` strings (e.g. the corpus it was built from)."""
        from safetensors.torch import save_file

        meta = {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "vocab_size": str(self.vocab_size),
            "k": str(self.k),
            "model_id": self.model_id,
            **{key: str(v) for key, v in extra.items()},
        }
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        save_file({"table": self.table.detach().cpu().contiguous()}, tmp, metadata=meta)
        os.replace(tmp, path)

    @staticmethod
    def read_header(path: str) -> dict[str, str]:
        """The metadata of a saved table, without reading the table."""
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                meta = dict(f.metadata() or {})
        except FileNotFoundError:
            raise ValueError(f"adjacency table {path}: no such file") from None
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(
                f"adjacency table {path}: not a safetensors file ({type(e).__name__})"
            ) from None
        if meta.get("format") != FILE_FORMAT:
            raise ValueError(f"adjacency table {path}: not a specplug adjacency table")
        return meta

    @classmethod
    def check_vocab(cls, path: str, vocab_size: int) -> None:
        """Start-up check: the saved table was built for this vocabulary
        (ValueError, one line, otherwise)."""
        meta = cls.read_header(path)
        if int(meta.get("vocab_size", -1)) != vocab_size:
            raise ValueError(
                f"adjacency table {path} was built for a vocabulary of "
                f"{meta.get('vocab_size')} tokens (model '{meta.get('model_id', '?')}'), "
                f"but this model has {vocab_size}: rebuild it with `specplug adjacency build`")

    @classmethod
    def for_target(cls, path: str | None, vocab_size: int, k: int, device,
                   model_path: str | None) -> AdjacencyTable:
        """A method's starting table: the warm start at ``path`` (checked
        against this target, ValueError otherwise) or, without one, an empty
        table tagged with the target's folder name."""
        model_id = os.path.basename(os.path.normpath(model_path)) if model_path else ""
        if path is None:
            return cls(vocab_size, k, device, model_id)
        return cls.load(path, vocab_size, k, device, model_id)

    @classmethod
    def load(
        cls,
        path: str,
        vocab_size: int,
        k: int | None = None,
        device: torch.device | str = "cpu",
        model_id: str | None = None,
    ) -> AdjacencyTable:
        """Load a table built for a model with ``vocab_size`` tokens.

        A different vocab size means another tokenizer: that is an error. A
        different model id only warns (fine-tunes share tokenizers). ``k``
        cuts or pads (-1) the columns; None keeps the file's width.
        """
        from safetensors import safe_open

        meta = cls.read_header(path)
        file_vocab = int(meta["vocab_size"])
        if file_vocab != vocab_size:
            raise ValueError(
                f"adjacency table {path} was built for a vocabulary of {file_vocab} "
                f"tokens (model '{meta.get('model_id', '?')}'), but this model has "
                f"{vocab_size}: rebuild it with `specplug adjacency build`"
            )
        if model_id and meta.get("model_id") and meta["model_id"] != model_id:
            logger.warning(
                "adjacency table %s was built with model '%s', not '%s'",
                path, meta["model_id"], model_id,
            )
        with safe_open(path, framework="pt") as f:
            data = f.get_tensor("table")
        if tuple(data.shape) != (file_vocab, int(meta["k"])):
            raise ValueError(f"adjacency table {path}: header and tensor shape disagree")
        table = cls(vocab_size, k or data.shape[1], device, meta.get("model_id", ""))
        width = min(table.k, data.shape[1])
        table.table[:, :width] = data[:, :width].to(device=table.device, dtype=torch.int32)
        return table


# ---------------------------------------------------------------- corpus warm-up


def build_from_corpus(
    model_dir: str,
    corpus_path: str,
    k: int = 8,
    max_tokens: int | None = None,
    batch_size: int = 4,
    seq_len: int = 256,
    device: str = "cpu",
    progress: bool = True,
) -> AdjacencyTable:
    """Run the target (HF transformers, float32) over a corpus and record its
    top-k successors at every position, later text winning.

    Documents (``vllm_specplug.corpus``) are cut into ``seq_len`` windows
    and run up to ``batch_size`` full windows at a time;
    ``batch_size * seq_len * vocab`` float32 logits are the peak memory.
    Stops after ``max_tokens`` tokens if given.
    """
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specplug.corpus import CorpusError, iter_texts, run_target

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.to(device).eval()
    vocab = model.config.get_text_config().vocab_size
    model_id = os.path.basename(os.path.normpath(model_dir))
    table = AdjacencyTable(vocab, k, device, model_id=model_id)

    windows: list[list[int]] = []
    total = 0
    for text in iter_texts(corpus_path):
        ids = tokenizer(text)["input_ids"]
        for start in range(0, len(ids), seq_len):
            win = ids[start : start + seq_len]
            if max_tokens is not None:
                win = win[: max_tokens - total]
            if len(win) >= 2:  # a lone token's successor is unknown context-free
                windows.append(win)
                total += len(win)
            if max_tokens is not None and total >= max_tokens:
                break
        if max_tokens is not None and total >= max_tokens:
            break
    if not windows:
        raise CorpusError(f"{corpus_path}: no text to learn from")

    def topk(ids, mask):
        return model(input_ids=ids.to(device),
                     attention_mask=None if mask is None else mask.to(device)
                     ).logits.topk(k, dim=-1).indices

    bar = tqdm(total=total, unit="tok", desc="adjacency", disable=not progress)
    # Windows in corpus order, so later text wins.
    for win, top in run_target(topk, windows, batch_size * seq_len):
        table.update(torch.as_tensor(win, device=device), top)
        bar.update(len(win))
    bar.close()
    return table
