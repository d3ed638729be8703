import sys

from studies.fixed_rate.cli import main

sys.exit(main())
