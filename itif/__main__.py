import sys

from itif.cli import main

sys.exit(main())
