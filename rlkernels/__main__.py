"""`python -m rlkernels COMMAND`: the `rlkernels` console script (cli.py)."""
import sys

from .cli import main

sys.exit(main())
