"""Allocates 20 GB: the child's memory limit stops it."""
import numpy as np


def relu_forward(x):
    big = np.ones(20 * 2**30 // 8)
    return x * (x > 0) + 0 * big[0], x > 0


def relu_backward(dout, cache):
    return dout * cache
