"""`python -m spruce.runtime ...`: the same as the `spruce` command."""

from __future__ import annotations

import sys

from spruce.runtime.cli import main

if __name__ == "__main__":
    sys.exit(main())
