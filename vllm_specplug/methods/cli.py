"""`specplug methods`: the registered methods and every option, as Markdown
(the README's option tables are this command's output)."""

from __future__ import annotations


def register_cli(sub) -> None:
    p = sub.add_parser("methods", help="list specplug methods and their options")
    p.add_argument("names", nargs="*", help="only these methods")
    p.set_defaults(func=_run)


def options_markdown(name: str) -> str:
    from vllm_specplug import registry

    import importlib

    cls = registry.get(name)
    doc = (importlib.import_module(cls.__module__).__doc__ or name).strip()
    lines = [f"### `{name}`", "", doc.splitlines()[0], "",
             "| option | type | default | meaning |", "| --- | --- | --- | --- |"]
    for field, info in cls.config_cls.model_fields.items():
        ann = getattr(info.annotation, "__name__", str(info.annotation)).replace("|", "or")
        default = "required" if info.is_required() else repr(info.default)
        doc = " ".join((info.description or "").split())
        lines.append(f"| `{field}` | {ann} | {default} | {doc} |")
    return "\n".join(lines) + "\n"


def _run(args) -> int:
    from vllm_specplug import registry

    for name in args.names or registry.names():
        print(options_markdown(name))
    return 0
