import sys

from lpcache.edge.cli import main

sys.exit(main())
