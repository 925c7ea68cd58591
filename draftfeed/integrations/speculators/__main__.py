"""``python -m draftfeed.integrations.speculators train <speculators' train flags> --hidden-states-backend draftfeed
--draftfeed-url draftfeed://BROKER:PORT/SERVICE``: speculators' own trainer, in this process, with the draftfeed
backend registered (also under ``torchrun -m``)."""

from __future__ import annotations

import sys

from draftfeed.integrations.speculators.entry import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
