import sys

from attnid.cli import main

sys.exit(main())
