"""EAGLE-3 training data: the target's own responses and its hidden states.

Layout of a data folder ``OUT``::

    OUT/prompts.jsonl              the prompt mix (fixed at the first run)
    OUT/gen/chunk_00000.jsonl      the target's responses, one chunk per shard
    OUT/shard_00000.safetensors    hidden states of that chunk
    OUT/manifest.json              written last; lists the finished shards

1. **Responses** (vLLM): every prompt is rendered with the target's chat
   template and answered by the target (greedy by default, or sampled), turn
   by turn for multi-turn prompts (turn ``r`` sees the target's own earlier
   answers).  Each turn is one sample: ``prompt_ids + response_ids`` with
   ``loss_mask`` = 1 on the response tokens (including the end-of-turn token
   when generated).
2. **Hidden states** (Hugging Face transformers, float32): one forward pass
   over every sample; saved per shard (fp16):

   * ``aux``: ``[tokens, n_aux * H]``, the residual stream after each layer in
     ``aux_layers`` (vLLM's default EAGLE-3 layers for the target:
     ``(2, N // 2, N - 3)``), concatenated in ascending layer order; for a
     layer equal to ``N`` the pre-final-norm stream, as vLLM hands it over;
   * ``last``: ``[resp_tokens, H]``, the final (post-norm) hidden state from
     position ``prompt_len - 1`` on: the target's next-token distribution is
     ``lm_head(last)`` (computed in training, over the draft vocabulary);
   * ``input_ids`` (int32), ``loss_mask`` (uint8), ``offsets`` (int64,
     ``n + 1``), ``prompt_lens`` (int64), ``last_offsets`` (int64, ``n + 1``).

Both stages are resumable: a chunk or shard that exists is skipped (files are
written under a temporary name and renamed).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator

from vllm_specplug.config import TOOL_KV_CACHE_BYTES
from vllm_specplug.corpus import chat_ids, run_target
from vllm_specplug.eagle3 import target_config

__all__ = ["ShardData", "generate_data", "load_manifest", "target_config", "token_counts"]

MANIFEST = "manifest.json"
DATA_FORMAT = 1


def _log(msg: str) -> None:
    print(f"[eagle3.data] {msg}", flush=True)


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def load_manifest(data_dir: str) -> dict[str, Any]:
    with open(os.path.join(data_dir, MANIFEST), encoding="utf-8") as f:
        return json.load(f)


# --------------------------------------------------------------------------
# stage 1: responses
# --------------------------------------------------------------------------




def _generate_chunks(target: str, prompts: list[dict[str, Any]], out_dir: str,
                     todo: list[int], shard_size: int, opts: dict[str, Any]) -> None:
    from tqdm import tqdm
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=target, dtype=opts["gen_dtype"], seed=opts["seed"],
              max_model_len=opts["max_prompt_tokens"] + opts["max_new_tokens"] + 16,
              enforce_eager=True, disable_log_stats=True, kv_cache_memory_bytes=TOOL_KV_CACHE_BYTES)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=opts["temperature"], top_p=opts["top_p"],
                            max_tokens=opts["max_new_tokens"], seed=opts["seed"])
    try:
        for c in tqdm(todo, desc="generate (chunks)", unit="chunk"):
            chunk = prompts[c * shard_size:(c + 1) * shard_size]
            convs = [[] for _ in chunk]  # messages so far
            samples: list[dict[str, Any]] = []
            n_rounds = max(len(p["turns"]) for p in chunk)
            alive = list(range(len(chunk)))
            for r in range(n_rounds):
                batch, ids = [], []
                for j in alive:
                    if r >= len(chunk[j]["turns"]):
                        continue
                    convs[j].append({"role": "user", "content": chunk[j]["turns"][r]})
                    pids = chat_ids(tok, convs[j])
                    if len(pids) > opts["max_prompt_tokens"]:
                        continue  # too long: drop this and later turns
                    batch.append(j)
                    ids.append(pids)
                if not batch:
                    break
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params,
                                    use_tqdm=False)
                alive = []
                for j, pids, o in zip(batch, ids, outs):
                    comp = o.outputs[0]
                    resp = [int(t) for t in comp.token_ids]
                    if not resp:
                        continue
                    samples.append({"id": f"{chunk[j]['id']}#{r}", "source": chunk[j]["source"],
                                    "prompt_ids": pids, "response_ids": resp,
                                    "finish_reason": comp.finish_reason})
                    convs[j].append({"role": "assistant", "content": comp.text})
                    alive.append(j)
            path = os.path.join(out_dir, "gen", f"chunk_{c:05d}.jsonl")
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                for s in samples:
                    f.write(json.dumps(s) + "\n")
            os.replace(path + ".tmp", path)
    finally:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        import gc

        gc.collect()


# --------------------------------------------------------------------------
# stage 2: hidden states
# --------------------------------------------------------------------------


class _AuxCapture:
    """Target forward that returns the aux-layer residual streams and the
    final post-norm hidden state.  Layers below N come from
    ``output_hidden_states`` (index L = after L layers); layer N is taken
    before the final norm with a hook, as vLLM hands it to the drafter."""

    def __init__(self, target: str, aux_layers: tuple[int, ...], dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype))
        model.eval()
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.base = base
        self.n_layers = len(base.layers)
        self.aux_layers = tuple(sorted(aux_layers))
        self._prenorm = None
        if self.n_layers in self.aux_layers:
            base.layers[self.n_layers - 1].register_forward_hook(self._hook)

    def _hook(self, _mod, _inp, out):
        self._prenorm = out[0] if isinstance(out, tuple) else out

    def __call__(self, ids, mask=None):
        """``run_target``'s forward: ``([B, T, n_aux * H], [B, T, H])``."""
        out = self.base(input_ids=ids, attention_mask=mask, output_hidden_states=True,
                        use_cache=False)
        hs = out.hidden_states
        assert len(hs) == self.n_layers + 1, (len(hs), self.n_layers)
        aux = [self._prenorm if layer == self.n_layers else hs[layer]
               for layer in self.aux_layers]
        return self.torch.cat(aux, dim=-1).float(), out.last_hidden_state.float()


