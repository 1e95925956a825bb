"""Writing the benchmarks' figures.

Plots are flat colours and text, so a 256-colour palette PNG looks the same
as a full-colour one at about a third of the size: ``benchmarks/results``
keeps under its size cap with room for more runs.
"""

from __future__ import annotations

import io
from pathlib import Path


def save_png(fig, path: str | Path, dpi: int = 110) -> None:
    """``fig`` as a palette PNG at ``path``."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    compact_png(Image.open(buf), path)


def compact_png(image, path: str | Path) -> None:
    """``image`` (a PIL image) written as a 256-colour optimised PNG."""
    from PIL import Image

    image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(
        path, format="png", optimize=True)


if __name__ == "__main__":  # re-encode existing figures: python -m benchmarks.figures F.png...
    import sys

    from PIL import Image

    for name in sys.argv[1:]:
        with Image.open(name) as im:
            im.load()
        compact_png(im, name)
