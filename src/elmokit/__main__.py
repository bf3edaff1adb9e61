import sys

from elmokit.cli import main

sys.exit(main())
