import sys

from services.encoder.train.cli import main

sys.exit(main())
