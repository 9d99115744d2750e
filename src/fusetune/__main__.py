import sys

from fusetune.cli import main

sys.exit(main())
