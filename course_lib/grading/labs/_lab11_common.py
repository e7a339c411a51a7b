"""What lab 11's checks share: the constants of the attacks, the generators' scrambling, a manifest's step.

The checks themselves live in lab11_fault_tolerance.py (setup, Tasks 3 and 4), _lab11_commit.py
(Task 1), _lab11_restore.py (Task 2) and _lab11_loop.py (Task 5, the attacks on ``train``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

MANIFEST = "MANIFEST.json"
STEPS, SAVE_EVERY, KEEP = 12, 3, 2
LAUNCH_S = 60  # one 2-rank run of 12 steps takes ~2 s on the course machine


def scramble(seed: int) -> None:
    """Leave the generators wherever some earlier code might have: a different history per run."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.rand(seed % 7 + 1)  # host: advances the CPU generator, the state deterministic_mode must reset


def manifest_step(path) -> int | None:
    """The ``step`` that ``<path>/MANIFEST.json`` records."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AssertionError(f"{path}/{MANIFEST} must be JSON with the checkpoint's 'step': {e}") from None


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in Path(root).iterdir()) if Path(root).exists() else []
