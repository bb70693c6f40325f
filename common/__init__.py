"""The library every script imports. ROOT: the repository's top folder."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def own_line(filename: str, lineno: int) -> str | None:
    """``path:line`` relative to ROOT where ``filename`` is this project's own source; None
    elsewhere, installed packages included: the Quick start's virtual environment lives in
    ROOT/.venv, and torch's files there are not ours."""
    path = Path(filename)
    if ROOT not in path.parents or {"site-packages", "dist-packages"} & set(path.parts):
        return None
    return f"{path.relative_to(ROOT)}:{lineno}"
