"""The on-disk curve cache lives in :mod:`apis.curvecache` (the controller and the operator
share it); this module keeps the old import path."""

from apis.curvecache import ENV_VAR, FileCurveCache, default_dir, open_curve_cache

__all__ = ["ENV_VAR", "FileCurveCache", "default_dir", "open_curve_cache"]
