import sys

from twostage_mla.cli import main

sys.exit(main())