def _hidden_shard(cap: _AuxCapture, samples: list[dict[str, Any]], path: str) -> dict[str, int]:
    import torch
    from safetensors.torch import save_file

    ids_l, mask_l, aux_l, last_l, offs, loffs, plens = [], [], [], [], [0], [0], []
    docs = (s["prompt_ids"] + s["response_ids"] for s in samples)
    # One sample per forward (chunk_tokens=1): no padding, so a sample's
    # states do not depend on its shard neighbours.
    for s, (ids, (aux, last)) in zip(samples, run_target(cap, docs, 1)):
        p = len(s["prompt_ids"])
        ids_l.append(torch.tensor(ids, dtype=torch.int32))
        m = torch.zeros(len(ids), dtype=torch.uint8)
        m[p:] = 1
        mask_l.append(m)
        aux_l.append(aux.half())
        last_l.append(last[p - 1:].half())
        offs.append(offs[-1] + len(ids))
        loffs.append(loffs[-1] + len(ids) - (p - 1))
        plens.append(p)
    tensors = {
        "input_ids": torch.cat(ids_l) if ids_l else torch.zeros(0, dtype=torch.int32),
        "loss_mask": torch.cat(mask_l) if mask_l else torch.zeros(0, dtype=torch.uint8),
        "aux": torch.cat(aux_l) if aux_l else torch.zeros(0, 1, dtype=torch.float16),
        "last": torch.cat(last_l) if last_l else torch.zeros(0, 1, dtype=torch.float16),
        "offsets": torch.tensor(offs, dtype=torch.int64),
        "last_offsets": torch.tensor(loffs, dtype=torch.int64),
        "prompt_lens": torch.tensor(plens, dtype=torch.int64),
    }
    meta = {"ids": json.dumps([s["id"] for s in samples])}
    save_file({k: v.contiguous() for k, v in tensors.items()}, path + ".tmp", metadata=meta)
    os.replace(path + ".tmp", path)
    return {"samples": len(samples), "tokens": offs[-1],
            "response_tokens": int(sum(len(s["response_ids"]) for s in samples))}


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


