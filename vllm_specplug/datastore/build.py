"""Building a dense datastore (offline): documents from a corpus and/or the
target's own responses, the target's last hidden states, z-score + PCA,
ScaNN, and a manifest written last. The format and the runtime store are
in ``vllm_specplug.datastore.dense``.

Building streams: documents are tokenized and run through the model in
batches of at most ``chunk_tokens`` tokens (long documents in windows that
carry the KV cache), keys and values are appended to flat binary scratch
files, statistics are accumulated chunk by chunk (covariance in float64,
``H x H``), and the reduced keys are written through a memory map. Peak
memory is about ``chunk_tokens x H`` activations plus ``n x dims`` floats
for ScaNN.

Index choice follows ScaNN's rules of thumb (``scann/docs/algorithms.md``):
fewer than ``BRUTE_FORCE_MAX_KEYS`` (20k) keys -> exact brute force; fewer
than ``AH_ONLY_MAX_KEYS`` (100k) -> asymmetric hashing (2 dims per block,
anisotropic threshold 0.2) + exact float reordering; otherwise a k-means tree
with ``num_leaves ~ sqrt(n)`` in front of AH + reordering.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_specplug.corpus import CorpusError, chat_text, iter_prompts, iter_texts, run_target, user
from vllm_specplug.datastore.dense import (
    FORMAT,
    FORMAT_VERSION,
    L2_EPS,
    MANIFEST_FILE,
    ZSCORE_EPS,
    DatastoreError,
    _log,
    _sha256_file,
    tokenizer_fingerprint,
    transform_hidden,
)

__all__ = [
    "AH_ONLY_MAX_KEYS",
    "BRUTE_FORCE_MAX_KEYS",
    "IndexPlan",
    "build_dense_datastore",
    "fit_transform",
    "plan_index",
]

#: Below this many keys the index is exact brute force (ScaNN: "for a small
#: dataset (fewer than 20k points), use brute-force"). Exact search also makes
#: small stores bit-reproducible, which the tests rely on.
BRUTE_FORCE_MAX_KEYS = 20_000
#: Below this many keys: AH scoring + reordering, no partitioning (ScaNN:
#: "for a dataset with less than 100k points, score with AH, then rescore").
AH_ONLY_MAX_KEYS = 100_000

_RAW_KEYS = "raw_keys.f32.tmp"
_RAW_VALUES = "values.i32.tmp"


def _welford_merge(n_a, mean_a, m2_a, batch: np.ndarray):
    """Chan et al.'s parallel update of (count, mean, M2) with a batch."""
    b = batch.astype(np.float64)
    n_b = b.shape[0]
    if n_b == 0:
        return n_a, mean_a, m2_a
    mean_b = b.mean(axis=0)
    m2_b = ((b - mean_b) ** 2).sum(axis=0)
    n = n_a + n_b
    delta = mean_b - mean_a
    mean = mean_a + delta * (n_b / n)
    m2 = m2_a + m2_b + delta**2 * (n_a * n_b / n)
    return n, mean, m2


def _sample_chunks(raw: np.ndarray, rows: np.ndarray, chunk_rows: int) -> Iterator[np.ndarray]:
    for s in range(0, rows.shape[0], chunk_rows):
        yield np.asarray(raw[rows[s : s + chunk_rows]], dtype=np.float32)


