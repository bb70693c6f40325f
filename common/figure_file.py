"""Writing a matplotlib figure: the one way every figure of the tutorial is laid out and saved."""
from __future__ import annotations


def save_figure(fig, path, rect: tuple[float, float, float, float] = (0, 0, 1, 1), dpi: int = 110) -> None:
    """Lay ``fig`` out tightly within ``rect`` (figure fractions) and write it to ``path``.

    ``tight_layout`` leaves a placeholder layout engine on the figure, and ``savefig`` then
    lays every text out once more before drawing: nearly half of a run's memory-figure time
    (common/measure/memory_figure.py). Without the engine the same pixels are written once."""
    fig.tight_layout(rect=rect)
    fig.set_layout_engine(None)
    fig.savefig(path, dpi=dpi)
