"""A tiny random-weight Llama model with its own small tokenizer, for fast tests.

:func:`tiny_model_path` builds (once, then caches) a ~1.4M-parameter
``LlamaForCausalLM`` folder that vLLM loads in a couple of seconds:

* tokenizer: byte-level BPE, vocab 512 (3 special tokens + 256 bytes + 253
  merges) learned by a small pure-Python trainer with explicit tie-breaking
  on a built-in text, so it is bit-for-bit reproducible (the ``tokenizers``
  trainer is not guaranteed to break ties the same way across runs/versions);
  any input text encodes (byte fallback is inherent to byte-level BPE).
  Special tokens: ``<|endoftext|>`` (0, unk/pad), ``<|im_start|>`` (1, bos),
  ``<|im_end|>`` (2, eos); ChatML chat template; no BOS is added implicitly
  (like SmolLM2).
* model: hidden 256, 2 layers, 8 query heads / 4 KV heads, head_dim 32
  (vLLM's CPU attention supports head sizes >= 32; (8, 4) also avoids the
  SIGILL that vLLM's bf16 CPU kernel raises with (4, 2), (2, 1), (4, 1)
  heads), MLP 512,
  untied ``lm_head``, ``max_position_embeddings`` 2048, float32.
* weights: drawn from a seeded ``torch.Generator`` in sorted-name order (not
  via transformers' init, which may change between versions); norms are 1.
  Inner weights use std 0.3 and ``lm_head`` std 0.2: greedy output is far
  from constant (dozens of distinct tokens in 64 steps) and next-token
  distributions are neither uniform nor one-hot (top-1 prob ~0.1-0.9), which
  suits sampling-distribution tests on the small vocab.  EOS (id 2) can be
  sampled like any other token; pass ``ignore_eos=True`` for fixed lengths.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from vllm_specplug.models.reference import _log, _patch_json, materialize

__all__ = ["TINY_FOLDER_NAME", "TINY_RECIPE", "tiny_model_path"]

TINY_FOLDER_NAME = "tiny-llama-rand"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Built-in training text for the tokenizer (original text, no license issues).
CORPUS = """\
The small model reads a line of text and guesses the next word. It is not a clever model:
its weights are random numbers, chosen once with a fixed seed, so every run gives the same
answer. That is exactly what a test needs. A test asks a question, writes down the answer,
and asks again later; if the answer changed, something in the engine changed too.

Speculative decoding lets a cheap draft propose several tokens at once. The target model
then checks all of them in a single forward pass and keeps the longest prefix it agrees
with. When the draft is good, many tokens are accepted per step and generation is faster.
When the draft is bad, the target still produces the right tokens, only more slowly. With
greedy decoding the output must be identical to plain decoding, token for token. With
sampling, the accepted tokens must follow the same distribution as the target model.

Once upon a time there was a little river that ran through a quiet valley. In the morning
the water was cold and clear, and in the evening it turned the color of copper. Children
came down to the river to throw stones, count fish, and tell stories about the old mill on
the other side. The miller had a dog, a cat, three goats and a garden full of beans.

The weather today is sunny with a light wind from the west. Tomorrow it will be cloudy and
a little cooler, with some rain in the afternoon. On Friday the sun comes back again.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 100 1000 3.14
Dates like 2024-01-31, times like 12:30, prices like $4.99 and 20% off appear in text too.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

if x > 0 and y < 0: result = [x, y] else: result = {"x": x, "y": y}

Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many legs does a spider have? Answer: A spider has eight legs.
Question: What color is the sky? Answer: The sky is blue on a clear day.
User: Hello! Can you help me with my homework? Assistant: Of course, I am happy to help.
User: Please write a short poem about the sea. Assistant: The sea is wide, the sea is deep,
it sings the sailors all to sleep.