def fit_transform(raw: np.ndarray, dims: int, max_sample: int, *, seed: int = 0,
                  chunk_rows: int = 65_536, eps: float = ZSCORE_EPS,
                  progress: bool = False) -> dict[str, np.ndarray]:
    """Fit z-score statistics and PCA on a uniform sample of ``raw`` rows.

    Streams over the sample twice (Welford mean/variance, then the float64
    covariance of the z-scored sample) and takes the top ``dims``
    eigenvectors. Each component's sign is fixed so that its largest-magnitude
    entry is positive (makes builds reproducible).
    """
    n, h = raw.shape
    if dims > h:
        raise DatastoreError(f"dims={dims} exceeds the hidden size {h}")
    if n < 2:
        raise DatastoreError(f"need at least 2 keys to fit the transform, got {n}")
    rng = np.random.default_rng(seed)
    m = min(n, max_sample)
    rows = np.arange(n) if m == n else np.sort(rng.choice(n, size=m, replace=False))

    cnt, mean, m2 = 0, np.zeros(h), np.zeros(h)
    for batch in _tq(_sample_chunks(raw, rows, chunk_rows), progress, "z-score stats",
                     math.ceil(m / chunk_rows)):
        cnt, mean, m2 = _welford_merge(cnt, mean, m2, batch)
    var = m2 / cnt
    std = np.sqrt(var + eps)

    cov = np.zeros((h, h))
    for batch in _tq(_sample_chunks(raw, rows, chunk_rows), progress, "PCA covariance",
                     math.ceil(m / chunk_rows)):
        z = (batch.astype(np.float64) - mean) / std
        cov += z.T @ z
    cov /= cnt
    evals, evecs = np.linalg.eigh(cov)
    order = np.argsort(evals)[::-1][:dims]
    comps = evecs[:, order]
    signs = np.sign(comps[np.argmax(np.abs(comps), axis=0), np.arange(dims)])
    comps = comps * np.where(signs == 0, 1.0, signs)
    total = float(np.trace(cov))
    ev = np.maximum(evals[order], 0.0)
    return {
        "mean": mean.astype(np.float32),
        "std": std.astype(np.float32),
        "components": comps.astype(np.float32),
        "explained_variance": ev,
        "explained_variance_ratio_sum": np.float64(ev.sum() / total if total > 0 else 0.0),
        "sample_size": np.int64(m),
    }


def _tq(it, enabled: bool, desc: str, total: int | None = None, unit: str = "it"):
    if not enabled:
        return it
    from tqdm import tqdm

    return tqdm(it, desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------------------
# ScaNN index
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexPlan:
    kind: str  # "brute_force" | "ah" | "tree_ah"
    num_leaves: int = 0
    leaves_to_search: int = 0
    training_sample_size: int = 0
    reorder: int = 0
    dims_per_block: int = 2
    anisotropic_threshold: float = 0.2

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def plan_index(n: int, kind: str = "auto", reorder: int = 256) -> IndexPlan:
    """ScaNN configuration sized from the number of keys (see module doc).

    Tree: ``num_leaves = round(sqrt(n))`` (at least 2, at most ``n // 10``
    so leaves keep ~10+ points), ``leaves_to_search = max(8, num_leaves // 20)``
    (~5% of the store before AH scoring; tune per query with the method's
    ``leaves_to_search``), k-means trained on up to 250k keys.
    """
    if kind == "auto":
        kind = ("brute_force" if n < BRUTE_FORCE_MAX_KEYS
                else "ah" if n < AH_ONLY_MAX_KEYS else "tree_ah")
    if kind not in ("brute_force", "ah", "tree_ah"):
        raise DatastoreError(f"unknown index kind '{kind}' (auto, brute_force, ah, tree_ah)")
    if kind == "brute_force":
        return IndexPlan("brute_force")
    if n < 16:
        raise DatastoreError(f"index '{kind}' needs at least 16 keys, got {n}; use brute_force")
    if kind == "ah":
        return IndexPlan("ah", training_sample_size=min(n, 100_000), reorder=reorder)
    if kind == "tree_ah":
        leaves = max(2, min(int(round(math.sqrt(n))), n // 10))
        return IndexPlan(
            "tree_ah",
            num_leaves=leaves,
            leaves_to_search=min(leaves, max(8, leaves // 20)),
            training_sample_size=min(n, 250_000),
            reorder=reorder,
        )
    raise AssertionError(kind)


def _build_searcher(keys: np.ndarray, plan: IndexPlan, num_neighbors: int):
    import scann

    b = scann.scann_ops_pybind.builder(keys, num_neighbors, "dot_product")
    if plan.kind == "brute_force":
        return b.score_brute_force().build()
    if plan.kind == "tree_ah":
        b = b.tree(num_leaves=plan.num_leaves, num_leaves_to_search=plan.leaves_to_search,
                   training_sample_size=plan.training_sample_size)
    b = b.score_ah(plan.dims_per_block,
                   anisotropic_quantization_threshold=plan.anisotropic_threshold,
                   training_sample_size=plan.training_sample_size)
    return b.reorder(plan.reorder).build()


# ---------------------------------------------------------------------------
# Model side
# ---------------------------------------------------------------------------


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
           "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def _load_model(model_path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in _DTYPES:
        raise DatastoreError(f"unknown dtype '{dtype}' (float32, bfloat16, float16)")
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, _DTYPES[dtype]))
    model.eval()
    return model, tok


def _decoder(model):
    get = getattr(model, "get_decoder", None)
    dec = get() if get is not None else None
    return dec if dec is not None and dec is not model else None


def _last_hidden(model, input_ids, attention_mask=None, past=None):
    """Hidden states fed to the LM head, ``[B, T, H]``, plus the new cache."""
    dec = _decoder(model)
    if dec is not None:
        out = dec(input_ids=input_ids, attention_mask=attention_mask,
                  past_key_values=past, use_cache=past is not None)
        return out.last_hidden_state, getattr(out, "past_key_values", None)
    out = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past,
                output_hidden_states=True, use_cache=past is not None)
    return out.hidden_states[-1], getattr(out, "past_key_values", None)


def check_lm_head_input(model, token_ids: list[int]) -> None:
    """Verify on a probe that the captured state is the LM head's input:
    ``lm_head(h) == logits`` (so e.g. a missing final norm is caught)."""
    import torch

    ids = torch.tensor([token_ids[:16]], dtype=torch.long)
    with torch.no_grad():
        h, _ = _last_hidden(model, ids)
        logits = model(input_ids=ids).logits
        mine = model.get_output_embeddings()(h)
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap:
            mine = torch.tanh(mine / cap) * cap
    err = (mine.float() - logits.float()).abs().max().item()
    scale = logits.float().abs().max().item() + 1e-6
    if not err <= 1e-3 * scale + 1e-4:
        raise DatastoreError(
            f"{type(model).__name__}: the decoder's last hidden state is not the LM head "
            f"input (max |lm_head(h) - logits| = {err:.3g})"
        )


def _hidden_forward(model, chunk_tokens: int):
    """``run_target``'s forward: float32 last hidden states ``[B, T, H]``; a
    lone document longer than ``chunk_tokens`` runs in windows that carry
    the KV cache."""
    import torch

    def forward(ids, mask):
        if mask is None and ids.shape[1] > chunk_tokens:
            from transformers import DynamicCache

            parts, past = [], DynamicCache()
            for s in range(0, ids.shape[1], chunk_tokens):
                h, past = _last_hidden(model, ids[:, s : s + chunk_tokens], past=past)
                parts.append(h)
            return torch.cat(parts, dim=1).float()
        return _last_hidden(model, ids, attention_mask=mask)[0].float()

    return forward


def _doc_hiddens(model, docs: list[list[int]], chunk_tokens: int) -> list[np.ndarray]:
    """``[len(doc), H]`` float32 hidden states of every document."""
    return [h.numpy() for _, h in run_target(_hidden_forward(model, chunk_tokens), docs,
                                             chunk_tokens)]


def _values_for(doc: list[int], n_next: int) -> np.ndarray:
    """``[len(doc) - 1, N]``: row t holds doc[t+1 : t+1+N], -1 padded."""
    arr = np.asarray(doc, dtype=np.int32)
    padded = np.concatenate([arr, np.full(n_next, -1, dtype=np.int32)])
    idx = np.arange(1, len(doc))[:, None] + np.arange(n_next)[None, :]
    return padded[idx]


def _generate_in_distribution(model, tok, prompts_file: str, max_new_tokens: int,
                              batch_size: int, progress: bool) -> tuple[list[list[int]], list[dict]]:
    """Greedy responses of the target (HF ``generate``, left padding), as
    token lists prompt + response (up to and including EOS)."""
    import torch

    prompts = [chat_text(tok, [user(turns[0])]) for _, turns in iter_prompts(prompts_file)]
    if not prompts:
        raise DatastoreError(f"no prompts in {prompts_file}")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad is None:
        pad = 0
    eos = model.generation_config.eos_token_id if model.generation_config else None
    if eos is None:
        eos = tok.eos_token_id
    eos_set = set(eos if isinstance(eos, list) else [eos]) - {None}
    docs, records = [], []
    it = range(0, len(prompts), batch_size)
    for s in _tq(it, progress, "generating", math.ceil(len(prompts) / batch_size)):
        enc = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts[s : s + batch_size]]
        longest = max(len(e) for e in enc)
        ids = torch.full((len(enc), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(enc), longest), dtype=torch.long)
        for i, e in enumerate(enc):
            ids[i, longest - len(e) :] = torch.tensor(e)
            mask[i, longest - len(e) :] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=pad,
                                 eos_token_id=list(eos_set) or None, temperature=None,
                                 top_p=None, top_k=None)
        for i, e in enumerate(enc):
            gen = out[i, longest:].tolist()
            resp = []
            for t in gen:
                resp.append(t)
                if t in eos_set:
                    break
            docs.append(e + resp)
            records.append({"prompt": prompts[s + i],
                            "response": tok.decode(resp, skip_special_tokens=True),
                            "response_ids": resp})
    return docs, records


# ---------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------


def build_dense_datastore(
    model: str,
    out: str,
    *,
    corpus: str | None = None,
    n_next: int = 20,
    dims: int = 64,
    max_sample: int = 1_000_000,
    chunk_tokens: int = 4096,
    max_doc_tokens: int = 1024,
    dtype: str = "float32",
    in_distribution: str | None = None,
    max_new_tokens: int = 128,
    gen_batch_size: int = 8,
    txt_docs: str = "line",
    index: str = "auto",
    reorder: int = 256,
    keep_raw_keys: bool = False,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    num_threads: int | None = None,
) -> dict[str, Any]:
    """Build a dense datastore in ``out``; returns the manifest.

    ``corpus`` (a text/jsonl file, see ``vllm_specplug.corpus``) and/or
    ``in_distribution`` (a prompt file whose greedy target responses, with
    their prompts, become documents) supply the documents. The directory is
    built next to ``out`` and renamed into place at the end, so a visible
    store is always complete. ``num_threads`` sets torch's intra-op threads
    for the build (restored afterwards); on a shared, busy CPU 1 thread can
    be several times faster than oversubscribed cores.
    """
    t_start = time.time()
    if corpus is None and in_distribution is None:
        raise DatastoreError("give a corpus file, an in-distribution prompt file, or both")
    _check_at_least(n_next=(n_next, 2), dims=(dims, 1), max_sample=(max_sample, 2),
                    chunk_tokens=(chunk_tokens, 2), max_doc_tokens=(max_doc_tokens, 2),
                    reorder=(reorder, 1))
    out = os.path.abspath(out)
    if os.path.exists(out) and os.listdir(out) and not overwrite:
        raise DatastoreError(f"{out} exists and is not empty (pass overwrite=True / --overwrite)")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    import torch

    old_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    os.chmod(work, 0o755)  # mkdtemp makes it 0700
    try:
        try:
            opts = _BuildOptions(
                model=model, corpus=corpus, n_next=n_next, dims=dims,
                max_sample=max_sample, chunk_tokens=chunk_tokens,
                max_doc_tokens=max_doc_tokens, dtype=dtype, in_distribution=in_distribution,
                max_new_tokens=max_new_tokens, gen_batch_size=gen_batch_size,
                txt_docs=txt_docs, index=index, reorder=reorder, keep_raw_keys=keep_raw_keys,
                seed=seed, progress=progress,
            )
            manifest = _build_into(work, opts, t_start)
        except CorpusError as e:  # the CLI reports DatastoreErrors in one line
            raise DatastoreError(str(e)) from None
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(old_threads)
    if progress:
        _log(f"built {out}: {manifest['counts']['keys']} keys, "
             f"{manifest['index']['kind']} index, {manifest['build_seconds']:.1f}s")
    return manifest


def _check_at_least(**limits: tuple[int, int]) -> None:
    """Each option ``name=(value, lowest)`` is at least its lowest value."""
    for name, (v, lo) in limits.items():
        if v < lo:
            raise DatastoreError(f"{name} must be >= {lo}, got {v}")


@dataclass(frozen=True)
class _BuildOptions:
    """``build_dense_datastore``'s options, as its build steps read them."""

    model: str
    corpus: str | None
    n_next: int
    dims: int
    max_sample: int
    chunk_tokens: int
    max_doc_tokens: int
    dtype: str
    in_distribution: str | None
    max_new_tokens: int
    gen_batch_size: int
    txt_docs: str
    index: str
    reorder: int
    keep_raw_keys: bool
    seed: int
    progress: bool


class _TokenDocs:
    """The documents' token ids (generated responses first, then the
    corpus), each cut to ``max_doc_tokens``; documents under 2 tokens are
    counted in ``skipped`` (nothing to predict)."""

    def __init__(self, gen_docs: list[list[int]], tok, opts: _BuildOptions) -> None:
        self.gen_docs, self.tok, self.opts = gen_docs, tok, opts
        self.skipped = 0

    def __iter__(self) -> Iterator[list[int]]:
        opts, tok = self.opts, self.tok
        for d in self.gen_docs:
            d = d[:opts.max_doc_tokens]
            if len(d) >= 2:
                yield d
            else:
                self.skipped += 1
        if opts.corpus is None:
            return
        for text in iter_texts(opts.corpus, tok, opts.txt_docs):
            # A chat-templated document already carries its BOS.
            add = not (tok.bos_token and text.startswith(tok.bos_token))
            ids = tok(text, add_special_tokens=add)["input_ids"][:opts.max_doc_tokens]
            if len(ids) >= 2:
                yield ids
            else:
                self.skipped += 1


