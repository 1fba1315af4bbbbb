"""What the tests share: connector and executor rigs, fault injection, gated storage, arena helpers."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's root
