"""``python -m gds_kv_connector.cli``: the ``gds-kv`` command without its console script."""

import sys

from gds_kv_connector.cli.main import main

sys.exit(main())
