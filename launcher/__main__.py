import sys

from kvferry.launcher.cli import main

sys.exit(main())
