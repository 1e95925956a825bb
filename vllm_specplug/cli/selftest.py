"""`specplug selftest`: the lossless checks of every method on this device
(:mod:`vllm_specplug.selftest`)."""

from __future__ import annotations


def register_cli(sub) -> None:
    p = sub.add_parser("selftest", help="lossless checks of every method on this "
                       "device (run first on a GPU)")
    p.add_argument("--model", default=None,
                   help="target model (default: the reference model)")
    p.add_argument("--methods", nargs="*", default=None,
                   help="only these methods (default: all registered; the oracle "
                   "control always runs)")
    p.add_argument("--options", default="{}",
                   help='JSON: per-method options, e.g. \'{"dresd": {"datastore": "..."}}\'')
    p.add_argument("--dtype", default=None,
                   help="only this dtype (default: float32; on CUDA float32 with "
                   "TRITON_ATTN and bfloat16 with FLASH_ATTN)")
    p.add_argument("--attention-backend", default=None,
                   help="only this vLLM attention backend (GPU: FLASH_ATTN or TRITON_ATTN)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--num-speculative-tokens", type=int, default=16,
                   help="per method (adapld's default tree needs more than 8)")
    p.add_argument("--enforce-eager", default=None, action="store_true",
                   help="no CUDA graphs / torch.compile (default: only on CPU)")
    p.add_argument("--samples", type=int, default=1000,
                   help="requests per side in the sampling check (0: skip it)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from vllm_specplug.selftest import run

    return run(args)