def generate_data(target: str, out_dir: str, *, sources: str = "spec_bench,gsm8k:200,humaneval,synthetic:200",
                  spec_bench: str | None = None, num_prompts: int | None = None,
                  max_new_tokens: int = 128, max_prompt_tokens: int = 1024,
                  temperature: float = 0.0, top_p: float = 1.0, shard_size: int = 64,
                  aux_layers: tuple[int, ...] | None = None, seed: int = 0,
                  gen_dtype: str = "float32", threads: int | None = None,
                  prompts: list[dict[str, Any]] | None = None,
                  extend: bool = False) -> dict[str, Any]:
    """Build (or finish building) a data folder; returns its manifest.

    ``extend``: add the prompts of ``sources`` (or ``prompts``) that the
    folder does not hold yet, by id; finished shards stay, a partial last
    shard is regenerated with the new prompts filling it."""
    import torch
    from tqdm import tqdm

    from vllm_specplug.eagle3.model import default_aux_layers
    from vllm_specplug.eagle3.prompts import collect_prompts

    if threads:
        torch.set_num_threads(threads)
    target = os.path.abspath(target)
    os.makedirs(os.path.join(out_dir, "gen"), exist_ok=True)
    tcfg = target_config(target)
    n_layers = int(tcfg["num_hidden_layers"])
    aux = tuple(sorted(aux_layers)) if aux_layers else default_aux_layers(n_layers)
    settings = {"target": target, "aux_layers": list(aux), "max_new_tokens": max_new_tokens,
                "max_prompt_tokens": max_prompt_tokens, "temperature": temperature,
                "top_p": top_p, "shard_size": shard_size, "seed": seed,
                "gen_dtype": gen_dtype}
    settings_path = os.path.join(out_dir, "settings.json")
    if os.path.exists(settings_path):
        with open(settings_path, encoding="utf-8") as f:
            old = json.load(f)
        if old != settings:
            raise ValueError(f"{out_dir} was started with other settings: {old} "
                             f"(now {settings}); use a new folder")
    else:
        _write_json(settings_path, settings)

    ppath = os.path.join(out_dir, "prompts.jsonl")
    if os.path.exists(ppath):
        with open(ppath, encoding="utf-8") as f:
            plist = [json.loads(line) for line in f if line.strip()]
        if extend:
            plist = _extend_prompts(out_dir, plist, prompts if prompts is not None else
                                    collect_prompts(sources, spec_bench=spec_bench, seed=seed),
                                    shard_size, num_prompts)
    else:
        plist = prompts if prompts is not None else collect_prompts(
            sources, spec_bench=spec_bench, seed=seed)
        if num_prompts is not None:
            plist = plist[:num_prompts]
        with open(ppath + ".tmp", "w", encoding="utf-8") as f:
            for p in plist:
                f.write(json.dumps(p) + "\n")
        os.replace(ppath + ".tmp", ppath)
    n_chunks = (len(plist) + shard_size - 1) // shard_size
    _log(f"{len(plist)} prompts -> {n_chunks} shards of <= {shard_size}; aux layers {aux}")

    t0 = time.time()
    todo = [c for c in range(n_chunks)
            if not os.path.exists(os.path.join(out_dir, "gen", f"chunk_{c:05d}.jsonl"))]
    if todo:
        opts = dict(settings)
        _generate_chunks(target, plist, out_dir, todo, shard_size, opts)
    t_gen = time.time() - t0

    t1 = time.time()
    shards = []
    cap = None
    for c in tqdm(range(n_chunks), desc="hidden states (shards)", unit="shard"):
        spath = os.path.join(out_dir, f"shard_{c:05d}.safetensors")
        with open(os.path.join(out_dir, "gen", f"chunk_{c:05d}.jsonl"), encoding="utf-8") as f:
            samples = [json.loads(line) for line in f if line.strip()]
        if not os.path.exists(spath):
            if cap is None:
                cap = _AuxCapture(target, aux)
            info = _hidden_shard(cap, samples, spath)
        else:
            info = {"samples": len(samples),
                    "tokens": sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples),
                    "response_tokens": sum(len(s["response_ids"]) for s in samples)}
        shards.append({"file": os.path.basename(spath), **info})
    t_hid = time.time() - t1

    manifest = {
        "format": DATA_FORMAT,
        **settings,
        "target_config": {k: tcfg.get(k) for k in ("hidden_size", "num_hidden_layers",
                                                    "vocab_size", "model_type")},
        "num_prompts": len(plist),
        "num_samples": sum(s["samples"] for s in shards),
        "num_tokens": sum(s["tokens"] for s in shards),
        "num_response_tokens": sum(s["response_tokens"] for s in shards),
        "shards": shards,
        "seconds_last_run": {"generate": round(t_gen, 1), "hidden": round(t_hid, 1)},
    }
    _write_json(os.path.join(out_dir, MANIFEST), manifest)
    _log(f"done: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens "
         f"({manifest['num_response_tokens']} response) in {out_dir}")
    return manifest


