"""`specplug ref-model` and `specplug tiny-model`: print a model's folder,
materializing it on first use."""

from __future__ import annotations


def register_cli(sub) -> None:
    p = sub.add_parser("ref-model", help="path of the reference model "
                       "(SmolLM2-135M-Instruct), built on first use")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=_ref)
    p = sub.add_parser("tiny-model", help="path of the tiny random test model")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=_tiny)


def _ref(args) -> int:
    from vllm_specplug.models.reference import reference_model_path

    print(reference_model_path(args.cache_dir))
    return 0


def _tiny(args) -> int:
    from vllm_specplug.models.tiny import tiny_model_path

    print(tiny_model_path(args.cache_dir))
    return 0
