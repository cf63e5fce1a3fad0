"""A rank that starts and then waits to be stopped (tests of Ctrl-C and kill through launchers)."""
import os
import time
from pathlib import Path

Path(os.environ["MARK_DIR"], f"rank{os.environ.get('RANK', '0')}.pid").write_text(str(os.getpid()))
while True:
    time.sleep(0.2)
