"""Moved to common/compare.py (which also handles several ranks); kept so old imports work."""
from common.compare import RunResult, markdown_table, render_beside, render_peak_bars  # noqa: F401
