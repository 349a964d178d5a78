import sys

from ._ops.cli.main import main

sys.exit(main())
