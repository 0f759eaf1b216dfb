import sys

from atb_mem.tools.cli import main

sys.exit(main())
