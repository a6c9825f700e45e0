import sys

from sublinear.tools.cli import main

sys.exit(main())
