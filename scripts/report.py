#!/usr/bin/env python3
"""The newstest results' tables and plots: ``python scripts/report.py RESULTS.jsonl... [--out DIR]``.

The code is :mod:`fairseq_stream.newstest.report`; ``--help`` lists the options.
"""

import logging
import sys

# Importing the package imports fairseq, whose import-time notes are not this tool's output.
logging.getLogger("fairseq").setLevel(logging.WARNING)
from fairseq_stream.newstest.report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
