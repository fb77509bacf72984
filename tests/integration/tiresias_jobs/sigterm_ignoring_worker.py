"""A worker that ignores SIGTERM and never polls for stop requests; writes its pid to PIDDIR."""
import os
import signal
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
piddir = sys.argv[1]
with open(os.path.join(piddir, f"worker-{os.getpid()}"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.1)