the of and to in is that it for with as was on be at by this from have or an they which
you one had not but all were when we there can what said each she do how their if will up
other about out many then them these so some her would make like him into time has look
two more write go see number no way could people my than first water been call who oil
its now find long down day did get come made may part over new sound take only little work
know place year live me back give most very after thing our just name good sentence man
think say great where help through much before line right too mean old any same tell boy
follow came want show also around form three small set put end does another well large
must big even such because turn here why ask went men read need land different home us
move try kind hand picture again change off play spell air away animal house point page
letter mother answer found study still learn should America world high every near add food
between own below country plant last school father keep tree never start city earth eye
light thought head under story saw left few while along might close something seem next
hard open example begin life always those both paper together got group often run important
"""

# Everything that determines the folder's bytes.  A change -> the cached
# folder is rebuilt.  (Bump "version" for changes in code below.)
TINY_RECIPE: dict[str, Any] = {
    "version": 1,
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "seed": 1234,
    "init_std": 0.3,
    "lm_head_std": 0.2,
    "dtype": "float32",
    "corpus_sha256": hashlib.sha256(CORPUS.encode("utf-8")).hexdigest(),
    "chat_template_sha256": hashlib.sha256(CHAT_TEMPLATE.encode("utf-8")).hexdigest(),
}


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode char map (what ByteLevel uses)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _train_bpe(text: str, vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Deterministic byte-level BPE: most frequent pair first, ties -> smallest pair."""
    from collections import Counter

    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    word_freq = Counter(piece for piece, _ in pre.pre_tokenize_str(text))

    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    for _b, ch in sorted(_bytes_to_unicode().items()):
        vocab[ch] = len(vocab)

    words = [(list(w), f) for w, f in sorted(word_freq.items())]
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        pairs: Counter[tuple[str, str]] = Counter()
        for syms, f in words:
            for a, b in zip(syms, syms[1:]):
                pairs[(a, b)] += f
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merged = best[0] + best[1]
        if merged in vocab:  # cannot happen with byte-level pieces, but be safe
            raise RuntimeError(f"BPE produced duplicate token {merged!r}")
        merges.append(best)
        vocab[merged] = len(vocab)
        for syms, _f in words:
            i = 0
            while i < len(syms) - 1:
                if syms[i] == best[0] and syms[i + 1] == best[1]:
                    syms[i : i + 2] = [merged]
                i += 1
    if len(vocab) != vocab_size:
        raise RuntimeError(f"corpus too small: BPE vocab {len(vocab)} < {vocab_size}")
    return vocab, merges


def _build_tokenizer(out_dir: str, recipe: dict[str, Any]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _train_bpe(CORPUS, recipe["vocab_size"])
    bpe = models.BPE(vocab=vocab, merges=merges)
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert all(tk.token_to_id(t) == i for i, t in enumerate(SPECIAL_TOKENS))
    assert tk.get_vocab_size() == recipe["vocab_size"]

    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        model_max_length=recipe["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out_dir)

    def fix(c: dict[str, Any]) -> None:
        for junk in ("is_local", "local_files_only", "name_or_path"):
            c.pop(junk, None)
        c["chat_template"] = CHAT_TEMPLATE
        c["model_max_length"] = recipe["max_position_embeddings"]

    _patch_json(os.path.join(out_dir, "tokenizer_config.json"), fix)
    if not os.path.exists(os.path.join(out_dir, "chat_template.jinja")):
        with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(CHAT_TEMPLATE)
    return tok


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


def _build_tiny(out_dir: str, recipe: dict[str, Any]) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    _log("building tiny tokenizer ...")
    _build_tokenizer(out_dir, recipe)

    config = LlamaConfig(
        vocab_size=recipe["vocab_size"],
        hidden_size=recipe["hidden_size"],
        intermediate_size=recipe["intermediate_size"],
        num_hidden_layers=recipe["num_hidden_layers"],
        num_attention_heads=recipe["num_attention_heads"],
        num_key_value_heads=recipe["num_key_value_heads"],
        head_dim=recipe["head_dim"],
        hidden_act="silu",
        max_position_embeddings=recipe["max_position_embeddings"],
        rms_norm_eps=recipe["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": recipe["rope_theta"]},
        tie_word_embeddings=recipe["tie_word_embeddings"],
        attention_bias=False,
        mlp_bias=False,
        initializer_range=recipe["init_std"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        architectures=["LlamaForCausalLM"],
    )

    _log("generating tiny random weights ...")
    with torch.device("meta"):
        meta_model = LlamaForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in meta_model.state_dict().items()}
    if recipe["tie_word_embeddings"]:
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator(device="cpu").manual_seed(recipe["seed"])
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            std = recipe["lm_head_std"] if name == "lm_head.weight" else recipe["init_std"]
            tensors[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * std
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    n_params = sum(t.numel() for t in tensors.values())

    config.save_pretrained(out_dir)

    def fix_config(c: dict[str, Any]) -> None:
        c.pop("_name_or_path", None)
        c["architectures"] = ["LlamaForCausalLM"]
        c["dtype"] = "float32"
        c["rope_theta"] = float(recipe["rope_theta"])  # vLLM 0.32 reads the top-level key

    _patch_json(os.path.join(out_dir, "config.json"), fix_config)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out_dir)
    return {"model": "tiny-llama-rand", "num_parameters": n_params}


def tiny_model_path(cache_dir: str | None = None) -> str:
    """HF folder of the tiny deterministic random Llama (see module docstring).

    ``cache_dir`` defaults to ``$SPECPLUG_CACHE`` or ``~/.cache/vllm_specplug``;
    the folder is ``<cache_dir>/tiny-llama-rand``.  Building takes a few
    seconds (mostly importing torch/transformers); later calls return at once.
    """
    recipe = dict(TINY_RECIPE)
    return materialize(
        TINY_FOLDER_NAME,
        cache_dir,
        {"kind": "tiny-random-llama", **recipe},
        lambda out_dir: _build_tiny(out_dir, recipe),
        description="tiny random Llama (vocab 512)",
    )
