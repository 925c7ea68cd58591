import sys

from draftfeed.launch.cli import main

sys.exit(main())
