import sys

from r1fit.cli import main

sys.exit(main())