def _extend_prompts(out_dir: str, plist: list[dict[str, Any]], more: list[dict[str, Any]],
                    shard_size: int, num_prompts: int | None) -> list[dict[str, Any]]:
    have = {p["id"] for p in plist}
    new = [p for p in more if p["id"] not in have]
    if num_prompts is not None:
        new = new[:max(0, num_prompts - len(plist))]
    if not new:
        return plist
    if len(plist) % shard_size:  # the last shard was cut short: redo it
        last = len(plist) // shard_size
        for path in (os.path.join(out_dir, "gen", f"chunk_{last:05d}.jsonl"),
                     os.path.join(out_dir, f"shard_{last:05d}.safetensors")):
            if os.path.exists(path):
                os.remove(path)
    plist = plist + new
    ppath = os.path.join(out_dir, "prompts.jsonl")
    with open(ppath + ".tmp", "w", encoding="utf-8") as f:
        for p in plist:
            f.write(json.dumps(p) + "\n")
    os.replace(ppath + ".tmp", ppath)
    _log(f"extended with {len(new)} new prompts ({len(plist)} in all)")
    return plist


class ShardData:
    """All samples of a data folder in memory (fp16 tensors, views per sample)."""

    def __init__(self, data_dir: str, max_shards: int | None = None):
        from safetensors.torch import load_file

        self.manifest = load_manifest(data_dir)
        self.aux_layers = tuple(self.manifest["aux_layers"])
        self.samples: list[dict[str, Any]] = []
        for sh in self.manifest["shards"][:max_shards]:
            t = load_file(os.path.join(data_dir, sh["file"]))
            offs, loffs = t["offsets"].tolist(), t["last_offsets"].tolist()
            for i, p in enumerate(t["prompt_lens"].tolist()):
                a, b = offs[i], offs[i + 1]
                self.samples.append({
                    "input_ids": t["input_ids"][a:b].long(),
                    "loss_mask": t["loss_mask"][a:b].bool(),
                    "aux": t["aux"][a:b],
                    "last": t["last"][loffs[i]:loffs[i + 1]],
                    "prompt_len": p,
                })

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.samples)

    def token_counts(self, vocab_size: int, response_only: bool = True):
        return token_counts(self.samples, vocab_size, response_only)


def token_counts(samples, vocab_size: int, response_only: bool = True):
    """How often each token id occurs in ``samples`` (response tokens only, or
    prompts too)."""
    import torch

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        ids = s["input_ids"][s["loss_mask"]] if response_only else s["input_ids"]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts
