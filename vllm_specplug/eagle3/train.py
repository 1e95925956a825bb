"""Train an EAGLE-3 head on a data folder made by :mod:`vllm_specplug.eagle3.data`.

Recipe (EAGLE-3, "training-time test"):

* draft vocabulary: the ``draft_vocab_size`` most frequent response tokens of
  the training split (``0`` = the full target vocabulary), as ``d2t``/``t2d``;
* the head's ``lm_head`` starts from the target's ``lm_head`` rows of that
  vocabulary and its ``norm`` from the target's final norm; the rest is
  random (std 0.02); the token embedding is the target's, frozen;
* every sample is unrolled for ``ttt_steps`` draft steps
  (:meth:`Eagle3Draft.unroll`): step 0 sees the target's fused features, step
  ``k`` the head's own step ``k-1`` outputs, with vLLM's attention pattern;
* loss of step ``k``: ``kl`` (default) = cross-entropy against the target's
  next-token distribution restricted to the draft vocabulary (positions whose
  target top-1 is outside it are skipped, as in EAGLE-3), or ``ce`` = against
  the data tokens; only response positions count; step weights
  ``step_weight ** k`` (0.8 as EAGLE-3);
* AdamW, linear warm-up then cosine decay, gradient clipping;
* metrics per step ``k``: accuracy (draft top-1 == target top-1 / data
  token), chain accuracy (steps ``0..k`` all right) and the estimated mean
  accepted length with ``n`` speculative tokens, ``1 + sum_{k<n} chain_k``.

Output folder ``OUT``: ``config.json`` + ``model.safetensors`` (the head, as
vLLM 0.32 loads it with ``{"method": "eagle3", "model": OUT}``),
``specplug_eagle3.json`` (training metadata), ``curves.json`` and
``curves.png``; resumable state in ``OUT/checkpoint/state.pt`` (or
``--checkpoint-dir``).  Running the same command again resumes.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["train", "load_target_weights", "plot_curves"]


def _log(msg: str) -> None:
    print(f"[eagle3.train] {msg}", flush=True)


def load_target_weights(target: str) -> dict[str, Any]:
    """embed_tokens / lm_head / final norm of a HF checkpoint folder."""
    import torch
    from safetensors import safe_open

    files: dict[str, str] = {}
    index = os.path.join(target, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = json.load(f)["weight_map"]
    else:
        single = os.path.join(target, "model.safetensors")
        with safe_open(single, "pt") as f:
            files = {k: "model.safetensors" for k in f.keys()}

    def get(*names: str):
        for n in names:
            if n in files:
                with safe_open(os.path.join(target, files[n]), "pt") as f:
                    return f.get_tensor(n).float()
        return None

    embed = get("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                "language_model.model.embed_tokens.weight")
    head = get("lm_head.weight", "language_model.lm_head.weight")
    norm = get("model.norm.weight", "model.language_model.norm.weight",
               "language_model.model.norm.weight")
    if embed is None:
        raise KeyError(f"no embed_tokens in {target}")
    return {"embed": embed, "lm_head": head if head is not None else embed, "norm": norm,
            "dtype": torch.float32}


# --------------------------------------------------------------------------
# per-sample loss
# --------------------------------------------------------------------------


def _sample_targets(s: dict[str, Any], target_head, draft_rows, loss: str):
    """Cached per sample: target top-1 for positions P-1..T-1 (full vocab)."""
    import torch

    if "t_top1" not in s:
        with torch.no_grad():
            last = s["last"].float()
            s["t_top1"] = (last @ target_head.T).argmax(-1) if loss == "kl" else None
    return s["t_top1"]


def _step_rows(t_len: int, p_len: int, steps: int, max_len: int):
    t_len = min(t_len, max_len)
    row_start = max(0, p_len - 2 - (steps - 1))
    return t_len, row_start


def sample_forward(model, s: dict[str, Any], *, steps: int, loss: str, target_head,
                   draft_rows, max_len: int, weights: list[float], norms: list[float] | None,
                   train: bool):
    """One sample's unrolled forward; returns (weighted loss or None, stats).

    stats per step k: loss_sum, n_loss, correct, n_acc, chain_correct, n_chain.
    ``norms[k]`` divides step k's summed loss (the batch's position count).
    """
    import torch
    import torch.nn.functional as F

    tokens = s["input_ids"]
    t_len, row_start = _step_rows(tokens.shape[0], s["prompt_len"], steps, max_len)
    tokens = tokens[:t_len]
    p_len = s["prompt_len"]
    mask = s["loss_mask"][:t_len]
    stats = [dict(loss_sum=0.0, n_loss=0, correct=0, n_acc=0, chain=0, n_chain=0)
             for _ in range(steps)]
    n_rows = t_len - 2 - row_start
    if n_rows <= 0 or t_len - p_len <= 0:
        return None, stats
    top1 = _sample_targets(s, target_head, draft_rows, loss)
    tp_all = None
    if loss == "kl":  # target distribution over the draft vocab, positions P-1..
        with torch.no_grad():
            tp_all = torch.softmax(s["last"][:t_len - (p_len - 1)].float() @ draft_rows.T, -1)
    outs = model.unroll(tokens, s["aux"][:t_len], steps, row_start)
    rows = torch.arange(row_start, t_len - 2)
    total = None
    chain_ok = torch.ones(n_rows, dtype=torch.bool)
    chain_valid = torch.ones(n_rows, dtype=torch.bool)
    for k in range(steps):
        idx = rows + k + 2  # label index
        inb = idx <= t_len - 1
        idx_c = idx.clamp(max=t_len - 1)
        valid = inb & mask[idx_c]
        if loss == "kl":
            ref = top1[(idx_c - 1 - (p_len - 1)).clamp(min=0)]
        else:
            ref = tokens[idx_c]
        chain_valid &= valid
        if not bool(valid.any()):
            chain_ok &= valid
            continue
        sel = valid.nonzero().squeeze(-1)
        logits = model.logits(outs[k][sel]).float()
        pred = logits.argmax(-1) + model.d2t[logits.argmax(-1)]
        ok = torch.zeros(n_rows, dtype=torch.bool)
        ok[sel] = pred == ref[sel]
        chain_ok &= ok
        st = stats[k]
        st["correct"] += int(ok.sum())
        st["n_acc"] += int(valid.sum())
        st["chain"] += int((chain_ok & chain_valid).sum())
        st["n_chain"] += int(chain_valid.sum())
        in_vocab = model.target_to_draft[ref[sel]] >= 0
        if not bool(in_vocab.any()):
            continue
        lsel = sel[in_vocab]
        lg = logits[in_vocab]
        logp = F.log_softmax(lg, dim=-1)
        if loss == "kl":
            tp = tp_all[idx_c[lsel] - 1 - (p_len - 1)]
            lk = -(tp * logp).sum(-1)
        else:
            lk = F.nll_loss(logp, model.target_to_draft[ref[lsel]], reduction="none")
        st["loss_sum"] += float(lk.detach().sum())
        st["n_loss"] += int(lk.shape[0])
        if train:
            denom = norms[k] if norms else max(1, lk.shape[0])
            term = weights[k] * lk.sum() / max(1.0, denom)
            total = term if total is None else total + term
    return total, stats


def _count_positions(s: dict[str, Any], steps: int, loss: str, model, target_head,
                     draft_rows, max_len: int) -> list[int]:
    """Loss positions of each step for one sample (for the batch normalizer)."""
    import torch

    tokens = s["input_ids"]
    t_len, row_start = _step_rows(tokens.shape[0], s["prompt_len"], steps, max_len)
    p_len = s["prompt_len"]
    mask = s["loss_mask"][:t_len]
    out = []
    if t_len - 2 - row_start <= 0:
        return [0] * steps
    top1 = _sample_targets(s, target_head, draft_rows, loss)
    rows = torch.arange(row_start, t_len - 2)
    for k in range(steps):
        idx = rows + k + 2
        idx_c = idx.clamp(max=t_len - 1)
        valid = (idx <= t_len - 1) & mask[idx_c]
        ref = top1[(idx_c - 1 - (p_len - 1)).clamp(min=0)] if loss == "kl" else tokens[idx_c]
        valid &= model.target_to_draft[ref] >= 0
        out.append(int(valid.sum()))
    return out


def _merge(acc: list[dict], st: list[dict]) -> None:
    for a, b in zip(acc, st):
        for k, v in b.items():
            a[k] = a.get(k, 0) + v


def _summary(acc: list[dict], weights: list[float]) -> dict[str, Any]:
    loss_k = [a["loss_sum"] / a["n_loss"] if a.get("n_loss") else float("nan") for a in acc]
    acc_k = [a["correct"] / a["n_acc"] if a.get("n_acc") else float("nan") for a in acc]
    chain_k = [a["chain"] / a["n_chain"] if a.get("n_chain") else float("nan") for a in acc]
    finite = [(w, v) for w, v in zip(weights, loss_k) if v == v]
    out = {"loss": sum(w * v for w, v in finite), "loss_k": loss_k, "acc_k": acc_k,
           "chain_acc_k": chain_k}
    for n in (3, 4, len(acc)):
        vals = [c for c in chain_k[:n] if c == c]
        out[f"est_accept_len@{n}"] = 1.0 + sum(vals)
    return out


def evaluate(model, samples, **kw) -> dict[str, Any]:
    import torch

    acc: list[dict] = [dict() for _ in range(kw["steps"])]
    with torch.no_grad():
        for s in samples:
            _, st = sample_forward(model, s, norms=None, train=False, **kw)
            _merge(acc, st)
    return _summary(acc, kw["weights"])


# --------------------------------------------------------------------------
# curves
# --------------------------------------------------------------------------


def plot_curves(history: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr, ev = history.get("train", []), history.get("eval", [])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    if tr:
        ax.plot([h["update"] for h in tr], [h["loss"] for h in tr], label="train", alpha=0.7)
    if ev:
        ax.plot([h["update"] for h in ev], [h["loss"] for h in ev], "o-", label="eval")
    ax.set_xlabel("update")
    ax.set_ylabel("weighted loss")
    ax.set_title("loss")
    ax.legend()
    ax = axes[1]
    src = ev if ev else tr
    if src:
        n = len(src[-1]["acc_k"])
        for k in range(n):
            ax.plot([h["update"] for h in src], [h["acc_k"][k] for h in src], label=f"step {k}")
    ax.set_xlabel("update")
    ax.set_ylabel("top-1 accuracy")
    ax.set_title(f"per-step accuracy ({'eval' if ev else 'train'})")
    ax.legend(fontsize=7)
    ax = axes[2]
    if src:
        for key in ("est_accept_len@3", "est_accept_len@4"):
            ax.plot([h["update"] for h in src], [h.get(key, float("nan")) for h in src],
                    label=key)
    ax.set_xlabel("update")
    ax.set_title("estimated mean accepted length (chain accuracy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=90)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


def _lr_at(update: int, total: int, warmup: int, lr: float, min_ratio: float = 0.1) -> float:
    if update < warmup:
        return lr * (update + 1) / max(1, warmup)
    frac = (update - warmup) / max(1, total - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@dataclass(frozen=True)
class TrainConfig:
    """How ``train`` trains a head (``specplug eagle3 train``'s options)."""

    target: str | None = None
    """Target model folder; None: the one recorded in the data."""
    draft_vocab_size: int = 0
    """Draft vocabulary (most frequent response tokens); 0: the target's."""
    ttt_steps: int = 7
    """Unrolled draft steps (training-time test)."""
    step_weight: float = 0.8
    """Loss weight of step ``k`` is ``step_weight ** k``."""
    loss: str = "kl"
    """``kl`` (to the target's distribution) or ``ce`` (to its argmax)."""
    epochs: float = 1.0
    """Passes over the training samples (unless ``max_updates``)."""
    max_updates: int | None = None
    """Updates to run; overrides ``epochs``."""
    batch_size: int = 8
    """Samples per update."""
    lr: float = 5e-4
    """Peak learning rate (AdamW)."""
    warmup: int = 20
    """Linear warm-up updates."""
    weight_decay: float = 0.0
    clip: float = 0.5
    """Gradient-norm clip."""
    max_len: int = 2048
    """Samples are truncated to this many tokens."""
    eval_samples: int = 16
    """Held-out samples (at most a fifth of the data)."""
    eval_every: int = 50
    save_every: int = 50
    """Updates between checkpoints (each one evaluates)."""
    log_every: int = 5
    head_dtype: str = "float16"
    """dtype of the saved head."""
    seed: int = 0
    threads: int | None = None
    """torch intra-op threads; None: torch's default."""
    checkpoint_dir: str | None = None
    """Resumable state; None: ``OUT/checkpoint``."""
    max_shards: int | None = None
    """Use only the first shards of the data."""
    intermediate_size: int | None = None
    """MLP width; None: the target's."""
    max_minutes: float | None = None
    """Stop (and save, resumable) after this long."""
    init_from: str | None = None
    """A saved head folder to start from (its weights, draft vocabulary and
    shape; ``draft_vocab_size`` and ``intermediate_size`` are then taken
    from it), e.g. to go on training a shipped head on more data. Ignored
    when a checkpoint in ``out_dir`` resumes a run."""
    progress: bool = True
    """Show a progress bar."""


@dataclass
class _Run:
    """One training run's state: what ``train``'s steps share."""

    tc: TrainConfig
    out_dir: str
    ckpt: str
    """Resumable state file."""
    target: str
    tcfg: dict[str, Any]
    """The target's config."""
    manifest: dict[str, Any]
    """The data folder's manifest."""
    train_set: list
    eval_set: list
    cfg: dict[str, Any]
    """The head's config."""
    coverage: float | None
    """Share of response tokens the draft vocabulary holds."""
    init_meta: dict[str, Any] | None
    """The starting head's record (``TrainConfig.init_from``)."""
    model: Any
    opt: Any
    params: list
    """The trained parameters (the embedding is frozen)."""
    kw: dict[str, Any]
    """``sample_forward``/``evaluate`` arguments."""
    total: int
    """Updates the run is to reach."""
    update: int
    history: dict[str, list]
    resumed: bool
    """Started from a checkpoint (its history holds the first evaluation)."""


def train(data_dir: str, out_dir: str, tc: TrainConfig | None = None) -> dict[str, Any]:
    """Train (or resume) a head on the data folder ``data_dir`` into
    ``out_dir``; returns the final metrics."""
    tc = tc or TrainConfig()
    import torch

    if tc.threads:
        torch.set_num_threads(tc.threads)
    if tc.loss not in ("kl", "ce"):
        raise ValueError("loss must be 'kl' or 'ce'")
    t_start = time.time()
    run = _start_run(data_dir, out_dir, tc)
    if not run.resumed and run.eval_set:
        run.history["eval"].append({"update": 0, **evaluate(run.model, run.eval_set, **run.kw)})
        _log(f"eval @0: {_fmt(run.history['eval'][-1])}")
    _train_loop(run, t_start)
    ev = _save(run, final=run.update >= run.total)
    _log(f"saved head to {out_dir} at update {run.update}/{run.total}"
         + (f"; eval: {_fmt(ev)}" if ev else ""))
    return {"update": run.update, "total": run.total, "eval": ev, "history": run.history}


def _start_run(data_dir: str, out_dir: str, tc: TrainConfig) -> _Run:
    """Load the data and the target, then resume the checkpoint, start from
    ``init_from`` or start fresh."""
    import torch

    from vllm_specplug.eagle3 import target_config
    from vllm_specplug.eagle3.data import ShardData
    from vllm_specplug.eagle3.model import load_head

    data = ShardData(data_dir, max_shards=tc.max_shards)
    man = data.manifest
    target = tc.target or man["target"]
    tcfg = target_config(target)
    eval_set, train_set = _split_samples(list(data.samples), tc)
    if not train_set:
        raise ValueError(f"no training samples in {data_dir}")
    tw = load_target_weights(target)
    ckpt = os.path.join(tc.checkpoint_dir or os.path.join(out_dir, "checkpoint"), "state.pt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False) if os.path.exists(ckpt) else None
    init = None
    if state is None and tc.init_from:
        init = load_head(tc.init_from, tw["embed"])
        _check_init_head(init.cfg, tcfg, tuple(man["aux_layers"]), tc.init_from)
    d2t, t2d, cfg, coverage = _draft_vocab(tc, state, init, train_set, tcfg,
                                           tuple(man["aux_layers"]))
    model, draft_rows = _build_model(tc, cfg, tw, d2t, t2d, int(tcfg["vocab_size"]), state, init)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    updates_per_epoch = math.ceil(len(train_set) / tc.batch_size)
    total = tc.max_updates if tc.max_updates is not None else max(1, int(tc.epochs * updates_per_epoch))
    weights = [tc.step_weight ** k for k in range(tc.ttt_steps)]
    kw = dict(steps=tc.ttt_steps, loss=tc.loss, target_head=tw["lm_head"], draft_rows=draft_rows,
              max_len=tc.max_len, weights=weights)
    run = _Run(tc=tc, out_dir=out_dir, ckpt=ckpt, target=target, tcfg=tcfg, manifest=man,
               train_set=train_set, eval_set=eval_set, cfg=cfg, coverage=coverage,
               init_meta=state.get("init_from") if state else
               _head_record(tc.init_from) if init else None,
               model=model, opt=opt, params=params, kw=kw, total=total,
               update=state["update"] if state else 0,
               history=state["history"] if state else {"train": [], "eval": []},
               resumed=state is not None)
    n_params = sum(p.numel() for p in model.parameters())
    _log(f"{len(train_set)} train / {len(eval_set)} eval samples; draft vocab "
         f"{cfg['draft_vocab_size']} (covers {coverage:.1%} of response tokens); "
         f"{n_params / 1e6:.2f}M params; {total} updates of {tc.batch_size} samples; "
         f"start at update {run.update}")
    return run


def _split_samples(samples: list, tc: TrainConfig) -> tuple[list, list]:
    """Held-out and training samples, by a seeded shuffle (at most a fifth
    held out)."""
    order = list(range(len(samples)))
    random.Random(tc.seed).shuffle(order)
    n_eval = min(tc.eval_samples, max(0, len(samples) // 5))
    return [samples[i] for i in order[:n_eval]], [samples[i] for i in order[n_eval:]]


def _draft_vocab(tc: TrainConfig, state, init, train_set, tcfg: dict[str, Any],
                 aux: tuple[int, ...]):
    """``(d2t, t2d, head config, coverage)``: the checkpoint's, the starting
    head's, or a fresh draft vocabulary picked from the training samples."""
    from vllm_specplug.eagle3.data import token_counts
    from vllm_specplug.eagle3.model import build_head_config, vocab_mapping

    vocab = int(tcfg["vocab_size"])
    if state is not None:
        return state["d2t"], state["t2d"], state["config"], state.get("vocab_coverage")
    if init is not None:
        return init.d2t, init.t2d, dict(init.cfg), _coverage(token_counts(train_set, vocab), init.t2d)
    used, coverage = _pick_draft_tokens(tc, train_set, tcfg)
    d2t, t2d = vocab_mapping(used, vocab)
    cfg = build_head_config(tcfg, aux, len(set(used)),
                            intermediate_size=tc.intermediate_size, dtype=tc.head_dtype)
    return d2t, t2d, cfg, coverage


def _pick_draft_tokens(tc: TrainConfig, train_set, tcfg: dict[str, Any]) -> tuple[list[int], float]:
    """The draft vocabulary's target token ids (``draft_vocab_size`` most
    frequent response tokens, end-of-turn tokens always in) and the share of
    response tokens they cover."""
    import torch

    from vllm_specplug.eagle3.data import token_counts

    vocab = int(tcfg["vocab_size"])
    vd = vocab if not tc.draft_vocab_size or tc.draft_vocab_size >= vocab else int(tc.draft_vocab_size)
    if vd >= vocab:
        return list(range(vocab)), 1.0
    counts = token_counts(train_set, vocab)
    all_counts = token_counts(train_set, vocab, response_only=False)
    # response-token frequency first; ties (notably unseen tokens) by
    # frequency in the whole samples (prompts too), then by id
    key = counts.double() * (int(all_counts.max()) + 1) + all_counts.double()
    used = torch.argsort(key, descending=True, stable=True)[:vd].tolist()
    specials: list[int] = []
    for special in (tcfg.get("eos_token_id"), tcfg.get("bos_token_id")):
        specials += [int(x) for x in (special if isinstance(special, list) else [special])
                     if x is not None]
    missing = [sp for sp in dict.fromkeys(specials) if sp not in set(used)]
    if missing:  # end-of-turn tokens always stay draftable
        used = used[:vd - len(missing)] + missing
    return used, _coverage(counts, torch.tensor(used))


def _build_model(tc: TrainConfig, cfg, tw, d2t, t2d, vocab: int, state, init):
    """The head, with the checkpoint's, the starting head's or the target's
    weights, and the target ``lm_head`` rows of its draft vocabulary."""
    import torch

    from vllm_specplug.eagle3.model import Eagle3Draft

    torch.manual_seed(tc.seed)
    partial = cfg["draft_vocab_size"] != vocab
    model = Eagle3Draft(cfg, tw["embed"], d2t if partial else None, t2d if partial else None)
    draft_rows = tw["lm_head"][(torch.arange(cfg["draft_vocab_size"]) + model.d2t).long()]
    if state is not None:
        model.load_state_dict(state["model"])
    elif init is not None:
        model.load_state_dict(init.state_dict())
    else:
        model.init_from_target(tw["lm_head"], tw["norm"])
    return model, draft_rows


def _train_loop(run: _Run, t_start: float) -> None:
    """Updates until ``run.total`` or the time budget, logging, evaluating
    and checkpointing on the way."""
    from tqdm import tqdm

    tc = run.tc
    run.model.train()
    # deterministic per-epoch order, resumable at any update
    bar = tqdm(total=run.total, initial=run.update, desc="train", unit="upd",
               disable=not tc.progress)
    window: list[dict] = [dict() for _ in range(tc.ttt_steps)]
    t_win = time.time()
    while run.update < run.total:
        cur_lr = _one_update(run, window)
        bar.update(1)
        if run.update % tc.log_every == 0 or run.update == run.total:
            _log_window(run, window, cur_lr, (time.time() - t_win) / tc.log_every, bar)
            window = [dict() for _ in range(tc.ttt_steps)]
            t_win = time.time()
        if run.update % tc.save_every == 0 and run.update < run.total:
            ev = _save(run)
            if ev:
                _log(f"eval @{run.update}: {_fmt(ev)}")
            run.model.train()
        if tc.max_minutes is not None and (time.time() - t_start) / 60 > tc.max_minutes:
            _log(f"time budget reached at update {run.update}; saving (resume by rerunning)")
            break
    bar.close()


def _one_update(run: _Run, window: list[dict]) -> float:
    """One optimizer update on the next batch of the epoch's seeded order;
    its per-step stats go into ``window``. Returns the learning rate used."""
    import torch

    tc, model = run.tc, run.model
    epoch, pos = divmod(run.update * tc.batch_size, len(run.train_set))
    perm = list(range(len(run.train_set)))
    random.Random(tc.seed * 1000 + epoch).shuffle(perm)
    batch = [run.train_set[i] for i in perm[pos:pos + tc.batch_size]]
    counts = [_count_positions(s, tc.ttt_steps, tc.loss, model, run.kw["target_head"],
                               run.kw["draft_rows"], tc.max_len) for s in batch]
    norms = [float(sum(c[k] for c in counts)) for k in range(tc.ttt_steps)]
    cur_lr = _lr_at(run.update, run.total, tc.warmup, tc.lr)
    for g in run.opt.param_groups:
        g["lr"] = cur_lr
    run.opt.zero_grad(set_to_none=True)
    for s in batch:
        lossv, st = sample_forward(model, s, norms=norms, train=True, **run.kw)
        if lossv is not None:
            lossv.backward()
        _merge(window, st)
    torch.nn.utils.clip_grad_norm_(run.params, tc.clip)
    run.opt.step()
    run.update += 1
    return cur_lr


def _log_window(run: _Run, window: list[dict], cur_lr: float, sec_per_update: float,
                bar) -> None:
    """The last ``log_every`` updates' summary, into the history and the bar."""
    sm = _summary(window, run.kw["weights"])
    run.history["train"].append({"update": run.update,
                                 "epoch": run.update * run.tc.batch_size / len(run.train_set),
                                 "lr": cur_lr, "sec_per_update": sec_per_update, **sm})
    bar.set_postfix(loss=f"{sm['loss']:.3f}", acc0=f"{sm['acc_k'][0]:.2f}",
                    tau4=f"{sm.get('est_accept_len@4', float('nan')):.2f}")


def _save(run: _Run, final: bool = False) -> dict[str, Any]:
    """Evaluate, write the resumable state, the head and its curves;
    returns the evaluation (empty without held-out samples)."""
    import torch

    from vllm_specplug.eagle3.model import save_head

    tc, out_dir = run.tc, run.out_dir
    os.makedirs(os.path.dirname(run.ckpt), exist_ok=True)
    ev = evaluate(run.model, run.eval_set, **run.kw) if run.eval_set else {}
    if ev:
        run.history["eval"].append({"update": run.update, **ev})
    torch.save({"model": run.model.state_dict(), "optimizer": run.opt.state_dict(),
                "update": run.update, "history": run.history, "config": run.cfg,
                "d2t": run.model.d2t, "t2d": run.model.t2d, "vocab_coverage": run.coverage,
                "init_from": run.init_meta}, run.ckpt + ".tmp")
    os.replace(run.ckpt + ".tmp", run.ckpt)
    save_head(run.model, out_dir, dtype=tc.head_dtype, extra_meta=_train_meta(run, ev, final))
    with open(os.path.join(out_dir, "curves.json.tmp"), "w", encoding="utf-8") as f:
        json.dump(run.history, f)
    os.replace(os.path.join(out_dir, "curves.json.tmp"), os.path.join(out_dir, "curves.json"))
    plot_curves(run.history, os.path.join(out_dir, "curves.png"))
    return ev


def _train_meta(run: _Run, ev: dict[str, Any], final: bool) -> dict[str, Any]:
    """The training record saved beside the head (``TRAIN_META_NAME``)."""
    from vllm_specplug.eagle3 import TARGET_MATCH_KEYS

    tc, man = run.tc, run.manifest
    return {
        "target": os.path.basename(os.path.normpath(run.target)),
        "target_config": {k: run.tcfg.get(k) for k in TARGET_MATCH_KEYS},
        "data": {k: man.get(k) for k in ("num_prompts", "num_samples", "num_tokens",
                                         "num_response_tokens", "max_new_tokens",
                                         "temperature", "aux_layers")},
        "train": {"updates": run.update, "total_updates": run.total,
                  "batch_size": tc.batch_size, "ttt_steps": tc.ttt_steps,
                  "step_weight": tc.step_weight, "loss": tc.loss, "lr": tc.lr,
                  "draft_vocab_size": run.cfg["draft_vocab_size"],
                  "vocab_coverage": run.coverage, "train_samples": len(run.train_set),
                  "eval_samples": len(run.eval_set), "init_from": run.init_meta},
        "eval": ev, "final": final,
    }


def _coverage(counts, draft_ids) -> float:
    """Share of the counted response tokens that the draft vocabulary holds."""
    return float(counts[draft_ids].sum()) / max(1, int(counts.sum()))


def _check_init_head(cfg: dict[str, Any], tcfg: dict[str, Any], aux: tuple[int, ...],
                     path: str) -> None:
    """A head to start from must fit the target and the data's aux layers."""
    want = {"vocab_size": int(tcfg["vocab_size"]), "target_hidden_size": int(tcfg["hidden_size"]),
            "eagle_aux_hidden_state_layer_ids": list(aux)}
    got = {"vocab_size": cfg.get("vocab_size"),
           "target_hidden_size": cfg.get("target_hidden_size", cfg.get("hidden_size")),
           "eagle_aux_hidden_state_layer_ids": cfg.get("eagle_aux_hidden_state_layer_ids")}
    bad = [f"{k} {got[k]} (target/data: {v})" for k, v in want.items() if got[k] != v]
    if bad:
        raise ValueError(f"--init-from {path}: head does not fit: " + "; ".join(bad))


def _head_record(path: str) -> dict[str, Any]:
    """What a starting head's own training record says (kept in ours)."""
    from vllm_specplug.eagle3.model import TRAIN_META_NAME

    rec: dict[str, Any] = {"path": os.path.abspath(path)}
    try:
        with open(os.path.join(path, TRAIN_META_NAME), encoding="utf-8") as f:
            old = json.load(f)
        rec.update({k: old.get(k) for k in ("data", "train", "eval")})
    except (OSError, ValueError):
        pass
    return rec


def _fmt(ev: dict[str, Any]) -> str:
    acc = ",".join(f"{a:.2f}" for a in ev.get("acc_k", []))
    return (f"loss {ev.get('loss', float('nan')):.3f} acc [{acc}] "
            f"tau@4 {ev.get('est_accept_len@4', float('nan')):.2f}")
