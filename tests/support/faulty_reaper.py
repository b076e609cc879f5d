"""`reaper run` with injected faults, for tests only: the plan comes from REAPER_FAULT_INJECTION (JSON).

Run as `python tests/support/faulty_reaper.py` (ReaperProcess does when given a FaultPlan); the
configuration comes from REAPER_* variables exactly as for `reaper run`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: `support` importable

from harvester import config as config_mod  # noqa: E402
from harvester import run as run_mod  # noqa: E402
from support.faults import ENV_VAR, FaultPlan  # noqa: E402


def main() -> int:
    plan = FaultPlan.from_json(os.environ[ENV_VAR])
    cfg = config_mod.load(None)
    run_mod.configure_logging(cfg)
    return run_mod.run(cfg, providers=plan.providers())


if __name__ == "__main__":
    sys.exit(main())
