"""The library every script imports. ROOT: the repository's top folder."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
