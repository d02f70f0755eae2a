"""Forks 300 processes that wait: the sandbox's process limit stops the fork long before."""
import os
import time


def relu_forward(x):
    for _ in range(300):
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
    return x * (x > 0), x > 0


def relu_backward(dout, cache):
    return dout * cache
