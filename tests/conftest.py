import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from testbed_leaks import testbed_leak_check  # noqa: E402,F401  (session-wide leak check)
