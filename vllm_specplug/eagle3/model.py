"""The EAGLE-3 draft head in plain torch, and its vLLM checkpoint format.

Architecture (what vLLM 0.32's ``llama_eagle3.Eagle3LlamaForCausalLM`` runs):

* ``fc``: ``Linear(n_aux * H_target -> H, bias=False)`` fuses the target's
  residual stream after ``n_aux`` layers (``eagle_aux_hidden_state_layer_ids``,
  concatenated in ascending layer order; layer ``L`` means "after ``L``
  decoder layers", 0 = the embeddings, ``num_hidden_layers`` = before the
  final norm);
* one Llama decoder layer (``midlayer``) whose attention input is
  ``[input_layernorm(embed(token)); hidden_norm(hidden)]`` (2H wide), with the
  residual taken from the un-normed ``hidden``; then the usual
  ``post_attention_layernorm`` + SwiGLU MLP;
* ``norm`` and ``lm_head`` over the draft vocabulary.  When the draft
  vocabulary is a subset of the target's, ``d2t[d] = target_id - d`` maps
  draft id ``d`` to the target id, and ``t2d`` is a bool mask over the target
  vocabulary (vLLM reads ``d2t``, ignores ``t2d``).
* the token embedding is the target's (frozen, never saved: vLLM shares the
  target's ``embed_tokens`` when the checkpoint has none).

How vLLM feeds it (``v1/spec_decode/llm_base_proposer.py``): on the first
draft pass, row ``i`` (position ``i``) gets token ``x[i+1]`` and
``fc(aux[i])``; its output predicts ``x[i+2]``.  On draft step ``k >= 1``
the row at position ``i+k`` gets the previously drafted token and the
draft's own *pre-norm* output of step ``k-1`` as ``hidden``, and attends to
the first-pass KV entries at positions ``<= i`` plus its own chain's entries
of steps ``1..k``.  :meth:`Eagle3Draft.unroll` reproduces exactly that
("training-time test").
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "Eagle3Draft",
    "build_head_config",
    "default_aux_layers",
    "load_head",
    "save_head",
    "vocab_mapping",
]

HEAD_ARCH = "LlamaForCausalLMEagle3"
WEIGHTS_NAME = "model.safetensors"
TRAIN_META_NAME = "specplug_eagle3.json"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 aux layers, ``(2, N // 2, N - 3)``, when they are
    three distinct valid layers (N >= 7); else evenly spaced ``0..N`` (tiny
    test models)."""
    d = (2, num_layers // 2, num_layers - 3)
    if len(set(d)) == 3 and all(0 <= x <= num_layers for x in d) and list(d) == sorted(d):
        return d
    lo, mid, hi = 0, num_layers // 2, num_layers
    if len({lo, mid, hi}) < 3:
        raise ValueError(f"need >= 2 target layers for EAGLE-3, got {num_layers}")
    return (lo, mid, hi)


def vocab_mapping(used_ids: list[int], target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]) for a draft vocabulary ``used_ids``."""
    ids = sorted(set(int(i) for i in used_ids))
    d2t = torch.tensor([t - d for d, t in enumerate(ids)], dtype=torch.int64)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[torch.tensor(ids, dtype=torch.long)] = True
    return d2t, t2d


def _rope_params(tc: dict[str, Any]) -> dict[str, Any]:
    rp = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
    if "rope_theta" not in rp:
        rp["rope_theta"] = tc.get("rope_theta", 10000.0)
    rp.setdefault("rope_type", rp.pop("type", "default") if "type" in rp else "default")
    return rp


def build_head_config(target_config: dict[str, Any], aux_layers: tuple[int, ...],
                      draft_vocab_size: int, *, intermediate_size: int | None = None,
                      dtype: str = "float16") -> dict[str, Any]:
    """config.json of a head for a Llama-family / Qwen2 target (its config.json
    as a dict). The draft layer copies the target's attention geometry and
    RoPE so positions mean the same thing in both."""
    h = int(target_config["hidden_size"])
    nh = int(target_config["num_attention_heads"])
    nkv = int(target_config.get("num_key_value_heads") or nh)
    head_dim = int(target_config.get("head_dim") or h // nh)
    rope = _rope_params(target_config)
    cfg = {
        "architectures": [HEAD_ARCH],
        "model_type": "llama",
        "hidden_size": h,
        "target_hidden_size": h,
        "intermediate_size": int(intermediate_size or target_config["intermediate_size"]),
        "num_hidden_layers": 1,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(target_config.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(target_config.get("max_position_embeddings", 4096)),
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": int(target_config["vocab_size"]),
        "draft_vocab_size": int(draft_vocab_size),
        "bos_token_id": target_config.get("bos_token_id"),
        "eos_token_id": target_config.get("eos_token_id"),
        "pad_token_id": target_config.get("pad_token_id"),
        "torch_dtype": dtype,
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(aux_layers),
            "use_aux_hidden_state": True,
        },
    }
    return cfg


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class _Attn(nn.Module):
    def __init__(self, h: int, nh: int, nkv: int, hd: int):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = _Attn(h, cfg["num_attention_heads"], cfg["num_key_value_heads"],
                               cfg["head_dim"])
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = _MLP(h, cfg["intermediate_size"])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Eagle3Draft(nn.Module):
    """Trainable EAGLE-3 head. ``embed`` is the target's embedding matrix
    (frozen buffer, not saved)."""

    def __init__(self, cfg: dict[str, Any], embed: torch.Tensor,
                 d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None):
        super().__init__()
        self.cfg = dict(cfg)
        h = cfg["hidden_size"]
        n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        self.fc = nn.Linear(n_aux * cfg.get("target_hidden_size", h), h, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        vd, v = cfg["draft_vocab_size"], cfg["vocab_size"]
        if vd != v:
            if d2t is None or t2d is None:
                raise ValueError("a reduced draft vocabulary needs d2t and t2d")
        else:
            d2t = torch.zeros(v, dtype=torch.int64)
            t2d = torch.ones(v, dtype=torch.bool)
        self.register_buffer("d2t", d2t.to(torch.int64), persistent=False)
        self.register_buffer("t2d", t2d.to(torch.bool), persistent=False)
        # target id -> draft id (-1 if not in the draft vocabulary)
        t2d_idx = torch.full((v,), -1, dtype=torch.long)
        draft_ids = torch.arange(vd)
        t2d_idx[draft_ids + self.d2t] = draft_ids
        self.register_buffer("target_to_draft", t2d_idx, persistent=False)
        hd = cfg["head_dim"]
        rp = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}
        self.register_buffer("inv_freq", self._inv_freq(cfg, rp, hd), persistent=False)
        self.attn_scaling = float(getattr(self, "_attn_factor", 1.0))
        self.reset_parameters()

    # -- set-up ---------------------------------------------------------------

    def _inv_freq(self, cfg: dict[str, Any], rp: dict[str, Any], hd: int) -> torch.Tensor:
        """RoPE inverse frequencies via transformers' own rope init (covers the
        'default', 'llama3', 'linear', 'dynamic' (at base length), 'yarn' ...
        types the same way vLLM does for the target)."""
        rope_type = rp.get("rope_type", "default")
        if rope_type == "default":
            theta = float(rp["rope_theta"])
            return 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        lc = LlamaConfig(hidden_size=cfg["hidden_size"],
                         num_attention_heads=cfg["num_attention_heads"], head_dim=hd,
                         max_position_embeddings=cfg["max_position_embeddings"],
                         rope_parameters=rp)
        inv, factor = ROPE_INIT_FUNCTIONS[rope_type](lc, "cpu")
        self._attn_factor = factor
        return inv.float()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)

    @torch.no_grad()
    def init_from_target(self, target_lm_head: torch.Tensor,
                         target_norm: torch.Tensor | None = None) -> None:
        """lm_head rows (and final norm) copied from the target's: a good start."""
        rows = (torch.arange(self.cfg["draft_vocab_size"]) + self.d2t).long()
        self.lm_head.weight.copy_(target_lm_head[rows].float())
        if target_norm is not None:
            self.norm.weight.copy_(target_norm.float())

    # -- forward pieces ---------------------------------------------------------

    def rope_cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the rotary angles at ``pos [T]``, each ``[T, hd]``,
        the attention scaling applied."""
        freqs = pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attn_scaling, emb.sin() * self.attn_scaling

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x: [T, n, hd], pos: [T]
        cos, sin = self.rope_cos_sin(pos)
        return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]

    def _qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        ml = self.midlayer
        emb = F.embedding(tokens, self.embed)
        x = torch.cat([ml.input_layernorm(emb), ml.hidden_norm(hidden)], dim=-1)
        a = ml.self_attn
        t = x.shape[0]
        q = self._rope(a.q_proj(x).view(t, a.nh, a.hd), pos)
        k = self._rope(a.k_proj(x).view(t, a.nkv, a.hd), pos)
        v = a.v_proj(x).view(t, a.nkv, a.hd)
        return q, k, v

    def _post(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o_proj + residual + MLP -> pre-norm output (what vLLM feeds back)."""
        ml = self.midlayer
        h = ml.self_attn.o_proj(attn.reshape(attn.shape[0], -1)) + residual
        return ml.mlp(ml.post_attention_layernorm(h)) + h

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(prenorm))

    def unroll(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int,
               row_start: int = 0) -> list[torch.Tensor]:
        """Training-time test of one sequence.

        tokens: [T] int64 target tokens x_0..x_{T-1}; aux: [T, n_aux*H].
        Returns ``steps`` pre-norm outputs; element k is ``[R, H]`` for rows
        ``i = row_start .. T-3`` (element 0 covers those rows only too, but is
        computed over all rows for the keys).  Row i of step k sits at position
        i+k, was fed x[i+k+1] (teacher forcing: a chain only matters while its
        drafts were right) and predicts x[i+k+2].
        """
        t_len = tokens.shape[0]
        n = t_len - 2  # rows 0..T-3 have a label at step 0
        if n <= row_start:
            return []
        a = self.midlayer.self_attn
        rep = a.nh // a.nkv
        scale = 1.0 / math.sqrt(a.hd)
        # step 0 over all rows that exist (0..T-2 have an input token x[i+1])
        rows0 = t_len - 1
        hid0 = self.fc(aux[:rows0].float())
        pos0 = torch.arange(rows0)
        q0, k0, v0 = self._qkv(tokens[1:rows0 + 1], hid0, pos0)
        kk0 = k0.repeat_interleave(rep, dim=1).transpose(0, 1)  # [nh, T0, hd]
        vv0 = v0.repeat_interleave(rep, dim=1).transpose(0, 1)
        att0 = F.scaled_dot_product_attention(q0.transpose(0, 1)[None], kk0[None], vv0[None],
                                              is_causal=True, scale=scale)[0].transpose(0, 1)
        out0 = self._post(att0, hid0)
        outs = [out0[row_start:n]]
        if steps <= 1:
            return outs
        rows = torch.arange(row_start, n)
        r = rows.shape[0]
        # keys of the first pass that row i may see: j <= i
        keys0 = kk0[:, :n]  # [nh, n, hd]
        vals0 = vv0[:, :n]
        causal = rows[:, None] >= torch.arange(n)[None, :]  # [R, n]
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        hidden = outs[0]
        pad = torch.zeros(steps, dtype=tokens.dtype)
        tok_ext = torch.cat([tokens, pad])
        for k in range(1, steps):
            pos = rows + k
            q, kx, vx = self._qkv(tok_ext[rows + k + 1], hidden, pos)
            diag_k.append(kx.repeat_interleave(rep, dim=1))  # [R, nh, hd]
            diag_v.append(vx.repeat_interleave(rep, dim=1))
            qh = q.transpose(0, 1)  # [nh, R, hd]
            s0 = torch.matmul(qh, keys0.transpose(1, 2)) * scale  # [nh, R, n]
            s0 = s0.masked_fill(~causal[None], float("-inf"))
            dk = torch.stack(diag_k, dim=2)  # [R, nh, k, hd]
            dv = torch.stack(diag_v, dim=2)
            sd = (q[:, :, None, :] * dk).sum(-1).permute(1, 0, 2) * scale  # [nh, R, k]
            p = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(q.dtype)
            att = torch.matmul(p[..., :n], vals0)  # [nh, R, hd]
            att = att + (p[..., n:].permute(1, 0, 2)[..., None] * dv).sum(2).transpose(0, 1)
            hidden = self._post(att.transpose(0, 1), hidden)
            outs.append(hidden)
        return outs

    # -- inference helper (used to check against vLLM) -------------------------

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, aux: torch.Tensor, next_token: int,
                steps: int) -> list[int]:
        """Greedy drafts after a prefix, as vLLM's proposer computes them:
        tokens [T] (the prefix), aux [T, n_aux*H] (the target's features of
        the prefix), next_token = the target's token after the prefix."""
        return self.chain(tokens, aux, next_token, steps)[0]

    @torch.no_grad()
    def chain(self, tokens: torch.Tensor, aux: torch.Tensor, next_token: int, steps: int,
              forced: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
        """Incremental drafting (one position at a time, KV cache as a list).
        Returns (greedy drafts, pre-norm output of every step at the chain's
        row); ``forced`` feeds these tokens instead of the drafts."""
        toks = torch.cat([tokens, torch.tensor([next_token], dtype=tokens.dtype)])
        t_len = toks.shape[0]
        a = self.midlayer.self_attn
        rep = a.nh // a.nkv
        scale = 1.0 / math.sqrt(a.hd)
        hid = self.fc(aux.float())
        q, k, v = self._qkv(toks[1:], hid, torch.arange(t_len - 1))
        ks = [k.repeat_interleave(rep, dim=1)]
        vs = [v.repeat_interleave(rep, dim=1)]
        att = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], ks[0].transpose(0, 1)[None], vs[0].transpose(0, 1)[None],
            is_causal=True, scale=scale)[0].transpose(0, 1)
        out = self._post(att, hid)[-1:]
        drafts: list[int] = []
        outs: list[torch.Tensor] = []
        last_pos = t_len - 2
        for s in range(steps):
            outs.append(out[0])
            d = int(self.logits(out).argmax(-1)[0])
            drafts.append(d + int(self.d2t[d]))
            if s == steps - 1:
                break
            tok = forced[s] if forced is not None else drafts[-1]
            last_pos += 1
            q, k, v = self._qkv(torch.tensor([tok]), out, torch.tensor([last_pos]))
            ks.append(k.repeat_interleave(rep, dim=1))
            vs.append(v.repeat_interleave(rep, dim=1))
            kk = torch.cat(ks, 0).transpose(0, 1)
            vv = torch.cat(vs, 0).transpose(0, 1)
            att = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk[None], vv[None],
                                                 scale=scale)[0].transpose(0, 1)
            out = self._post(att, out)
        return drafts, outs

    # -- checkpoint -------------------------------------------------------------

    def head_state_dict(self, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
        """Weights under the names vLLM's Eagle3LlamaForCausalLM loads."""
        sd = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        if self.cfg["draft_vocab_size"] != self.cfg["vocab_size"]:
            sd["d2t"] = self.d2t.clone()
            sd["t2d"] = self.t2d.clone()
        return sd


def save_head(model: Eagle3Draft, out_dir: str, *, dtype: str = "float16",
              extra_meta: dict[str, Any] | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` (+ our training metadata)
    atomically-ish: files are written to temp names and renamed."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16,
              "float32": torch.float32}[dtype]
    cfg = dict(model.cfg)
    cfg["torch_dtype"] = dtype
    sd = model.head_state_dict(tdtype)
    tmp = os.path.join(out_dir, WEIGHTS_NAME + ".tmp")
    save_file(sd, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, WEIGHTS_NAME))
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    if extra_meta is not None:
        _write_json(os.path.join(out_dir, TRAIN_META_NAME), extra_meta)


def load_head(head_dir: str, embed: torch.Tensor) -> Eagle3Draft:
    """A saved head back as a trainable float32 :class:`Eagle3Draft`."""
    from safetensors.torch import load_file

    with open(os.path.join(head_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    sd = load_file(os.path.join(head_dir, WEIGHTS_NAME))
    d2t, t2d = sd.pop("d2t", None), sd.pop("t2d", None)
    model = Eagle3Draft(cfg, embed, d2t, t2d)
    model.load_state_dict({k: v.float() for k, v in sd.items()})
    return model


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
