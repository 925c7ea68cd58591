import sys

from draftfeed.launch.cli import launch_main

sys.exit(launch_main())