def _build_into(work: str, opts: _BuildOptions, t_start: float) -> dict:
    """Build the store's files in ``work``: documents, target forward (raw
    keys and values), z-norm + PCA fit, reduced keys, index, manifest."""
    lm, tok = _load_model(opts.model, opts.dtype)
    hidden_size = int(getattr(lm.config, "hidden_size"))
    if opts.dims > hidden_size:
        raise DatastoreError(f"dims={opts.dims} exceeds the model's hidden size {hidden_size}")
    gen_docs, responses = _in_distribution_docs(work, lm, tok, opts)
    docs = _TokenDocs(gen_docs, tok, opts)
    doc_offsets, n_tokens = _forward_pass(work, lm, docs, opts)
    n = doc_offsets[-1]
    if n < max(opts.dims, 2):
        raise DatastoreError(f"corpus too small: {n} keys for {opts.dims} PCA dims")
    raw = np.memmap(os.path.join(work, _RAW_KEYS), dtype=np.float32, mode="r",
                    shape=(n, hidden_size))
    fit = fit_transform(raw, opts.dims, opts.max_sample, seed=opts.seed, progress=opts.progress)
    for name, key in (("zscore_mean", "mean"), ("zscore_std", "std"),
                      ("pca_components", "components"),
                      ("pca_explained_variance", "explained_variance")):
        np.save(os.path.join(work, f"{name}.npy"), fit[key])
    del raw
    _reduce_keys(work, n, hidden_size, fit, opts)
    np.save(os.path.join(work, "doc_offsets.npy"), np.asarray(doc_offsets, dtype=np.int64))
    plan, index_seconds = _build_index(work, n, opts)
    counts = {
        "docs": len(doc_offsets) - 1,
        "docs_skipped": docs.skipped,
        "tokens": n_tokens,
        "keys": n,
        "sample": int(fit["sample_size"]),
        "in_distribution_responses": len(responses),
    }
    manifest = _manifest(work, lm.config, tok, opts, fit, plan, counts,
                         t_start=t_start, index_seconds=index_seconds)
    tmp = os.path.join(work, MANIFEST_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    os.replace(tmp, os.path.join(work, MANIFEST_FILE))
    return manifest


def _in_distribution_docs(work: str, lm, tok, opts: _BuildOptions):
    """The prompts' greedy responses as documents (with their prompts),
    and the responses, also written to ``responses.jsonl``; none without
    ``in_distribution``."""
    if opts.in_distribution is None:
        return [], []
    gen_docs, responses = _generate_in_distribution(
        lm, tok, opts.in_distribution, opts.max_new_tokens, opts.gen_batch_size, opts.progress)
    with open(os.path.join(work, "responses.jsonl"), "w", encoding="utf-8") as f:
        for r in responses:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return gen_docs, responses


def _forward_pass(work: str, lm, docs: _TokenDocs, opts: _BuildOptions) -> tuple[list[int], int]:
    """Pass 1: the target's forward over every document, raw keys (last
    hidden states) and values (the next ``n_next`` tokens) to scratch files.
    Returns the documents' key offsets and the tokens read."""
    import torch

    vocab_size = int(lm.config.vocab_size)
    doc_offsets = [0]
    n_tokens = 0
    torch.manual_seed(opts.seed)
    bar = None
    if opts.progress:
        from tqdm import tqdm

        bar = tqdm(desc="target forward", unit="tok", file=sys.stderr, dynamic_ncols=True)
    with (open(os.path.join(work, _RAW_KEYS), "wb") as fk,
          open(os.path.join(work, _RAW_VALUES), "wb") as fv):
        for doc, h in run_target(_hidden_forward(lm, opts.chunk_tokens), iter(docs),
                                 opts.chunk_tokens):
            if len(doc_offsets) == 1:  # once, on the first document
                check_lm_head_input(lm, doc)
            if max(doc) >= vocab_size:
                raise DatastoreError(f"token id {max(doc)} >= model vocab size {vocab_size}")
            # The last position has no next token: it is not a key.
            fk.write(np.ascontiguousarray(h.numpy()[:-1], dtype=np.float32).tobytes())
            fv.write(_values_for(doc, opts.n_next).tobytes())
            doc_offsets.append(doc_offsets[-1] + len(doc) - 1)
            n_tokens += len(doc)
            if bar is not None:
                bar.update(len(doc))
    if bar is not None:
        bar.close()
    return doc_offsets, n_tokens


def _reduce_keys(work: str, n: int, hidden_size: int, fit: dict, opts: _BuildOptions) -> None:
    """Pass 2: the reduced keys (``keys.npy``), the values (``values.npy``)
    and, if asked, the raw keys, block by block; the scratch files go."""
    raw_path, val_path = os.path.join(work, _RAW_KEYS), os.path.join(work, _RAW_VALUES)
    raw = np.memmap(raw_path, dtype=np.float32, mode="r", shape=(n, hidden_size))
    values_raw = np.memmap(val_path, dtype=np.int32, mode="r", shape=(n, opts.n_next))
    chunk_rows = max(1024, (1 << 26) // (4 * hidden_size))  # ~64 MiB of raw keys
    keys = np.lib.format.open_memmap(os.path.join(work, "keys.npy"), mode="w+",
                                     dtype=np.float32, shape=(n, opts.dims))
    vals = np.lib.format.open_memmap(os.path.join(work, "values.npy"), mode="w+",
                                     dtype=np.int32, shape=(n, opts.n_next))
    rawk = (np.lib.format.open_memmap(os.path.join(work, "raw_keys.npy"), mode="w+",
                                      dtype=np.float32, shape=(n, hidden_size))
            if opts.keep_raw_keys else None)
    for s in _tq(range(0, n, chunk_rows), opts.progress, "reducing keys",
                 math.ceil(n / chunk_rows)):
        block = np.asarray(raw[s : s + chunk_rows])
        keys[s : s + len(block)] = transform_hidden(block, fit["mean"], fit["std"],
                                                    fit["components"])
        vals[s : s + len(block)] = values_raw[s : s + len(block)]
        if rawk is not None:
            rawk[s : s + len(block)] = block
    for arr in (keys, vals, rawk):
        if arr is not None:
            arr.flush()
    del raw, values_raw, rawk, vals, keys
    os.remove(raw_path)
    os.remove(val_path)


def _build_index(work: str, n: int, opts: _BuildOptions) -> tuple[IndexPlan, float]:
    """The ScaNN index over ``keys.npy``, serialized to ``scann/``; returns
    its plan and build seconds."""
    plan = plan_index(n, opts.index, opts.reorder)
    t_idx = time.time()
    keys_mem = np.ascontiguousarray(np.load(os.path.join(work, "keys.npy")))
    searcher = _build_searcher(keys_mem, plan, num_neighbors=min(32, n))
    scann_dir = os.path.join(work, "scann")
    os.makedirs(scann_dir)
    searcher.serialize(scann_dir, relative_path=True)
    return plan, time.time() - t_idx


def _file_hashes(work: str) -> dict[str, dict]:
    """Every file under ``work``: its sha256 and size."""
    files = {}
    for root, _, names in os.walk(work):
        for name in sorted(names):
            p = os.path.join(root, name)
            files[os.path.relpath(p, work)] = {"sha256": _sha256_file(p),
                                                "bytes": os.path.getsize(p)}
    return files


def _manifest(work: str, cfg, tok, opts: _BuildOptions, fit: dict, plan: IndexPlan,
              counts: dict, *, t_start: float, index_seconds: float) -> dict:
    """The store's manifest (``MANIFEST_FILE``): format, model, transform,
    counts, index, build options and the files' hashes."""
    import torch

    model = opts.model
    hidden_size, vocab_size = int(getattr(cfg, "hidden_size")), int(cfg.vocab_size)
    files = _file_hashes(work)
    cfg_path = os.path.join(model, "config.json")
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.time() - t_start, 3),
        "index_build_seconds": round(index_seconds, 3),
        "model": {
            "path": os.path.abspath(model) if os.path.exists(model) else model,
            "id": getattr(cfg, "_name_or_path", None) or model,
            "architectures": list(getattr(cfg, "architectures", None) or []),
            "config_sha256": _sha256_file(cfg_path) if os.path.isfile(cfg_path) else None,
            "hidden_size": hidden_size,
            "vocab_size": vocab_size,
            "dtype": _DTYPES[opts.dtype],
        },
        "tokenizer_hash": tokenizer_fingerprint(tok),
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "dims": opts.dims,
        "n_next": opts.n_next,
        "transform": {
            "zscore_eps": ZSCORE_EPS,
            "l2_eps": L2_EPS,
            "pca_explained_variance_ratio": float(fit["explained_variance_ratio_sum"]),
            "hidden": "last hidden state (LM head input, after the final norm)",
        },
        "counts": counts,
        "index": plan.to_dict(),
        "build_options": {
            "corpus": os.path.abspath(opts.corpus) if opts.corpus else None,
            "in_distribution": (os.path.abspath(opts.in_distribution)
                                if opts.in_distribution else None),
            "max_new_tokens": opts.max_new_tokens if opts.in_distribution else None,
            "n_next": opts.n_next, "dims": opts.dims, "max_sample": opts.max_sample,
            "chunk_tokens": opts.chunk_tokens, "max_doc_tokens": opts.max_doc_tokens,
            "dtype": opts.dtype, "txt_docs": opts.txt_docs, "index": opts.index,
            "reorder": opts.reorder, "keep_raw_keys": opts.keep_raw_keys, "seed": opts.seed,
            "num_threads": torch.get_num_threads(),
        },
        "files": files,
    }
    manifest["total_bytes"] = sum(f["bytes"] for f in files.values())
    return manifest
