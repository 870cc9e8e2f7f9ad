import sys

from remask.cli import main

sys.exit(main())
