import sys

from gpuppetti.cli import main

sys.exit(main())
