"""Fills /dev/shm and /tmp (memory: both are tmpfs) with 96 MB in files under the file size
limit, then waits: the grader sees the child's tmpfs grow past its limit and ends it."""
import os
import time


def relu_forward(x):
    for i in range(6):
        for folder in ("/dev/shm", "/tmp"):
            with open(os.path.join(folder, f"fill-{i}"), "wb") as f:
                f.write(b"\0" * (8 << 20))
    time.sleep(3)
    return x * (x > 0), x > 0


def relu_backward(dout, cache):
    return dout * cache
