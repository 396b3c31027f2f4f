"""What TapeSAC's two torchtitan front doors share: ``torchtitan_ext`` (torchtitan 0.2.x, TOML
jobs, a model converter) and ``torchtitan03_ext`` (torchtitan 0.3.x, Python configs, an
activation-checkpointing choice).

Nothing here imports torchtitan at import time, and importing it changes nothing: the settings
both front doors expose (:mod:`.settings`), the run that wraps the blocks and reports
(:mod:`.run`), the CPU pieces that do not depend on torchtitan's version (:mod:`.cpu`), the
one-line error exit (:mod:`.errors`), version detection (:mod:`.versions`) and the offline assets.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _assets() -> Path:
    # The assets ship inside torchtitan_ext (the 0.2.x jobs name them by path); locate them
    # without importing that package, whose import sets up torchtitan 0.2.x.
    spec = importlib.util.find_spec("torchtitan_ext")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torchtitan_ext (which holds TapeSAC's offline assets) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "assets"


ASSETS = _assets()
TOKENIZER_PATH = str(ASSETS / "tokenizer")
"""An offline tokenizer (tokenizer.json) for the debug jobs: nothing downloads at run time."""
DATASET_PATH = str(ASSETS / "text" / "corpus.jsonl")
"""An offline text corpus (JSON lines with a "text" field), registered as ``tapesac_text``."""
