import sys

from atb_mem.cli import main

sys.exit(main())
