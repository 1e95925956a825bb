"""``python -m vllm_specplug.cli ...``: the ``specplug`` command."""

from vllm_specplug.cli import main

raise SystemExit(main())
