"""`python -m dhelix.cli ...`: how the launcher, srun and the tests start ranks."""
import sys

from dhelix.cli import main

sys.exit(main())
