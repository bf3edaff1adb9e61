"""Where elmokit keeps what it fetches or builds: `ELMOKIT_CACHE`, else elmokit's folder in the
user's cache directory (`platformdirs`). Downloaded files (`elmokit.sources.cache`) and compiled
kernels (`elmokit.model.fused_cell`, under the hidden `.kernels`) live there."""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE = "ELMOKIT_CACHE"


def cache_dir() -> Path:
    """The cache folder: `ELMOKIT_CACHE`, else elmokit's folder in the user's cache directory."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    import platformdirs

    return platformdirs.user_cache_path("elmokit") / "models"
