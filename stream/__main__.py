import sys

from stream.daemon.cli import main

sys.exit(main())
