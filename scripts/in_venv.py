"""Run a script under the checkout's .venv (what scripts/setup made) when it was started with
another Python, e.g. as ``scripts/bench`` through its ``#!/usr/bin/env python3`` line, which
lacks the packages the script needs. A host without .venv (a GPU host's own torch) runs on."""

from __future__ import annotations

import os
import sys
from pathlib import Path

VENV = Path(__file__).resolve().parent.parent / ".venv"


def use_venv() -> None:
    python = VENV / "bin" / "python"
    if python.exists() and Path(sys.prefix).resolve() != VENV.resolve():
        os.execv(str(python), [str(python), *sys.argv])
