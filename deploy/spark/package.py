#!/usr/bin/env python3
"""Build the tracker zip for `spark-submit --py-files`: `python deploy/spark/package.py [DIR]`.

Prints the zip's path (DIR, default dist/). Run it with the interpreter that has the tracker
installed; the name carries a hash of the contents, so a changed tracker gets a new zip.
"""

from __future__ import annotations

import sys

from tracker.spark import tracker_zip

if __name__ == "__main__":
    print(tracker_zip(sys.argv[1] if len(sys.argv) > 1 else "dist"))
