import sys

from opskit.train.main import main

sys.exit(main())
